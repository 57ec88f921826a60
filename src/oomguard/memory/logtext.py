"""The text vLLM prints at startup, by release: the KV capacity lines, the fit and
out-of-memory errors and the auto-fit lines (docs/memory-model.md §6, §7). :func:`oomguard.memory.
engine.predict` decides what happened; this module words it the way the release does.
"""

from __future__ import annotations

from oomguard.memory.versions import VllmEra

GIB = 2**30


def format_gib(num_bytes: float) -> str:
    """vLLM's ``format_gib``: ``str(round(b / 2**30, 2))`` (trailing zeros dropped)."""
    return str(round(num_bytes / GIB, 2))


def _gib_text(era: VllmEra, num_bytes: float) -> str:
    return format_gib(num_bytes) if era.format_gib else f"{num_bytes / GIB:.2f}"


def _device_label(platform: str) -> str:
    return "CPU" if platform == "cpu" else "GPU"


def kv_capacity_lines(
    era: VllmEra, platform: str, tokens: int, max_model_len: int, concurrency: float
) -> list[str]:
    """The "KV cache size" / "Maximum concurrency" line(s) of this release (§6)."""
    if era.engine == "v0":
        return [f"Maximum concurrency for {max_model_len} tokens per request: {concurrency:.2f}x"]
    size = f"KV cache size: {tokens:,} tokens"
    conc = f"Maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    if era.kv_line_form == "two_lines":
        return [f"GPU {size}", conc]
    if era.kv_line_form == "combined":
        return [f"GPU {size}, {conc}"]
    return [f"{_device_label(platform)} {size}, {conc}"]


