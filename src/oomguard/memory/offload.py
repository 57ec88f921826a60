"""KV offloading and KV connectors: the GPU pool as vLLM sizes it, and the host memory (§14.2).

Facts from vllm 0.32:
- ``config/vllm.py`` ``_post_init_kv_transfer_config``: ``--kv-offloading-size S`` with the
  ``native`` backend becomes ``OffloadingConnector`` (``SimpleCPUOffloadConnector`` with
  ``VLLM_USE_SIMPLE_KV_OFFLOAD``) with ``cpu_bytes_to_use = S × 2^30``; with ``lmcache`` it
  becomes ``LMCacheMPConnector`` and the size is not passed on (the LMCache server holds it).
- ``config/cache.py``: the size is the total over the TP ranks; ``v1/kv_offload/cpu/spec.py``
  divides ``cpu_bytes_to_use`` by the bytes of one chunk of every worker, so one engine pins at
  most S GiB of host memory (``v1/kv_offload/cpu/gpu_worker.py``: pinned ``torch.zeros`` on
  the CPU); each data-parallel engine has its own.
- ``v1/worker/gpu_worker.py`` ``determine_available_memory`` has no connector term: the GPU KV
  pool is sized as without offloading.
- ``config/vllm.py``: a connector whose class does not implement ``SupportsHMA``
  (``distributed/kv_transfer/kv_connector/v1/base.py``) turns the hybrid KV-cache manager off
  unless the user set it, so sliding-window layers keep KV for the full length and hybrid
  Mamba models fail ("hybrid SSM models (e.g. Jamba, Bamba) require HMA").
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.errors import BadInput
from oomguard.memory.compilation import parse_json_object
from oomguard.units import GIB

KV_OFFLOADING_BACKENDS = ("native", "lmcache")
# connectors whose class implements SupportsHMA in vllm 0.32 (kv_connector/v1/*: class lines)
HMA_CONNECTORS = frozenset(
    {
        "OffloadingConnector",
        "SimpleCPUOffloadConnector",
        "NixlConnector",
        "NixlPullConnector",
        "NixlPushConnector",
        "MooncakeConnector",
        "MooncakeStoreConnector",
        "MoRIIOConnector",
        "HiSparseConnector",
        "DecodeBenchConnector",
        "ExampleHiddenStatesConnector",
    }
)
# connectors whose host memory is the size vLLM hands them (cpu_bytes_to_use)
_SIZED_CONNECTORS = frozenset({"OffloadingConnector", "SimpleCPUOffloadConnector"})


@dataclass(frozen=True)
class Connector:
    """The KV connector the settings configure (vLLM's resolved ``kv_transfer_config``)."""

    name: str
    supports_hma: bool
    host_bytes: int | None  # pinned host memory of one engine; None: not priced here
    unpriced: str | None = None  # why the host memory cannot be priced, for the plan


def _child_names(extra: dict[str, object]) -> list[str]:
    children = extra.get("connectors")
    if not isinstance(children, list):
        return []
    return [str(c.get("kv_connector")) for c in children if isinstance(c, dict)]


def _transfer_connector(text: str) -> Connector:
    """The connector a ``--kv-transfer-config`` JSON names."""
    data = parse_json_object(text, "--kv-transfer-config")
    name = data.get("kv_connector")
    if not isinstance(name, str) or not name:
        raise BadInput(
            "--kv-transfer-config names no kv_connector",
            """write e.g. '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'""",
        )
    extra = data.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise BadInput(
            "kv_connector_extra_config must be a JSON object", "write {} or a key: value map"
        )
    if name == "MultiConnector":
        children = _child_names(extra)
        hma = bool(children) and all(c in HMA_CONNECTORS for c in children)
    else:
        hma = name in HMA_CONNECTORS
    size = extra.get("cpu_bytes_to_use")
    if name in _SIZED_CONNECTORS and isinstance(size, (int, float)) and size > 0:
        return Connector(name, hma, int(size))
    return Connector(name, hma, None, f"{name}'s host memory is set outside vLLM's flags")


def kv_connector(
    kv_offloading_size: float | None,
    kv_offloading_backend: str,
    kv_transfer_config: str | None,
) -> Connector | None:
    """The connector vLLM runs with these flags (None: none), as ``_post_init_kv_transfer_config``
    resolves it: the offloading flags override the connector named in the JSON."""
    if kv_offloading_backend not in KV_OFFLOADING_BACKENDS:
        raise BadInput(
            f"--kv-offloading-backend {kv_offloading_backend!r} is not a backend vLLM has",
            "use native or lmcache",
        )
    if kv_offloading_size is not None:
        if kv_offloading_size <= 0:
            raise BadInput(
                f"--kv-offloading-size {kv_offloading_size:g} must be positive",
                "pass the host memory for offloaded KV in GiB, e.g. 64",
            )
        if kv_transfer_config is not None:
            _transfer_connector(kv_transfer_config)  # still checked: vLLM parses it first
        if kv_offloading_backend == "native":
            return Connector("OffloadingConnector", True, int(kv_offloading_size * GIB))
        return Connector(
            "LMCacheMPConnector", False, None, "the LMCache server holds the offloaded KV"
        )
    if kv_transfer_config is None:
        return None
    return _transfer_connector(kv_transfer_config)
