"""Search for the cheapest vLLM configuration that serves a workload, and the ways out when none
does.

The search follows the OOM checklist (seeds: "the eight-step checklist"): cap
``gpu_memory_utilization`` to what is free after co-tenants, cap ``max_model_len`` to the P99,
cap ``max_num_seqs`` to the real concurrency, lower ``max_num_batched_tokens``, then spread over
the GPUs the user already has (no quality cost), then fp8 KV cache, then a quantized checkpoint
(fp8, then int4), and finally prefix caching only when prefixes are shared. Each step is tried
only when the cheaper ones do not serve the workload; within a step the least aggressive value
that serves wins. Every candidate is priced by :func:`oomguard.memory.engine.predict`; the search
is bounded (a few dozen predictions) so a plan takes well under a second.

"Serves" is vLLM's own figure: the maximum concurrency at ``max_model_len = p99_tokens`` (which
already accounts for per-request blocks, sliding windows and Mamba state) must reach
``concurrency × (1 + margin)``, with the concurrency reduced for a prefix all requests share.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from oomguard.errors import OomguardError
from oomguard.facts import known_quantized_variants, resolve_model
from oomguard.memory.engine import EngineSettings, MeasuredTerms, MemoryPrediction, predict
from oomguard.memory.spec import AttentionKind, GPUSpec, ModelSpec, QuantSpec
from oomguard.memory.weights import resolve_model_dtype
from oomguard.plan.result import (
    Alternative,
    Candidate,
    FlagReason,
    Recommendation,
    ServeCheck,
    SizingRow,
    Workload,
)
from oomguard.units import GIB, MIB, gib_label
from oomguard.vllm_args import render_serve

# vLLM's own CUDA context (and NCCL communicators with TP > 1) are created before the free-memory
# check, so they come out of what is free, not out of the requested budget. Estimate.
CONTEXT_RESERVE_BYTES = 512 * MIB
NCCL_RESERVE_BYTES = 256 * MIB
# Lower max_num_batched_tokens only down to this; below it long prompts prefill very slowly.
_BATCHED_TOKEN_STEPS = (4096, 2048, 1024, 512)
_COUNTS = (1, 2, 4, 8)
PCIE_GBPS = 25.0  # PCIe 4.0 x16, achievable host→device bandwidth


@dataclass(frozen=True)
class WeightsOption:
    """How the weights are stored for one candidate.

    ``known`` is False for an int4 checkpoint that the catalogue does not list: it is priced
    (to say what quantizing would buy) but never recommended as a runnable command.
    """

    key: str  # "native" | "fp8" | "int4"
    label: str
    model_ref: str
    model: ModelSpec
    quantization: str | None  # the --quantization value to pass (None: autodetect / unquantized)
    known: bool = True


@dataclass
class SearchSpace:
    """Everything the search holds fixed, and the knobs it may turn."""

    model_ref: str
    model: ModelSpec
    gpu: GPUSpec
    gpu_count: int
    base: EngineSettings
    fixed: frozenset[str]
    workload: Workload
    free_bytes: int | None = None  # NVML free memory of the emptiest-enough GPU (None: empty)
    # the calibration store, asked with each configuration's settings (native weights only)
    measured: Callable[[EngineSettings], MeasuredTerms | None] | None = None
    cache: dict[Any, MemoryPrediction] = field(default_factory=dict)
    predictions: int = 0
    _default_util: float | None = None

    @property
    def dp(self) -> int:
        """Data-parallel ranks: independent engines, each with its own KV pool and sequences."""
        return max(1, self.base.data_parallel_size)

    @property
    def gpus_per_replica(self) -> int:
        """GPUs besides tensor parallelism that one configuration takes (PP × DP)."""
        return self.base.pipeline_parallel_size * self.dp

    def concurrency_per_rank(self) -> int:
        """The workload's peak concurrency one data-parallel rank must hold (ceil split)."""
        return -(-self.workload.concurrency // self.dp)

    def default_util(self) -> float:
        """vLLM's default ``gpu_memory_utilization`` for this version (or the user's value)."""
        if self.base.gpu_memory_utilization is not None:
            return float(self.base.gpu_memory_utilization)
        if self._default_util is None:
            native = WeightsOption("native", "", self.model_ref, self.model, self.base.quantization)
            probe = self.price(
                native, dataclasses.replace(self.base, max_model_len=self.workload.p99_tokens)
            )
            self._default_util = float(probe.settings.gpu_memory_utilization or 0.9)
        return self._default_util

    # -- pricing ------------------------------------------------------------------------------

    def effective_free_bytes(self, tp: int) -> int | None:
        """Free memory at vLLM's check: NVML free (or total) less co-tenant headroom and context."""
        if self.free_bytes is None and self.workload.headroom_bytes == 0:
            return None
        free = self.gpu.total_bytes if self.free_bytes is None else self.free_bytes
        reserve = CONTEXT_RESERVE_BYTES + (NCCL_RESERVE_BYTES if tp > 1 else 0)
        return max(0, free - self.workload.headroom_bytes - reserve)

    def price(
        self, weights: WeightsOption, settings: EngineSettings, gpu: GPUSpec | None = None
    ) -> MemoryPrediction:
        """Predict (cached) one configuration on ``gpu`` (default: the search's GPU)."""
        gpu = gpu or self.gpu
        free = self.effective_free_bytes(settings.tensor_parallel_size) if gpu is self.gpu else None
        use_measured = weights.key == "native" and self.measured is not None and gpu is self.gpu
        key = (weights.key, gpu.name, gpu.total_bytes, free, use_measured, settings)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        measured = None
        if use_measured and self.measured is not None:
            measured = self.measured(settings)
        pred = predict(
            weights.model, gpu, settings, free_bytes=free, measured=measured, strict=False
        )
        self.predictions += 1
        self.cache[key] = pred
        return pred

    def share_factor(self, settings: EngineSettings) -> float:
        """Fraction of per-request KV left after a shared prefix is stored once.

        Only for pure full/MLA attention with prefix caching on; sliding windows drop the prefix
        and Mamba state is per request, so those are priced without sharing (conservative).
        """
        w = self.workload
        if w.shared_prefix_tokens <= 0 or settings.enable_prefix_caching is False:
            return 1.0
        kinds = {layer.kind for layer in self.model.layers}
        if not kinds <= {AttentionKind.FULL, AttentionKind.MLA, AttentionKind.NONE}:
            return 1.0
        shared = min(w.shared_prefix_tokens, w.p99_tokens)
        per_request = (w.p99_tokens - shared) + shared / self.concurrency_per_rank()
        return per_request / w.p99_tokens

    def serve_check(
        self,
        weights: WeightsOption,
        settings: EngineSettings,
        pred: MemoryPrediction,
        gpu: GPUSpec | None = None,
    ) -> ServeCheck:
        """Does ``settings`` serve the workload? Uses vLLM's concurrency at max_model_len = P99."""
        w = self.workload
        factor = self.share_factor(settings)
        per_rank = self.concurrency_per_rank()  # each DP rank has its own pool
        effective = per_rank * factor
        required = effective * (1 + w.margin)
        needed_tokens = math.ceil(per_rank * w.p99_tokens * factor * (1 + w.margin))
        max_len = pred.settings.max_model_len
        check = pred
        reason = ""
        if max_len is not None and max_len < w.p99_tokens:
            return ServeCheck(
                False,
                0.0,
                required,
                effective,
                needed_tokens,
                -1.0,
                f"max_model_len {max_len} is below the P99 of {w.p99_tokens} tokens",
            )
        if max_len != w.p99_tokens:
            check = self.price(
                weights, dataclasses.replace(settings, max_model_len=w.p99_tokens), gpu
            )
        conc = float(check.max_concurrency) if pred.fits else 0.0
        served = pred.fits and conc >= required
        if not pred.fits:
            reason = pred.problems[0].message if pred.problems else "does not start"
        elif not served:
            reason = (
                f"{conc:.2f} concurrent requests of {w.p99_tokens} tokens fit; "
                f"{required:.2f} needed (incl. {w.margin:.0%} margin)"
            )
        achieved = conc / effective - 1 if effective else 0.0
        spread = tuple(float(c) for c in check.max_concurrency_range) if pred.fits else (0.0, 0.0)
        return ServeCheck(
            served,
            conc,
            required,
            effective,
            needed_tokens,
            achieved,
            reason,
            (spread[0], spread[1]),
        )

    def candidate(
        self,
        weights: WeightsOption,
        settings: EngineSettings,
        gpu: GPUSpec | None = None,
        count: int | None = None,
    ) -> Candidate:
        """Price ``settings`` and wrap it with its serve check."""
        pred = self.price(weights, settings, gpu)
        check = self.serve_check(weights, settings, pred, gpu)
        return Candidate(
            model_ref=weights.model_ref,
            model=weights.model,
            gpu=gpu or self.gpu,
            gpu_count=count if count is not None else self.gpu_count,
            settings=settings,
            prediction=pred,
            serve=check,
            weights_label=_label_on(weights, gpu or self.gpu, settings),
            weights_key=weights.key,
        )


# --------------------------------------------------------------------------------------------
# Knob values


def valid_tp_sizes(model: ModelSpec, max_gpus: int) -> list[int]:
    """TP sizes vLLM accepts for ``model`` on at most ``max_gpus`` GPUs (heads divisible)."""
    sizes = []
    for tp in range(1, max_gpus + 1):
        if model.num_attention_heads % tp:
            continue
        kv = model.num_kv_heads
        if kv and not (kv % tp == 0 or tp % kv == 0):
            continue
        sizes.append(tp)
    return sizes


def _dtype_label(model: ModelSpec, gpu: GPUSpec | None = None, dtype: str = "auto") -> str:
    """How the native weights load: the checkpoint's format, or the dtype vLLM picks on ``gpu``.

    GPUs without bf16 (compute capability below 8.0: V100, T4) load a bf16 checkpoint as fp16.
    """
    if model.quant.method:
        return f"{model.quant.method} checkpoint"
    loaded = resolve_model_dtype(model, dtype, gpu.compute_capability if gpu else "")
    label = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(loaded, loaded)
    if model.dtype == "float32" and loaded != "float32":
        label += " (fp32 checkpoint)"
    elif model.dtype == "bfloat16" and loaded == "float16" and dtype in ("auto", None):
        label += " (no bf16 on this GPU)"
    return label


def _label_on(weights: WeightsOption, gpu: GPUSpec, settings: EngineSettings) -> str:
    """The weights label of ``weights`` priced on ``gpu`` (native dtype follows the GPU)."""
    if weights.key != "native" or weights.quantization or weights.model.quant.method:
        return weights.label
    return _dtype_label(weights.model, gpu, settings.dtype)


# Preference among catalogued 4-bit formats: vLLM's Marlin kernels serve AWQ, GPTQ and
# compressed-tensors w4a16 at full speed with TP; bitsandbytes is slower and last.
_INT4_METHOD_ORDER = ("awq", "gptq", "compressed-tensors", "bitsandbytes")
_METHOD_LABEL = {
    "awq": "AWQ",
    "gptq": "GPTQ",
    "compressed-tensors": "w4a16",
    "bitsandbytes": "bnb 4-bit",
}
NO_INT4_REPO = (
    "no AWQ/GPTQ repo of this model is in the catalogue; quantize it yourself or search the hub "
    "for one"
)


@functools.lru_cache(maxsize=64)
def catalogued_variants(model_ref: str) -> tuple[tuple[str, QuantSpec], ...]:
    """Quantized checkpoints of ``model_ref`` the catalogue lists (empty when none or unknown)."""
    try:
        return tuple(known_quantized_variants(model_ref))
    except OomguardError:
        return ()


@functools.lru_cache(maxsize=64)
def int4_variant(model_ref: str) -> tuple[str, ModelSpec] | None:
    """The preferred catalogued ≤4-bit checkpoint of ``model_ref`` and its own ModelSpec."""
    four_bit = [(repo, q) for repo, q in catalogued_variants(model_ref) if q.weight_bits <= 4]

    def rank(item: tuple[str, QuantSpec]) -> tuple[int, str]:
        method = (item[1].method or "").lower()
        order = _INT4_METHOD_ORDER.index(method) if method in _INT4_METHOD_ORDER else 99
        return order, item[0].lower()

    for repo, _quant in sorted(four_bit, key=rank):
        try:
            return repo, resolve_model(repo, allow_hub=False)
        except OomguardError:
            continue
    return None


def fp8_checkpoint(model_ref: str) -> str | None:
    """A catalogued FP8 checkpoint of ``model_ref`` (named as the online fp8 option's twin)."""
    for repo, quant in catalogued_variants(model_ref):
        if (quant.method or "").lower() == "fp8":
            return repo
    return None


def _int4_label(model: ModelSpec) -> str:
    method = (model.quant.method or "").lower()
    return f"int4 {_METHOD_LABEL.get(method, method)} checkpoint"


def weights_options(
    model_ref: str, model: ModelSpec, gpu: GPUSpec, base: EngineSettings, fixed: frozenset[str]
) -> list[WeightsOption]:
    """Native weights first, then (unquantized checkpoints only) online fp8, then int4.

    The int4 option is the catalogue's own quantized repo of the model, priced with that repo's
    ModelSpec; when the catalogue lists none, it is a hypothetical AWQ int4 (``known=False``).
    """
    native = WeightsOption(
        "native",
        _dtype_label(model, gpu, base.dtype)
        if not base.quantization
        else f"--quantization {base.quantization}",
        model_ref,
        model,
        base.quantization,
    )
    options = [native]
    if model.quant.method or base.quantization or "quantization" in fixed:
        return options
    cc = gpu.compute_capability
    fp8_ok = gpu.vendor == "amd" or not cc or float(cc) >= 8.0
    if fp8_ok:
        options.append(WeightsOption("fp8", "online fp8", model_ref, model, "fp8"))
    variant = int4_variant(model_ref)
    if variant is not None:
        repo, spec = variant
        options.append(WeightsOption("int4", _int4_label(spec), repo, spec, None))
    else:
        awq = dataclasses.replace(model, quant=HYPOTHETICAL_AWQ)
        options.append(
            WeightsOption("int4", "int4 AWQ (not catalogued)", model_ref, awq, None, known=False)
        )
    return options


# AWQ int4 as published by AutoAWQ (group 128, zero points): what quantizing yourself gives.
HYPOTHETICAL_AWQ = QuantSpec(
    method="awq", weight_bits=4, group_size=128, zero_point=True, scale_granularity="group"
)


def weights_of(c: Candidate) -> WeightsOption:
    """The weights option a candidate was priced with (to price variations of it)."""
    return WeightsOption(
        c.weights_key, c.weights_label, c.model_ref, c.model, c.settings.quantization
    )


# --------------------------------------------------------------------------------------------
# The search


@dataclass(frozen=True)
class SearchOutcome:
    """Result of one bounded search: the winner (if any) and the most capable candidate tried."""

    best: Candidate | None
    most_capable: Candidate | None
    steps: tuple[str, ...]


def _util_cap(space: SearchSpace, tp: int) -> float | None:
    free = space.effective_free_bytes(tp)
    if free is None:
        return None
    return math.floor(free / space.gpu.total_bytes * 100) / 100


def base_settings(
    space: SearchSpace, default_util: float, tp: int
) -> tuple[EngineSettings, list[str]]:
    """The checklist's first three steps (utilization, max_model_len, max_num_seqs) on ``base``."""
    s = space.base
    steps: list[str] = []
    changes: dict[str, Any] = {}
    if "gpu_memory_utilization" not in space.fixed and "kv_cache_memory_bytes" not in space.fixed:
        cap = _util_cap(space, tp)
        util = default_util if cap is None else min(default_util, cap)
        if util != default_util:
            changes["gpu_memory_utilization"] = max(util, 0.01)
        steps.append("gpu_memory_utilization")
    if ("max_model_len" not in space.fixed and space.workload.stated) or s.max_model_len == -1:
        changes["max_model_len"] = space.workload.p99_tokens
        steps.append("max_model_len")
    if "max_num_seqs" not in space.fixed and space.workload.stated:
        changes["max_num_seqs"] = space.concurrency_per_rank()  # --max-num-seqs is per DP rank
        steps.append("max_num_seqs")
    return dataclasses.replace(s, **changes), steps


def _search_tps(space: SearchSpace, tp_sizes: Iterable[int] | None) -> list[int]:
    """The tensor-parallel sizes the search tries: the given one when fixed."""
    if "tensor_parallel_size" in space.fixed:
        return [space.base.tensor_parallel_size]
    if tp_sizes is not None:
        return list(tp_sizes)
    return valid_tp_sizes(space.model, max(1, space.gpu_count // space.gpus_per_replica))


def _capability(c: Candidate) -> tuple[bool, float, int]:
    """Which candidate comes closest: starts, then most concurrency, then smallest weights."""
    conc = c.serve.max_concurrency if c.serve else 0.0
    return (c.fits, conc, -c.prediction.weights.value_bytes)


def _batch_caps(space: SearchSpace, default_pred: MemoryPrediction) -> list[int | None]:
    """The batch-token caps to try, largest (the default, None) first."""
    if "max_num_batched_tokens" in space.fixed:
        return [space.base.max_num_batched_tokens]
    default_tokens = int(default_pred.settings.max_num_batched_tokens or 0)
    seqs = int(default_pred.settings.max_num_seqs or 1)
    return [None] + [t for t in _BATCHED_TOKEN_STEPS if t < default_tokens and t >= seqs]


def _steps_taken(
    space: SearchSpace,
    steps: list[str],
    chosen: Candidate,
    weights: WeightsOption,
    kv_dtype: str,
    tp: int,
) -> tuple[str, ...]:
    """The checklist steps ``chosen`` took from the given settings."""
    base = space.base
    steps = list(steps)
    capped = chosen.settings.max_num_batched_tokens is not None
    if capped and "max_num_batched_tokens" not in space.fixed:
        steps.append("max_num_batched_tokens")
    if tp != base.tensor_parallel_size:
        steps.append("tensor_parallel_size")
    if kv_dtype != base.kv_cache_dtype:
        steps.append("kv_cache_dtype")
    if weights.key != "native":
        steps.append("quantization")
    return tuple(steps)


def search(
    space: SearchSpace,
    *,
    allow_quantization: bool = True,
    tp_sizes: Iterable[int] | None = None,
    options: list[WeightsOption] | None = None,
) -> SearchOutcome:
    """Walk the checklist in cost order; return the first configuration that serves.

    Cost order, cheapest first: batch-token cap < tensor parallelism over the given GPUs <
    fp8 KV cache < fp8 weights < int4 checkpoint. For each (weights, KV dtype, TP) the smallest
    batch-token cap is priced first; only if it serves is the largest serving cap looked for.
    Only catalogued checkpoints are searched unless ``options`` names the weights to price.
    """
    default_util = space.default_util()
    tps = _search_tps(space, tp_sizes)
    fixed_kv = "kv_cache_dtype" in space.fixed or space.base.kv_cache_dtype != "auto"
    kv_dtypes = [space.base.kv_cache_dtype] if fixed_kv else ["auto", "fp8"]
    if options is None:
        options = weights_options(space.model_ref, space.model, space.gpu, space.base, space.fixed)
        options = [o for o in options if o.known]
    if not allow_quantization:
        options = options[:1]
    most_capable: Candidate | None = None
    for weights, kv_dtype, tp in itertools.product(options, kv_dtypes, tps):
        settings, steps = base_settings(space, default_util, tp)
        settings = dataclasses.replace(
            settings,
            kv_cache_dtype=kv_dtype,
            tensor_parallel_size=tp,
            quantization=weights.quantization,
        )
        default_pred = space.price(weights, settings)
        if not default_pred.settings.max_num_batched_tokens:
            continue
        caps = _batch_caps(space, default_pred)
        # Serving is monotone in the cap: price the smallest first.
        smallest = space.candidate(
            weights, dataclasses.replace(settings, max_num_batched_tokens=caps[-1])
        )
        if most_capable is None or _capability(smallest) > _capability(most_capable):
            most_capable = smallest
        if not smallest.serves:
            continue
        priced = (
            space.candidate(weights, dataclasses.replace(settings, max_num_batched_tokens=cap))
            for cap in caps[:-1]
        )
        chosen = next((c for c in priced if c.serves), smallest)
        taken = _steps_taken(space, steps, chosen, weights, kv_dtype, tp)
        return SearchOutcome(chosen, most_capable, taken)
    return SearchOutcome(None, most_capable, ())


# --------------------------------------------------------------------------------------------
# Prefix caching and reasons


def apply_prefix_caching(
    space: SearchSpace, chosen: Candidate
) -> tuple[Candidate, FlagReason | None]:
    """Turn prefix caching on only when prefixes are shared (and off for hybrids when they are
    not)."""
    if "enable_prefix_caching" in space.fixed:
        return chosen, None
    weights = weights_of(chosen)
    default_on = bool(chosen.prediction.settings.enable_prefix_caching)
    shared = space.workload.shared_prefix_tokens
    if shared > 0:
        c = space.candidate(
            weights, dataclasses.replace(chosen.settings, enable_prefix_caching=True)
        )
        if c.serves:
            factor = space.share_factor(c.settings)
            saving = (
                f"; counted once, the {shared}-token prefix cuts the KV need to {factor:.0%} of "
                "unshared requests"
                if factor < 1
                else "; this model's sliding-window/Mamba layers keep per-request state, so no "
                "capacity is counted for it"
            )
            return c, FlagReason(
                "enable-prefix-caching",
                True,
                f"requests share a {shared}-token prefix: its KV blocks are computed "
                f"once and reused{saving}",
            )
        return chosen, None
    if space.model.has_mamba and default_on:
        c = space.candidate(
            weights, dataclasses.replace(chosen.settings, enable_prefix_caching=False)
        )
        if c.serves:
            return c, FlagReason(
                "enable-prefix-caching",
                False,
                "no shared prefix: on this hybrid model prefix caching keeps extra Mamba "
                "state pages per request ('align' mode) for no benefit",
            )
    return chosen, None


def _weights_reasons(
    space: SearchSpace, chosen: Candidate, given: MemoryPrediction
) -> list[FlagReason]:
    """Reasons for the checkpoint, online quantization and tensor parallelism."""
    w, s, p = space.workload, chosen.settings, chosen.prediction
    reasons: list[FlagReason] = []
    if chosen.model_ref != space.model_ref:
        reasons.append(
            FlagReason(
                "model",
                chosen.model_ref,
                f"the catalogue's {chosen.weights_label} of {space.model_ref}: weights "
                f"{gib_label(p.weights.value_bytes)} per GPU instead of "
                f"{gib_label(given.weights.value_bytes)}; small accuracy cost",
            )
        )
    if (
        s.quantization
        and "quantization" not in space.fixed
        and s.quantization != space.base.quantization
    ):
        twin = fp8_checkpoint(space.model_ref)
        also = f" ({twin} is the same, pre-quantized)" if twin else ""
        reasons.append(
            FlagReason(
                "quantization",
                s.quantization,
                f"online fp8 weights: {gib_label(p.weights.value_bytes)} per GPU instead of "
                f"{gib_label(given.weights.value_bytes)}; needs no separate "
                f"repo{also}, small accuracy cost",
            )
        )
    if s.tensor_parallel_size != 1 and "tensor_parallel_size" not in space.fixed:
        reasons.append(
            FlagReason(
                "tensor-parallel-size",
                s.tensor_parallel_size,
                f"one GPU does not hold weights plus {w.concurrency}×{w.p99_tokens} tokens of KV; "
                f"split over {s.tensor_parallel_size} GPUs: "
                f"{gib_label(p.weights.value_bytes)} of weights per GPU",
            )
        )
    return reasons


def _utilization_reason(space: SearchSpace, chosen: Candidate, default_util: float) -> FlagReason:
    """Why the utilization is the default, or capped below it."""
    s, p = chosen.settings, chosen.prediction
    util = s.gpu_memory_utilization
    if util is None:
        free_now = "" if space.free_bytes is None else f" ({gib_label(space.free_bytes)} free now)"
        return FlagReason(
            "gpu-memory-utilization",
            f"default ({default_util})",
            f"vLLM's default leaves {gib_label(p.total_bytes - p.requested_bytes)} for the CUDA "
            f"context and anything else on the GPU{free_now}; pass --headroom-gib if other "
            "processes share it",
        )
    why = []
    if space.workload.headroom_bytes:
        why.append(f"{gib_label(space.workload.headroom_bytes)} kept free for co-tenants")
    if space.free_bytes is not None:
        why.append(f"only {gib_label(space.free_bytes)} free now (NVML)")
    return FlagReason(
        "gpu-memory-utilization",
        util,
        f"vLLM refuses to start when free memory < util × total; capped below the default "
        f"{default_util}: {', '.join(why) or 'context reserve'}, plus ~0.5 GiB "
        "for vLLM's CUDA context",
    )


def _workload_reasons(
    space: SearchSpace, chosen: Candidate, steps: set[str], given: MemoryPrediction
) -> list[FlagReason]:
    """Reasons for the length, sequence, batch-token and KV-dtype flags."""
    w, s, p = space.workload, chosen.settings, chosen.prediction
    reasons: list[FlagReason] = []
    if "max_model_len" in steps:
        derived = space.model.derived_max_model_len
        reasons.append(
            FlagReason(
                "max-model-len",
                s.max_model_len,
                f"your P99 prompt+output is {w.p99_tokens} tokens; the model's default "
                f"{derived} would size every request's worst case for context you never use",
            )
        )
    if "max_num_seqs" in steps:
        default_seqs = given.settings.max_num_seqs
        whose = (
            "your peak concurrency"
            if space.dp == 1
            else (
                f"your peak concurrency of {w.concurrency} split over {space.dp} data-parallel "
                "ranks (each rank is its own engine with its own KV pool)"
            )
        )
        reasons.append(
            FlagReason(
                "max-num-seqs",
                s.max_num_seqs,
                f"{whose}; vLLM's default {default_seqs} would admit more sequences than "
                "the KV pool holds and grows the sampler's profiled peak",
            )
        )
    if s.max_num_batched_tokens is not None and "max_num_batched_tokens" not in space.fixed:
        before = given.activation.value_bytes
        reasons.append(
            FlagReason(
                "max-num-batched-tokens",
                s.max_num_batched_tokens,
                f"lowered from {given.settings.max_num_batched_tokens}: the profiled activation "
                f"peak drops from ~{gib_label(before)} to ~{gib_label(p.activation.value_bytes)}, "
                "which goes to the KV cache; long prompts prefill in more steps",
            )
        )
    if s.kv_cache_dtype != "auto" and "kv_cache_dtype" not in space.fixed:
        reasons.append(
            FlagReason(
                "kv-cache-dtype",
                s.kv_cache_dtype,
                f"fp8 KV halves the bytes per token ({p.kv_bytes_per_token} B/token per GPU); "
                "small accuracy cost, fastest on Ada/Hopper/Blackwell",
            )
        )
    return reasons


def _verdict_reason(space: SearchSpace, chosen: Candidate) -> FlagReason | None:
    """The verdict: how many requests the KV cache holds against what the workload needs."""
    w, p, check = space.workload, chosen.prediction, chosen.serve
    if check is None:
        return None
    per_rank = space.concurrency_per_rank()
    need = (
        f"{check.effective_concurrency:.2f} unshared-equivalent requests needed for your "
        f"{per_rank} with the shared prefix"
        if check.effective_concurrency < per_rank
        else f"{per_rank} needed"
    )
    if space.dp > 1:
        need += f" per data-parallel rank ({w.concurrency} over {space.dp} ranks)"
    return FlagReason(
        "(verdict)",
        None,
        f"KV cache {p.kv_cache_tokens:,} tokens = {check.max_concurrency:.2f} concurrent requests "
        f"of {w.p99_tokens} tokens; {need}: {check.margin_achieved:+.0%} spare "
        f"(margin asked: {w.margin:.0%})",
    )


def explain(
    space: SearchSpace,
    chosen: Candidate,
    steps: Iterable[str],
    given: MemoryPrediction,
    default_util: float,
) -> list[FlagReason]:
    """One reason per flag the recommendation sets (and for the checklist steps it skipped)."""
    taken = set(steps)
    reasons = _weights_reasons(space, chosen, given)
    if "gpu_memory_utilization" in taken:
        reasons.append(_utilization_reason(space, chosen, default_util))
    reasons += _workload_reasons(space, chosen, taken, given)
    order = [
        "model",
        "gpu-memory-utilization",
        "max-model-len",
        "max-num-seqs",
        "max-num-batched-tokens",
        "tensor-parallel-size",
        "kv-cache-dtype",
        "quantization",
    ]
    reasons.sort(key=lambda r: order.index(r.flag) if r.flag in order else len(order))
    verdict = _verdict_reason(space, chosen)
    if verdict is not None:
        reasons.append(verdict)
    return reasons


def min_utilization(chosen: Candidate) -> float | None:
    """Approximate lowest ``gpu_memory_utilization`` that still serves (KV shrinks 1:1 with
    util)."""
    p = chosen.prediction
    check = chosen.serve
    if (
        check is None
        or not check.served
        or chosen.settings.kv_cache_memory_bytes
        or check.max_concurrency <= 0
    ):
        return None
    spare = p.kv_cache_bytes * (1 - check.required_concurrency / check.max_concurrency)
    util = (p.requested_bytes - spare + p.bytes_per_block) / p.total_bytes
    return min(1.0, math.ceil(util * 100) / 100)


def recommend(
    space: SearchSpace, given: MemoryPrediction
) -> tuple[Recommendation | None, SearchOutcome]:
    """Run the checklist search on the user's GPUs and explain the winner."""
    outcome = search(space)
    if outcome.best is None:
        return None, outcome
    chosen, prefix_reason = apply_prefix_caching(space, outcome.best)
    default_util = space.default_util()
    reasons = explain(space, chosen, outcome.steps, given, default_util)
    steps = list(outcome.steps)
    if prefix_reason is not None:
        reasons.insert(len(reasons) - 1, prefix_reason)
        steps.append("enable_prefix_caching")
    return Recommendation(chosen, tuple(reasons), tuple(steps), min_utilization(chosen)), outcome


# --------------------------------------------------------------------------------------------
# Fallbacks


def _sub_space(space: SearchSpace, gpu: GPUSpec, count: int) -> SearchSpace:
    return SearchSpace(
        model_ref=space.model_ref,
        model=space.model,
        gpu=gpu,
        gpu_count=count,
        base=space.base,
        fixed=space.fixed - {"tensor_parallel_size"},
        workload=space.workload,
        free_bytes=None,
        measured=None,
        cache=space.cache,
    )


def _more_gpus(space: SearchSpace) -> list[Candidate]:
    found: list[Candidate] = []
    for tp_count in _COUNTS:  # tensor-parallel sizes; PP × DP multiply the GPUs they take
        count = tp_count * space.gpus_per_replica
        if count <= space.gpu_count:
            continue
        sub = _sub_space(space, space.gpu, count)
        tps = [t for t in valid_tp_sizes(space.model, tp_count) if t > 1]
        if not tps:
            continue
        outcome = search(sub, tp_sizes=tps[-1:])
        if outcome.best is not None:
            found.append(dataclasses.replace(outcome.best, gpu_count=count))
            if outcome.best.model is space.model and not outcome.best.settings.quantization:
                break  # native weights serve: larger counts add nothing new
    return found


def _larger_gpus(
    space: SearchSpace, gpus: Iterable[GPUSpec], weights_per_gpu_tp1: int
) -> list[Candidate]:
    native = weights_options(space.model_ref, space.model, space.gpu, space.base, space.fixed)[0]
    rows: list[Candidate] = []
    for gpu in gpus:
        if gpu.total_bytes <= space.gpu.total_bytes:
            continue
        c = _smallest_count(space, native, gpu, weights_per_gpu_tp1)
        if c is not None:
            rows.append(c)
    rows.sort(key=lambda c: (c.gpus_used * c.gpu.total_bytes, c.gpus_used))
    seen: set[tuple[int, int]] = set()
    distinct = []
    for c in rows:  # GPUs of the same memory give the same numbers: name the first only
        if (c.gpu.total_bytes, c.gpus_used) not in seen:
            seen.add((c.gpu.total_bytes, c.gpus_used))
            distinct.append(c)
    return distinct[:3]


def _smallest_count(
    space: SearchSpace,
    native: WeightsOption,
    gpu: GPUSpec,
    weights_per_gpu_tp1: int,
    counts: Iterable[int] = _COUNTS,
) -> Candidate | None:
    """The smallest GPU count of ``gpu`` at which native weights serve the workload.

    ``counts`` are tensor-parallel sizes; the user's pipeline and data parallelism multiply
    them (a TP 2 × DP 8 layout occupies 16 GPUs).
    """
    last: Candidate | None = None
    pp = space.base.pipeline_parallel_size
    for tp in counts:
        if tp not in valid_tp_sizes(space.model, tp):
            continue
        if weights_per_gpu_tp1 / (tp * pp) > gpu.total_bytes * 0.95:
            continue  # weights alone do not fit: skip the prediction
        settings = dataclasses.replace(
            space.base,
            tensor_parallel_size=tp,
            max_model_len=space.workload.p99_tokens
            if "max_model_len" not in space.fixed
            else space.base.max_model_len,
            max_num_seqs=space.concurrency_per_rank()
            if "max_num_seqs" not in space.fixed and space.workload.stated
            else space.base.max_num_seqs,
            gpu_memory_utilization=space.base.gpu_memory_utilization,
        )
        c = space.candidate(native, settings, gpu=gpu, count=tp * space.gpus_per_replica)
        last = c
        if c.serves:
            return c
    return None if last is None or not last.serves else last


def _max_context(space: SearchSpace, c: Candidate) -> tuple[int, int]:
    """(longest context at the workload's concurrency, most requests at the P99) for ``c``."""
    w = space.workload
    weights = weights_of(c)
    at_p99 = c.serve.max_concurrency if c.serve else 0.0
    factor = space.share_factor(c.settings)
    most_requests = int(at_p99 / (1 + w.margin) / factor) if factor else 0
    lo, hi = 0, w.p99_tokens
    while hi - lo > 16:
        mid = (lo + hi) // 2
        pred = space.price(weights, dataclasses.replace(c.settings, max_model_len=mid))
        if pred.fits and float(pred.max_concurrency) >= w.concurrency * factor * (1 + w.margin):
            lo = mid
        else:
            hi = mid
    return (lo // 16) * 16, most_requests


def _cpu_offload(space: SearchSpace, native: WeightsOption) -> tuple[Candidate, float] | None:
    """Smallest ``--cpu-offload-gb`` (whole GiB, per GPU) at which native weights serve.

    When even offloading every weight does not serve, returns that (non-serving) candidate.
    """
    tps = valid_tp_sizes(space.model, max(1, space.gpu_count // space.gpus_per_replica))
    tp = tps[-1] if "tensor_parallel_size" not in space.fixed else space.base.tensor_parallel_size
    settings, _ = base_settings(space, space.default_util(), tp)
    settings = dataclasses.replace(settings, tensor_parallel_size=tp)
    probe = space.price(native, settings)
    weights_gib = probe.weights.value_bytes / GIB
    hi = math.ceil(weights_gib)
    top = space.candidate(native, dataclasses.replace(settings, cpu_offload_gb=float(hi)))
    if not top.serves:
        return top, weights_gib
    lo = 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = space.candidate(native, dataclasses.replace(settings, cpu_offload_gb=float(mid)))
        if c.serves:
            hi = mid
        else:
            lo = mid
    best = space.candidate(native, dataclasses.replace(settings, cpu_offload_gb=float(hi)))
    return best, weights_gib


def _numbers(c: Candidate) -> dict[str, Any]:
    """The figures every alternative shows for its candidate."""
    return {
        "gpu": c.gpu.name,
        "gpu_count": c.gpus_used,
        "weights": c.weights_label,
        "weights_gib_per_gpu": round(c.prediction.weights.value_bytes / GIB, 2),
        "kv_cache_gib": round(c.prediction.kv_cache_bytes / GIB, 2),
        "kv_cache_tokens": c.prediction.kv_cache_tokens,
        "max_concurrency": round(c.serve.max_concurrency, 2) if c.serve else None,
        "margin_achieved": round(c.serve.margin_achieved, 3) if c.serve else None,
    }


def _label(c: Candidate) -> str:
    kv = ", fp8 KV" if c.settings.kv_cache_dtype == "fp8" else ""
    layout = f", {c.parallel_label}" if c.parallel_label else ""
    return f"{c.gpus_used}× {c.gpu.name} ({c.weights_label}{kv}{layout})"


def _alt(
    kind: str,
    title: str,
    serves: bool,
    numbers: dict[str, Any],
    command: str,
    c: Candidate,
    caveats: tuple[str, ...] = (),
) -> Alternative:
    """An alternative not ranked yet (:func:`rank` numbers them)."""
    return Alternative(
        rank=0,
        kind=kind,
        title=title,
        serves_workload=serves,
        numbers=numbers,
        command=command,
        caveats=tuple(x for x in caveats if x),
        candidate=c,
    )


def _hardware_alts(
    space: SearchSpace, catalogue: Iterable[GPUSpec], weights_tp1: int
) -> list[Alternative]:
    """More GPUs of the same kind, then larger GPUs from the catalogue, that serve."""
    more = [("more_gpus", c) for c in _more_gpus(space)]
    larger = [("larger_gpu", c) for c in _larger_gpus(space, catalogue, weights_tp1)]
    return [
        _alt(kind, _label(c), True, _numbers(c), render_serve(c.model_ref, c.settings), c)
        for kind, c in more + larger
    ]


def _shorter_context_alt(space: SearchSpace, best: Candidate) -> Alternative:
    """The most capable configuration on the given GPUs, serving shorter or fewer requests."""
    w = space.workload
    ctx, most = _max_context(space, best)
    nums = {**_numbers(best), "max_context_at_concurrency": ctx, "max_requests_at_p99": most}
    parts = []
    if ctx >= 16:
        parts.append(f"{w.concurrency} requests of ≤{ctx:,} tokens")
    if most >= 1:
        parts.append(f"{most} requests of {w.p99_tokens:,} tokens")
    fp8 = ", fp8 KV" if best.settings.kv_cache_dtype == "fp8" else ""
    serve = " or ".join(parts) if parts else "almost nothing"
    where = f"{space.gpu_count}× {space.gpu.name}"
    title = f"on {where} with {best.weights_label}{fp8}: serve {serve} instead"
    settings = best.settings
    if ctx >= 16:
        settings = dataclasses.replace(settings, max_model_len=max(ctx, 16))
    caveat = (
        "requests longer than the context are rejected; fewer sequences queue instead of running"
    )
    return _alt(
        "shorter_context",
        title,
        False,
        nums,
        render_serve(best.model_ref, settings),
        best,
        (caveat,),
    )


def _quantization_alt(space: SearchSpace, best: Candidate) -> Alternative:
    """Even the smallest weights the search tried do not start on the given GPUs."""
    problems = best.prediction.problems
    reason = problems[0].message if problems else "does not start"
    repo = f" ({best.model_ref})" if best.model_ref != space.model_ref else ""
    where = f"{space.gpu_count}× {space.gpu.name}"
    title = f"even {best.weights_label}{repo} does not start on {where}"
    return _alt(
        "quantization",
        title,
        False,
        {**_numbers(best), "problem": reason},
        render_serve(best.model_ref, best.settings),
        best,
    )


def _quantize_yourself_alt(space: SearchSpace) -> Alternative | None:
    """An int4 checkpoint nobody has published, priced on the given GPUs."""
    hypothetical = [
        o
        for o in weights_options(space.model_ref, space.model, space.gpu, space.base, space.fixed)
        if not o.known
    ]
    if not hypothetical:
        return None
    found = search(space, options=hypothetical)
    own = found.best or found.most_capable
    if own is None or not own.fits:
        return None
    conc = own.serve.max_concurrency if own.serve else 0.0
    need = own.serve.required_concurrency if own.serve else 0.0
    where = f"{space.gpu_count}× {space.gpu.name}"
    what = (
        f"would serve this on {where}"
        if own.serves
        else f"on {where} would fit {conc:.2f} of the {need:.2f} concurrent requests needed"
    )
    placeholder = f"<your AWQ int4 of {space.model_ref.rstrip('/').split('/')[-1]}>"
    return _alt(
        "quantize_yourself",
        f"an int4 AWQ/GPTQ checkpoint {what}; {NO_INT4_REPO}",
        own.serves,
        _numbers(own),
        render_serve(placeholder, own.settings),
        own,
        ("int4 costs some accuracy; check it on your own prompts",),
    )


def _cpu_offload_alt(space: SearchSpace, native: WeightsOption) -> Alternative | None:
    """``--cpu-offload-gb``: the smallest amount that serves, or why no amount does."""
    offload = _cpu_offload(space, native)
    if offload is None:
        return None
    c, weights_gib = offload
    p99 = space.workload.p99_tokens
    if not c.serves:
        check = c.serve
        conc = check.max_concurrency if check else 0.0
        need = check.required_concurrency if check else 0
        title = (
            f"vLLM --cpu-offload-gb cannot help: even with all {weights_gib:.0f} GiB of weights "
            f"in host RAM, {conc:.2f} requests of {p99:,} tokens fit ({need:.2f} needed)"
        )
        return _alt(
            "cpu_offload",
            title,
            False,
            _numbers(c),
            render_serve(c.model_ref, c.settings),
            c,
            (
                "the KV cache alone exceeds the GPU; only more GPU memory, fp8 KV or a "
                "shorter context helps",
            ),
        )
    gb = c.settings.cpu_offload_gb
    step_s = gb * GIB / (PCIE_GBPS * 1e9)
    nums = {
        **_numbers(c),
        "cpu_offload_gb": gb,
        "host_ram_gib": round(gb * c.settings.tensor_parallel_size, 1),
        "pcie_s_per_step": round(step_s, 3),
        "decode_steps_per_s_bound": round(1 / step_s, 1) if step_s else None,
    }
    return _alt(
        "cpu_offload",
        f"vLLM --cpu-offload-gb {gb:g} on {space.gpu_count}× {space.gpu.name}",
        True,
        nums,
        render_serve(c.model_ref, c.settings),
        c,
        (
            f"every forward pass streams {gb:g} GiB of weights over PCIe: "
            f"≤{1 / step_s:.1f} decode steps/s"
            if step_s
            else "",
            "needs that much pinned host RAM per GPU (plan ~2× for loading)",
            "recent vLLM releases have reports of the flag silently doing nothing (vLLM #51396, "
            "#56283): check that 'Model loading took' drops by the offloaded amount",
            "KV offloading / LMCache does not add room for active context; "
            "only weight offload does",
        ),
    )


_ALT_ORDER = {"more_gpus": 0, "larger_gpu": 0, "quantization": 1, "quantize_yourself": 1,
              "shorter_context": 1, "cpu_offload": 2}  # fmt: skip


def rank(alts: Iterable[Alternative]) -> list[Alternative]:
    """Hardware first (the least GPU memory bought first), then weights and context, then
    offload; numbered from 1."""

    def hardware(a: Alternative) -> float:
        c = a.candidate
        if c is not None and a.kind in ("more_gpus", "larger_gpu"):
            return c.gpus_used * c.gpu.total_bytes
        return 0

    ordered = sorted(alts, key=lambda a: (_ALT_ORDER[a.kind], hardware(a)))
    return [dataclasses.replace(a, rank=i + 1) for i, a in enumerate(ordered)]


def alternatives(
    space: SearchSpace,
    outcome: SearchOutcome,
    given: MemoryPrediction,
    catalogue: Iterable[GPUSpec],
) -> list[Alternative]:
    """Ranked ways out when nothing on the given GPUs serves the workload, each with its numbers."""
    w = space.workload
    native = weights_options(space.model_ref, space.model, space.gpu, space.base, space.fixed)[0]
    tp1 = space.price(
        native,
        dataclasses.replace(
            space.base,
            tensor_parallel_size=1,
            max_model_len=w.p99_tokens,
            max_num_seqs=w.concurrency,
        ),
    )
    found = _hardware_alts(space, catalogue, tp1.weights.value_bytes)
    best = outcome.most_capable
    if best is not None:
        serving = best.fits and best.serve is not None and best.serve.max_concurrency > 0
        found.append(
            _shorter_context_alt(space, best) if serving else _quantization_alt(space, best)
        )
    found += [a for a in (_quantize_yourself_alt(space), _cpu_offload_alt(space, native)) if a]
    return rank(found)


# --------------------------------------------------------------------------------------------
# Sizing table


def sizing_table(
    space: SearchSpace, catalogue: Iterable[GPUSpec]
) -> list[tuple[SizingRow, Candidate]]:
    """For each catalogue GPU: the smallest count (1, 2, 4, 8) whose native weights serve the
    workload."""
    native = weights_options(space.model_ref, space.model, space.gpu, space.base, space.fixed)[0]
    probe = space.price(
        native,
        dataclasses.replace(
            space.base,
            tensor_parallel_size=1,
            max_model_len=space.workload.p99_tokens,
            max_num_seqs=space.workload.concurrency,
        ),
    )
    weights_tp1 = probe.weights.value_bytes
    rows: list[tuple[SizingRow, Candidate]] = []
    for gpu in catalogue:
        c = _smallest_count(space, native, gpu, weights_tp1)
        if c is None:
            continue
        check = c.serve
        rows.append(
            (
                SizingRow(
                    gpu=gpu.name,
                    total_gib=gpu.total_gib,
                    count=c.gpus_used,
                    serves=c.serves,
                    kv_cache_tokens=c.prediction.kv_cache_tokens,
                    max_concurrency=check.max_concurrency
                    if check
                    else float(c.prediction.max_concurrency),
                    margin_achieved=check.margin_achieved if check else None,
                    command=render_serve(c.model_ref, c.settings),
                    weights_gib_per_gpu=round(c.prediction.weights.value_bytes / GIB, 2),
                ),
                c,
            )
        )
    rows.sort(key=lambda rc: (rc[1].gpus_used * rc[1].gpu.total_bytes, rc[1].gpus_used))
    return rows