def fit_error_text(
    era: VllmEra, max_model_len: int, needed: int, available: int, estimate: int
) -> str:
    """The ValueError vLLM raises when one request at max_model_len does not fit (§7.2)."""
    tail_13 = (
        " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
    if era.fit_error_form in ("v10", "v13"):
        est = (
            f"Based on the available memory, the estimated maximum model length is {estimate}."
            if estimate > 0
            else ""
        )
        text = (
            f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({needed / GIB:.2f} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({available / GIB:.2f} GiB). {est} Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
        )
        return text + (tail_13 if era.fit_error_form == "v13" else "")
    est = (
        f"Based on the available memory, the estimated maximum model length is {estimate}. "
        if estimate > 0
        else ""
    )
    if era.fit_error_form == "v14":
        return (
            f"To serve at least one request with the models's max seq len ({max_model_len}), "
            f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV "
            f"cache memory ({format_gib(available)} GiB). {est}Try increasing "
            "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
            + tail_13
        )
    return (
        f"To serve at least one request with the model's max seq len ({max_model_len}), "
        f"({format_gib(needed)} GiB KV cache is needed, which is larger than the available KV "
        f"cache memory ({format_gib(available)} GiB). {est}Try increasing "
        "`gpu_memory_utilization` (which also controls CPU memory on the CPU backend) or "
        "decreasing `max_model_len` when initializing the engine." + tail_13
    )


def no_memory_error_text(era: VllmEra) -> str:
    """The ValueError for a zero or negative KV budget (§7.2)."""
    base = (
        "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` "
        "when initializing the engine"
    )
    docs = " See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    if era.no_memory_error_form == "v10":
        return base + "."
    if era.no_memory_error_form == "v13":
        return base + "." + docs
    return (
        base
        + " (this flag also controls CPU memory reservation on the CPU backend, despite its name)."
        + docs
    )


def free_memory_error_text(
    era: VllmEra, free: int, total: int, util: float, requested: float
) -> str:
    """The startup ValueError when free device memory is below the requested budget (§2.1)."""
    tail = "Decrease GPU memory utilization or reduce GPU memory used by other processes."
    if era.free_memory_error_form == "v10":
        return (
            f"Free memory on device ({round(free / GIB, 2)}/{round(total / GIB, 2)} GiB) on "
            f"startup is less than desired GPU memory utilization ({util}, "
            f"{round(requested / GIB, 2)} GiB). {tail}"
        )
    return (
        f"Free memory on device cuda:0 ({format_gib(free)}/{format_gib(total)} GiB) on startup is "
        f"less than desired GPU memory utilization ({util}, {format_gib(requested)} GiB). {tail}"
    )


def available_kv_line(era: VllmEra, available: int) -> str:
    return f"Available KV cache memory: {_gib_text(era, available)} GiB"


def override_line(num_blocks: int, override: int) -> str:
    return f"Overriding num_gpu_blocks={num_blocks} with num_gpu_blocks_override={override}"


def v0_blocks_line(blocks: int, bytes_per_block: int) -> str:
    cpu_blocks = int(4 * GIB // bytes_per_block) if bytes_per_block else 0
    return f"# cuda blocks: {blocks}, # CPU blocks: {cpu_blocks}"


def v0_max_len_error_text(max_len: int, est_len: int) -> str:
    """V0's ValueError when one request at max_model_len exceeds the KV cache."""
    return (
        f"The model's max seq len ({max_len}) is larger than the maximum number of tokens "
        f"that can be stored in KV cache ({est_len}). Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    )


AUTO_FIT_FAILED_TEXT = (
    "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a "
    "single token. Try increasing `gpu_memory_utilization`."
)


def auto_fit_line(era: VllmEra, platform: str, max_len: int, fit_len: int, check_mem: int) -> str:
    """The auto-fit line: the full context fits, or it is reduced to ``fit_len``."""
    kv_text = f"{format_gib(check_mem)} GiB {_device_label(platform)}"
    v14 = era.auto_fit_log_form == "v14"
    if fit_len >= max_len:
        return (
            f"Auto-fit max_model_len: full model context length {max_len} fits in "
            "available GPU memory"
            if v14
            else (
                f"Auto-fit max_model_len: full model context length {max_len} fits in available "
                f"KV cache memory ({kv_text})"
            )
        )
    return (
        f"Auto-fit max_model_len: reduced from {max_len} to {fit_len} to fit in available GPU "
        f"memory ({format_gib(check_mem)} GiB available for KV cache)"
        if v14
        else (
            f"Auto-fit max_model_len: reduced from {max_len} to {fit_len} to fit in available KV "
            f"cache memory ({kv_text})"
        )
    )


def weights_exceed_gpu_text(weights_gib: float, total: int) -> str:
    return (
        f"weights need {weights_gib:.2f} GiB per rank but the device has "
        f"{total / GIB:.2f} GiB: loading fails with an out-of-memory error"
    )


def weights_exceed_budget_text(
    weights_gib: float, requested: float, util: float, total: int
) -> str:
    return (
        f"weights need {weights_gib:.2f} GiB per rank, more than the {requested / GIB:.2f} GiB "
        f"budget (util {util} × {total / GIB:.2f} GiB): they load, then nothing is left "
        "for the KV cache"
    )


# vllm 0.32 v1/kv_cache_interface.py SlidingWindowSpec.max_memory_usage_bytes (an assertion)
DCP_SLIDING_WINDOW_TEXT = "DCP not support sliding window."


def mamba_blocks_error_text(max_num_seqs: int, num_blocks: int) -> str:
    """vllm 0.32 config/compilation.py: FULL graphs need one Mamba block per decode sequence."""
    return (
        f"max_num_seqs ({max_num_seqs}) exceeds available Mamba cache blocks ({num_blocks}). "
        "Each decode sequence requires one Mamba cache block, so CUDA graph capture cannot "
        f"proceed. Please lower max_num_seqs to at most {num_blocks} or increase "
        "gpu_memory_utilization."
    )


def sleep_line(freed_bytes: int, used_bytes: int) -> str:
    """What ``Worker.sleep`` logs (vllm 0.32 v1/worker/gpu_worker.py)."""
    return (
        f"Sleep mode freed {format_gib(freed_bytes)} GiB memory, "
        f"{format_gib(used_bytes)} GiB memory is still in use."
    )
