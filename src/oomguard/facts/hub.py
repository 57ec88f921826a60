"""Model facts from the Hugging Face hub: ``config.json`` and safetensors metadata only.

Never downloads weights. Every call runs under a hard deadline so a dead network cannot hang
the CLI; offline mode (``HF_HUB_OFFLINE``) and every hub failure become :class:`UnknownModel`
naming the local alternatives.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from oomguard.errors import EnvironmentProblem, MalformedConfig, UnknownModel
from oomguard.facts.config_reader import spec_from_config
from oomguard.facts.local import read_json
from oomguard.memory.dtypes import SAFETENSORS_DTYPE_BYTES
from oomguard.memory.spec import ModelSpec

DEFAULT_TIMEOUT_S = 8.0
_T = TypeVar("_T")


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    return any(
        os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _alternatives(repo_id: str) -> str:
    from oomguard.facts.catalogue import LOCAL_MODEL_HINT, closest_names

    close = closest_names(repo_id)
    near = f"closest catalogue names: {', '.join(close)}; " if close else ""
    return f"{near}or " + LOCAL_MODEL_HINT


def _with_deadline(fn: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """Run ``fn`` in a daemon thread; give up after ``timeout_s`` (the thread is abandoned)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=run, name=f"oomguard-hub-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"{what} took longer than {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def spec_from_hub(
    repo_id: str,
    *,
    revision: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    endpoint: str | None = None,
    token: str | bool | None = None,
) -> ModelSpec:
    """ModelSpec for a hub repo: its ``config.json`` plus parameter bytes by dtype.

    Raises :class:`UnknownModel` (with the local alternatives) when offline, unreachable within
    ``timeout_s``, gated, or not found. Safetensors metadata is best effort: when it cannot be
    had the spec simply carries no checkpoint bytes.
    """
    if hub_offline():
        raise UnknownModel(
            f"model {repo_id!r} is not in the catalogue and HF_HUB_OFFLINE is set",
            _alternatives(repo_id),
        )
    try:
        config_path = _with_deadline(
            lambda: _fetch_config(repo_id, revision, timeout_s, endpoint, token),
            timeout_s,
            "config.json",
        )
    except Exception as exc:  # noqa: BLE001 - every hub failure means "no facts from the hub"
        reason = _describe(exc)
        raise UnknownModel(
            f"model {repo_id!r} could not be fetched from the hub ({reason})",
            _alternatives(repo_id),
        ) from None
    from pathlib import Path

    config = read_json(Path(config_path))
    if not isinstance(config, dict):
        raise MalformedConfig(f"config.json of {repo_id} is not a JSON object", "check the repo")

    from huggingface_hub import HfApi

    bytes_by_dtype: dict[str, int] = {}
    try:
        meta = _with_deadline(
            lambda: HfApi(endpoint=endpoint).get_safetensors_metadata(
                repo_id, revision=revision, token=token, timeout=timeout_s
            ),
            timeout_s,
            "safetensors metadata",
        )
        for dtype, count in dict(meta.parameter_count).items():
            bytes_by_dtype[dtype] = int(count * SAFETENSORS_DTYPE_BYTES.get(dtype, 2))
    except Exception:  # noqa: BLE001 - bytes are an optional refinement
        bytes_by_dtype = {}
    return spec_from_config(
        config,
        name=repo_id,
        source=f"hub {repo_id}" + (f"@{revision}" if revision else ""),
        param_bytes_by_dtype=bytes_by_dtype,
    )


def _no_retry_kwargs(fn: Callable[..., Any]) -> dict[str, Any]:
    """``retry_on_errors=False`` where huggingface_hub has it (newer releases retry by default
    in some paths; older ones take no such argument and make a single request)."""
    import inspect

    return (
        {"retry_on_errors": False} if "retry_on_errors" in inspect.signature(fn).parameters else {}
    )


class HubUnreachable(EnvironmentProblem):
    """The hub did not answer the first request (no retries are made) and nothing is cached."""


def _fetch_config(
    repo_id: str,
    revision: str | None,
    timeout_s: float,
    endpoint: str | None,
    token: str | bool | None,
) -> str:
    """Local path of the repo's ``config.json``: one HEAD request without retries, then download.

    ``hf_hub_download`` alone retries a failed first request with back-off (five tries, seconds
    apart) before it looks at its cache; a planner that is offline should answer at once. So the
    HEAD goes first with retries off; if the hub cannot be reached a cached copy is used, else
    :class:`HubUnreachable`. HTTP answers (404, gated, 5xx) propagate as huggingface_hub errors.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    url = hf_hub_url(repo_id, "config.json", revision=revision, endpoint=endpoint)
    try:
        get_hf_file_metadata(
            url, token=token, timeout=timeout_s, **_no_retry_kwargs(get_hf_file_metadata)
        )
    except HfHubHTTPError:
        raise
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS failure, read timeout
        try:
            return str(
                hf_hub_download(
                    repo_id,
                    "config.json",
                    revision=revision,
                    endpoint=endpoint,
                    token=token,
                    local_files_only=True,
                )
            )
        except Exception:  # noqa: BLE001 - not cached either
            raise HubUnreachable(
                f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            ) from None
    return str(
        hf_hub_download(
            repo_id,
            "config.json",
            revision=revision,
            endpoint=endpoint,
            token=token,
            etag_timeout=timeout_s,
        )
    )


def _describe(exc: BaseException) -> str:
    name = type(exc).__name__
    if name in ("RepositoryNotFoundError", "RemoteEntryNotFoundError", "EntryNotFoundError"):
        return "no such repo or no config.json in it"
    if name == "GatedRepoError":
        return "the repo is gated: accept its licence and set HF_TOKEN"
    if name in ("LocalEntryNotFoundError", "OfflineModeIsEnabled"):
        return "network unreachable and nothing cached"
    if isinstance(exc, HubUnreachable):
        return f"hub unreachable and config.json not cached: {exc}"
    if isinstance(exc, TimeoutError):
        return str(exc)
    text = str(exc).splitlines()[0] if str(exc) else name
    return f"{name}: {text[:160]}"
