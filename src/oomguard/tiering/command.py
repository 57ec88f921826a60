"""Render a llama-server command line from :class:`LlamaCppSettings` (argv list or one line).

Every setting that decides memory is written out, so the server allocates what was
predicted: ``--fit off`` stops llama-server's own fitting from changing the split or the
context it was given, an explicit ``--n-gpu-layers`` replaces the ``auto`` default, and
``--log-verbosity 4`` makes it print the buffer sizes it allocates.
"""

from __future__ import annotations

import shlex

from oomguard.tiering.settings import LlamaCppSettings


def llama_server_argv(
    model_path: str,
    settings: LlamaCppSettings,
    *,
    binary: str = "llama-server",
    host: str | None = None,
    port: int | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The argv that runs ``model_path`` with ``settings`` (``extra`` is appended as given)."""
    argv = [
        binary,
        "--model",
        model_path,
        "--ctx-size",
        str(settings.ctx_size),
        "--parallel",
        str(settings.parallel),
    ]
    if settings.kv_unified:
        argv.append("--kv-unified")
    if settings.gpu_count:
        ngl = "all" if settings.n_gpu_layers < 0 else str(settings.n_gpu_layers)
        argv += ["--n-gpu-layers", ngl]
        if settings.cpu_moe:
            argv.append("--cpu-moe")
        if settings.n_cpu_moe:
            argv += ["--n-cpu-moe", str(settings.n_cpu_moe)]
        if settings.tensor_split:
            argv += ["--tensor-split", ",".join(f"{s:g}" for s in settings.tensor_split)]
    else:
        argv += ["--n-gpu-layers", "0"]
    for rule in settings.overrides:
        device = rule.device if rule.device == "CPU" else rule.device.replace("GPU", "CUDA")
        argv += ["--override-tensor", f"{rule.pattern}={device}"]
    if settings.cache_type_k != "f16":
        argv += ["--cache-type-k", settings.cache_type_k]
    if settings.cache_type_v != "f16":
        argv += ["--cache-type-v", settings.cache_type_v]
    argv += ["--flash-attn", "on" if settings.flash_attn else "off"]
    if settings.batch_size != 2048:
        argv += ["--batch-size", str(settings.batch_size)]
    if settings.ubatch_size != 512:
        argv += ["--ubatch-size", str(settings.ubatch_size)]
    if settings.cpu_repack == "none":
        argv.append("--no-repack")
    if not settings.kv_offload:
        argv.append("--no-kv-offload")
    if not settings.mmap:
        argv += ["--load-mode", "none"]
    # --fit off: llama-server's own fitting would change the split or context it was given;
    # verbosity 4 prints the load lines (buffer sizes) the prediction is checked against
    argv += ["--fit", "off", "--log-verbosity", "4"]
    if host is not None:
        argv += ["--host", host]
    if port is not None:
        argv += ["--port", str(port)]
    argv += list(extra)
    return argv


def render_llama_server(model_path: str, settings: LlamaCppSettings, **kwargs: object) -> str:
    """:func:`llama_server_argv` as one shell-quoted line."""
    return shlex.join(llama_server_argv(model_path, settings, **kwargs))  # type: ignore[arg-type]
