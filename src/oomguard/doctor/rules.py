"""Mechanism rules: from what the log shows to ranked root causes and computed fixes.

Each rule models how vLLM spends memory (vllm-memory.md §2–§7) rather than matching message
texts to labels: the same text ("No available memory for the cache blocks") has different
causes, told apart by the numbers around it — utilization, weights per GPU, the profiled
activation peak, the phase that failed, memory held by other processes, and the allocator's
reserved-but-unallocated memory compared with the failed allocation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from oomguard.doctor.findings import (
    STEP_ACTION,
    STEP_BATCHED_TOKENS,
    STEP_CUDAGRAPH,
    STEP_ENV,
    STEP_KV_DTYPE,
    STEP_MAX_MODEL_LEN,
    STEP_MAX_NUM_SEQS,
    STEP_MULTIMODAL,
    STEP_OFFLOAD,
    STEP_QUANTIZE,
    STEP_SWAP,
    STEP_TP,
    STEP_UTIL,
    Finding,
    Fix,
    rank_key,
)
from oomguard.doctor.situation import (
    GIB,
    Situation,
    ceil2,
    floor2,
    nice_max_model_len,
    power_of_two_at_most,
)
from oomguard.logs.parsed import Evidence, GpuProcess, Phase

# A stated utilization at or above this leaves no headroom outside vLLM's budget.
FULL_UTIL = 0.98
# Memory the CUDA context, NCCL and allocator slack need outside vLLM's budget (GiB).
CONTEXT_SLACK_GIB = 0.25
# A co-tenant using at least this share of the GPU is more than a desktop or a sidecar.
LEFTOVER_SHARE = 0.5


class Findings:
    """Collects findings; the same cause found twice keeps the higher confidence."""

    def __init__(self) -> None:
        self.by_cause: dict[str, Finding] = {}

    def add(
        self,
        cause: str,
        confidence: float,
        summary: str,
        evidence: list[Evidence | None],
        fixes: list[Fix] | None = None,
        explanation: str = "",
    ) -> None:
        evs: list[Evidence] = []
        for e in evidence:
            if e is not None and all(e.line != x.line for x in evs):
                evs.append(e)
        current = self.by_cause.get(cause)
        if current is None:
            self.by_cause[cause] = Finding(
                cause, confidence, summary, evs, list(fixes or []), explanation
            )
            return
        if confidence > current.confidence:
            current.confidence, current.summary = confidence, summary
            current.explanation = explanation or current.explanation
            current.fixes = list(fixes or []) + [
                f for f in current.fixes if f.flag not in {x.flag for x in fixes or []}
            ]
        else:
            known = {f.flag for f in current.fixes}
            current.fixes.extend(f for f in fixes or [] if f.flag not in known)
        seen = {e.line for e in current.evidence}
        current.evidence.extend(e for e in evs if e.line not in seen)

    def ranked(self) -> list[Finding]:
        return sorted(self.by_cause.values(), key=lambda f: rank_key(f.cause, f.confidence))


# --- fixes computed from the numbers ------------------------------------------------------------


def util_to_fit_free(s: Situation, free_gib: float, total_gib: float, why: str) -> Fix:
    """The largest utilization whose request (ceil(util × total)) fits in ``free_gib``."""
    util = floor2(free_gib / total_gib)
    if util * total_gib > free_gib - 0.05:
        util = round(util - 0.01, 2)
    util = max(util, 0.05)
    return Fix("--gpu-memory-utilization", f"{util:.2f}", why, STEP_UTIL)


def lower_util(s: Situation, extra_gib: float, reason: str) -> Fix | None:
    """Lower utilization enough to leave ``extra_gib`` more outside vLLM's budget."""
    total = s.total_gib
    util = s.util
    if util is None:
        return None
    if total:
        step = max(ceil2((extra_gib + 0.125) / total), 0.01)
    else:
        step = 0.05
    new = round(util - step, 2)
    if new <= 0.1:
        return None
    origin = "" if s.util_stated else f" (vLLM's default {util:g})"
    return Fix(
        "--gpu-memory-utilization",
        f"{new:.2f}",
        f"{reason}: from {util:g}{origin} to {new:.2f}",
        STEP_UTIL,
    )


def default_max_num_seqs(s: Situation) -> int:
    """vLLM's default max_num_seqs for ``vllm serve``: 256 in V0 and on < 70 GiB GPUs, 1024 in
    V1 on ≥ 70 GiB GPUs (§3.2)."""
    if s.get("engine") == "v0" or (0 < _version_minor(s) < 8):
        return 256
    total = s.total_gib
    return 1024 if total is None or total >= 70 else 256


def fewer_seqs(current: int | None, factor: int = 4, floor: int = 16) -> int:
    base = current or 1024
    return max(power_of_two_at_most(max(base // factor, 1)), min(floor, base))


# vLLM's Marlin kernels serve AWQ, GPTQ and compressed-tensors w4a16 at full speed with TP;
# bitsandbytes is slower: the order in which a catalogued 4-bit checkpoint is preferred.
_INT4_METHOD_ORDER = ("awq", "gptq", "compressed-tensors", "bitsandbytes")
_INT4_LABEL = {
    "awq": "AWQ",
    "gptq": "GPTQ",
    "compressed-tensors": "w4a16",
    "bitsandbytes": "bnb 4-bit",
}
NO_INT4_REPO = (
    "no AWQ/GPTQ repo of this model is in the catalogue; quantize it or pick one from the hub"
)


def _rank_weights_gib(
    spec: Any, tp: int, quantization: str | None = None, dtype: str | None = None
) -> float | None:
    """Weights on one TP rank by the memory model (None when it cannot price this model)."""
    if spec is None:
        return None
    try:
        from oomguard.memory.weights import resolve_model_dtype, weight_bytes_per_stage

        model_dtype = resolve_model_dtype(spec, str(dtype or "auto"))
        return (
            weight_bytes_per_stage(
                spec, model_dtype=model_dtype, tp=tp, quantization=quantization
            ).max_bytes
            / GIB
        )
    except Exception:  # an exotic format the weight model does not price: no computed value
        return None


def _valid_tp(spec: Any, tp: int) -> bool:
    """Whether vLLM accepts ``tp`` for the model (attention and KV heads divide evenly)."""
    if spec is None:
        return True
    if spec.num_attention_heads % tp:
        return False
    kv = spec.num_kv_heads
    return not kv or kv % tp == 0 or tp % kv == 0


def catalogued_int4(s: Situation) -> tuple[str, Any] | None:
    """The catalogue's preferred ≤4-bit checkpoint of the log's model and its ModelSpec.

    Looked up through :func:`oomguard.facts.known_quantized_variants` by the model's name and
    by the resolved spec's name; None when the catalogue lists none (never a made-up name).
    """
    try:
        from oomguard.errors import OomguardError
        from oomguard.facts import known_quantized_variants, resolve_model
    except ImportError:
        return None
    names = [str(n) for n in (s.get("model"), getattr(s.model_spec, "name", None)) if n]
    variants: list[tuple[str, Any]] = []
    for name in dict.fromkeys(names):
        try:
            variants = known_quantized_variants(name)
        except OomguardError:
            continue
        if variants:
            break

    def rank(item: tuple[str, Any]) -> tuple[int, str]:
        method = (item[1].method or "").lower()
        order = _INT4_METHOD_ORDER.index(method) if method in _INT4_METHOD_ORDER else 99
        return order, item[0].lower()

    for repo, _quant in sorted((v for v in variants if v[1].weight_bits <= 4), key=rank):
        try:
            return repo, resolve_model(repo, allow_hub=False)
        except OomguardError:
            continue
    return None


def int4_fix(
    s: Situation, current_gib: float | None = None, limit_gib: float | None = None
) -> Fix | None:
    """Switch to a 4-bit checkpoint: the catalogue's repo with its per-GPU weights computed by
    the memory model, or (none catalogued) say so with what a 4-bit AWQ copy would weigh.

    With ``limit_gib`` the fix is returned only when the 4-bit weights fit under it.
    """
    tp = s.tp
    instead = f" instead of {current_gib:.1f} GiB" if current_gib else ""
    variant = catalogued_int4(s)
    if variant is not None:
        repo, vspec = variant
        gib = _rank_weights_gib(vspec, tp)
        if gib is not None and limit_gib is not None and gib > limit_gib:
            return None
        label = _INT4_LABEL.get((vspec.quant.method or "").lower(), vspec.quant.method or "4-bit")
        size = (
            f"takes {gib:.1f} GiB per GPU{instead} (the memory model on its config"
            f"{f', TP {tp}' if tp > 1 else ''})"
            if gib is not None
            else "holds 4-bit weights"
        )
        return Fix(
            "--model",
            repo,
            f"the catalogue's {label} checkpoint of this model {size}",
            STEP_QUANTIZE,
        )
    gib, basis = None, ""
    spec = s.model_spec
    if spec is not None and not spec.quant.method:
        from oomguard.memory.spec import QuantSpec

        awq = QuantSpec(
            method="awq", weight_bits=4, group_size=128, zero_point=True, scale_granularity="group"
        )
        gib = _rank_weights_gib(replace(spec, quant=awq), tp)
        basis = "AWQ int4, group 128, by the memory model"
    wt = s.get("weights_total_gib")
    if gib is None and wt is not None:
        gib = float(wt) * 0.28 / tp
        basis = "about 0.28 × the 16-bit size: 4-bit linear layers plus group scales, 16-bit embeddings; model not in the catalogue, so an estimate"
    if gib is not None and limit_gib is not None and gib > limit_gib:
        return None
    size = (
        f"; a 4-bit checkpoint would take {gib:.1f} GiB per GPU{instead} ({basis})" if gib else ""
    )
    return Fix("--model", None, NO_INT4_REPO + size, STEP_QUANTIZE)


def weights_fixes(s: Situation, weights_total_gib: float, budget_per_gpu_gib: float) -> list[Fix]:
    """A quantized checkpoint and/or tensor parallelism sized so the weights leave room for
    KV cache (weights ≤ 80 % of each GPU's budget).

    Per-GPU weight sizes come from the memory model on the resolved ModelSpec (online fp8,
    the catalogue's 4-bit repo, each TP size); only a model outside the catalogue falls back
    to size factors, and the fix says so. A 4-bit repo is named only when the catalogue lists
    one.
    """
    fixes: list[Fix] = []
    tp = s.tp
    spec = s.model_spec
    dtype = s.get("dtype")
    limit = 0.8 * budget_per_gpu_gib
    current = weights_total_gib / tp
    rule = f"≤ 80 % of the {budget_per_gpu_gib:.1f} GiB budget leaves room for the KV cache"
    cc = str(getattr(s.gpu_spec, "compute_capability", "") or "")
    fp8_hw = not cc or _cc_at_least(cc, 8.0)
    fp8: float | None = None
    fp8_basis = ""
    if not _already_quantized(s) and fp8_hw:
        fp8 = _rank_weights_gib(spec, tp, "fp8", dtype)
        fp8_basis = "the memory model: 8-bit linear layers with per-tensor scales, 16-bit embeddings and norms"
        if fp8 is None:
            fp8 = weights_total_gib * 0.52 / tp
            fp8_basis = "about 0.52 × the 16-bit size; model not in the catalogue, so an estimate"
    if fp8 is not None and fp8 <= limit:
        fixes.append(
            Fix(
                "--quantization",
                "fp8",
                f"online fp8 weights take {fp8:.1f} GiB per GPU instead of {current:.1f} GiB "
                f"({fp8_basis}); {rule} (fp8 needs compute capability ≥ 8.0; Ampere runs it "
                "weight-only)",
                STEP_QUANTIZE,
            )
        )
    elif not _already_4bit(s):
        fix = int4_fix(s, current, limit)
        if fix is not None:
            fixes.append(fix)
    quant = s.get("quantization")
    for new_tp in (2, 4, 8, 16):
        if new_tp <= tp or not _valid_tp(spec, new_tp):
            continue
        per_rank = _rank_weights_gib(spec, new_tp, quant, dtype)
        how = "the memory model: embeddings and layers split, norms replicated"
        if per_rank is None:
            per_rank = weights_total_gib / new_tp
            how = f"{weights_total_gib:.1f} GiB ÷ {new_tp}"
        if per_rank <= limit:
            fixes.append(
                Fix(
                    "--tensor-parallel-size",
                    str(new_tp),
                    f"weights {weights_total_gib:.1f} GiB split over {new_tp} GPUs = "
                    f"{per_rank:.1f} GiB each ({how}); {rule}" + _tp_available_note(s, new_tp),
                    tp_step(s, new_tp),
                )
            )
            break
    return fixes


def gpus_available(s: Situation) -> tuple[int | None, bool]:
    """How many GPUs the machine has, and whether that number is exact.

    Exact when the user's GPU text states it ("4x A100", "8 x H100", "80GB*2"); otherwise a
    lower bound from the log: the parallel sizes in force and the highest GPU index an
    out-of-memory report or a process listing names. (None, False) when nothing says.
    """
    stated = s.known("gpu_count")
    if stated is not None:
        return int(stated.value), True
    seen = [s.tp * int(s.get("pipeline_parallel_size") or 1)]
    seen += [o.gpu_index + 1 for o in s.parsed.ooms if o.gpu_index is not None]
    seen += [g.gpu_index + 1 for g in s.parsed.gpu_processes if g.gpu_index is not None]
    best = max(seen)
    return (best, False) if best > 1 else (None, False)


def tp_step(s: Situation, new_tp: int) -> float:
    """Where ``--tensor-parallel-size new_tp`` goes in the checklist: before a quantized
    checkpoint when the machine has several GPUs (the seeds' order assumes one), else after."""
    count, exact = gpus_available(s)
    if count is not None and count > 1 and (not exact or new_tp <= count):
        return STEP_QUANTIZE - 0.5
    return STEP_TP


def _tp_available_note(s: Situation, new_tp: int) -> str:
    count, exact = gpus_available(s)
    if count is None or count <= 1:
        return ""
    if exact:
        if new_tp <= count:
            return f"; the machine has {count} GPUs, so this keeps full precision"
        return f"; needs {new_tp} GPUs, the machine has {count}"
    return f"; the log shows at least {count} GPUs"


def _cc_at_least(cc: str, minimum: float) -> bool:
    try:
        return float(cc) >= minimum
    except ValueError:
        return True


def _already_quantized(s: Situation) -> bool:
    if s.model_spec is not None and s.model_spec.quant.method:
        return True
    name = f"{s.get('model') or ''} {s.get('quantization') or ''}".lower()
    return any(
        k in name
        for k in (
            "awq",
            "gptq",
            "fp8",
            "int8",
            "int4",
            "4bit",
            "8bit",
            "w4a16",
            "w8a8",
            "gguf",
            "nvfp4",
            "mxfp4",
            "bnb",
        )
    )


def _already_4bit(s: Situation) -> bool:
    if s.model_spec is not None and 0 < s.model_spec.quant.weight_bits <= 4:
        return True
    name = f"{s.get('model') or ''} {s.get('quantization') or ''}".lower()
    return any(
        k in name for k in ("awq", "gptq", "int4", "4bit", "w4a16", "gguf", "nvfp4", "mxfp4", "q4")
    )


def budget_gib(s: Situation) -> float | None:
    total, util = s.total_gib, s.util
    if total is None or util is None:
        return None
    return total * util


def oom_fit_fraction(s: Situation) -> float | None:
    """free ÷ tried of the first out-of-memory report: the share of the failed allocation
    that would have fit (None when the log lacks either number or the allocation fit)."""
    oom = s.parsed.first_oom
    if oom is None or not oom.tried_gib or oom.free_gib is None:
        return None
    fraction = oom.free_gib / oom.tried_gib
    return fraction if 0 < fraction < 1 else None


def batched_tokens_fix(
    s: Situation, keep_fraction: float | None, what: str, fallback: int, basis: str = ""
) -> Fix:
    """``--max-num-batched-tokens`` scaled to ``keep_fraction`` of the value in force, down to
    a power of two (the peak it drives grows about linearly with the tokens per batch).

    Without a value in the log or a fraction to scale by, ``fallback`` as a first step, said
    as such.
    """
    current = s.get("max_num_batched_tokens")
    if current and keep_fraction is not None:
        target = max(power_of_two_at_most(int(int(current) * keep_fraction)), 256)
        if target < int(current):
            return Fix(
                "--max-num-batched-tokens",
                str(target),
                f"{what}: {int(current)} × {keep_fraction:.2f}{f' ({basis})' if basis else ''} = "
                f"{int(current) * keep_fraction:.0f}, rounded down to {target}; the peak grows about "
                "linearly with the tokens per batch",
                STEP_BATCHED_TOKENS,
            )
    value = min(fallback, int(current) // 2) if current else fallback
    return Fix(
        "--max-num-batched-tokens",
        str(max(value, 256)),
        f"{what} (a first step: the log does not give the numbers to size it)",
        STEP_BATCHED_TOKENS,
    )


# --- rules -------------------------------------------------------------------------------------


def rule_startup_check(s: Situation, out: Findings) -> None:
    """vLLM refuses to start when free memory < util × total (§2.1)."""
    p = s.parsed
    ev = p.evidence("startup_check_failed")
    if ev is None:
        return
    free, total = s.get("startup_free_gib"), s.get("startup_total_gib") or s.total_gib
    if free is None or total is None:
        out.add(
            "util_overshoot",
            0.6,
            "vLLM's start-up check found less free memory than it requests",
            [ev],
            [
                Fix(
                    "--gpu-memory-utilization",
                    None,
                    "lower it below free ÷ total memory",
                    STEP_UTIL,
                )
            ],
        )
        return
    others = max(total - free, 0.0)
    share = others / total if total else 0.0
    cpu = s.get("platform") == "cpu"
    util = s.util
    expected = s.context.expect_cotenant or (s.util_stated and util is not None and util <= 0.6)
    util_fix = util_to_fit_free(
        s,
        free,
        total,
        f"{others:.1f} GiB of {total:.2f} GiB are already in use by other processes; vLLM requests "
        "utilization × total memory, so the request must fit in the {0:.2f} GiB that are free".format(
            free
        ),
    )
    explanation = (
        f"At start-up only {free:.2f} of {total:.2f} GiB were free ({share:.0%} of the "
        f"{'RAM' if cpu else 'GPU'} used by other processes), but vLLM asks for "
        f"gpu_memory_utilization × total{f' = {util:g} × {total:.2f}' if util else ''} GiB."
    )
    if share >= LEFTOVER_SHARE and not expected and not cpu:
        out.add(
            "leak_or_other_process",
            0.8,
            f"{others:.1f} GiB ({share:.0%}) of the GPU is held by another process at start-up — "
            "most likely a leftover vLLM or training process",
            [ev],
            [
                Fix(
                    "action",
                    "find the process holding the GPU (nvidia-smi --query-compute-apps=pid,used_memory "
                    "--format=csv) and stop it; then start vLLM unchanged",
                    "a leftover engine is not a "
                    "co-tenant to budget for: lowering utilization would waste the GPU",
                    STEP_ACTION,
                ),
                util_fix,
            ],
            explanation
            + " Such a large share with no co-tenant expected is the signature of a process "
            "that did not exit (an orphaned engine from an earlier run or test).",
        )
        out.add(
            "util_overshoot",
            0.35,
            "utilization does not leave room for the memory already in use",
            [ev],
            [util_fix],
            explanation,
        )
        return
    out.add(
        "util_overshoot",
        0.85,
        f"gpu_memory_utilization asks for more than is free: {others:.1f} GiB are used by other processes",
        [ev],
        [util_fix],
        explanation,
    )
    if share >= 0.3 and not cpu:
        out.add(
            "leak_or_other_process",
            0.3,
            "the memory in use may belong to a leftover process",
            [ev],
            [
                Fix(
                    "action",
                    "check nvidia-smi for processes that should not be there",
                    "",
                    STEP_ACTION,
                )
            ],
        )


def rule_kv_too_small(s: Situation, out: Findings) -> None:
    """The fit check: one request at max_model_len needs more KV than available (§7.2, §5.4)."""
    p = s.parsed
    ev = p.evidence("kv_too_small")
    if ev is None:
        return
    length = s.get("kv_error_max_model_len")
    capacity: int | None = None
    basis = ""
    if s.get("estimated_max_model_len"):
        capacity = int(s.get("estimated_max_model_len"))
        basis = f"vLLM estimates the maximum model length at {capacity:,}"
    elif s.get("kv_capacity_tokens"):
        capacity = int(s.get("kv_capacity_tokens"))
        basis = f"the KV cache holds {capacity:,} tokens"
    elif s.get("kv_needed_gib") and s.get("kv_available_gib") and length:
        need, avail = float(s.get("kv_needed_gib")), float(s.get("kv_available_gib"))
        if need > 0 and avail > 0:
            capacity = int(length * avail / need)
            basis = f"{avail:g} GiB of KV cache holds about {capacity:,} tokens ({need:g} GiB are needed for {length:,})"
    fixes: list[Fix] = []
    if capacity:
        new_len = nice_max_model_len(capacity, s.block_size)
        fixes.append(
            Fix(
                "--max-model-len",
                str(new_len),
                f"{basis}; {new_len:,} leaves a small margin "
                f"(multiple of the {s.block_size}-token block)",
                STEP_MAX_MODEL_LEN,
            )
        )
    kv_bytes = s.context.args.get("kv_cache_memory_bytes") or p.args.get("kv_cache_memory_bytes")
    if kv_bytes:
        need_gib = float(s.get("kv_needed_gib") or 0.0)
        needed = int(need_gib * 2**30) if need_gib > 0 else _kv_bytes_for_max_len(s)
        value = f"{max(needed * 5 // 4, 16 * 2**20) // 2**20 + 1}M" if needed else "256M"
        fixes.append(
            Fix(
                "--kv-cache-memory-bytes",
                value,
                f"the KV cache gets exactly --kv-cache-memory-bytes ({kv_bytes}); "
                "it must hold one max_model_len request",
                STEP_MAX_MODEL_LEN + (0.1 if capacity else -0.1),
            )
        )
    util, total = s.util, s.total_gib
    need, avail = s.get("kv_needed_gib"), s.get("kv_available_gib")
    if kv_bytes:
        pass  # utilization does not size the KV cache when its bytes are given
    elif util is not None and total and need is not None and avail is not None:
        new_util = ceil2(util + (float(need) - float(avail)) / total + 0.01)
        if new_util <= 0.95:
            fixes.append(
                Fix(
                    "--gpu-memory-utilization",
                    f"{new_util:.2f}",
                    f"adds the missing {float(need) - float(avail):.2f} GiB to the KV budget "
                    "(only if nothing else needs that memory)",
                    STEP_UTIL if (s.util_stated and util < 0.85) else STEP_KV_DTYPE + 0.1,
                )
            )
    elif s.util_stated and util is not None and util < 0.85:
        fixes.append(
            Fix(
                "--gpu-memory-utilization",
                f"{min(util + 0.1, 0.9):.2f}",
                f"utilization {util:g} leaves little for the KV cache",
                STEP_UTIL,
            )
        )
    if str(s.get("kv_cache_dtype") or "auto") in ("auto", "bfloat16", "float16"):
        fixes.append(
            Fix(
                "--kv-cache-dtype",
                "fp8",
                "halves the KV bytes per token, doubling the tokens the same memory holds",
                STEP_KV_DTYPE,
            )
        )
    summary = (
        f"max_model_len {length:,} does not fit in the KV cache"
        if length
        else "max_model_len does not fit in the KV cache"
    )
    if capacity:
        summary += f" (it holds {capacity:,} tokens)"
    out.add(
        "kv_too_small_for_max_len",
        0.9,
        summary,
        [ev, p.evidence("estimated_max_model_len")],
        fixes,
        "vLLM checks at start-up that one request of max_model_len tokens fits in the KV cache "
        "left after weights, activations and graphs. max_model_len defaults to the model's "
        "maximum context; cap it to the real P99 prompt+output length.",
    )


def rule_no_cache_blocks(s: Situation, out: Findings) -> None:
    """Zero (or negative) KV budget: tell apart low utilization, weights, activation, TP."""
    p = s.parsed
    ev = p.evidence("no_cache_blocks") or p.evidence("auto_fit_failed")
    if ev is None:
        return
    util, total = s.util, s.total_gib
    budget = budget_gib(s)
    w = s.weights_per_gpu_gib
    weights = float(w.value) if w is not None else None
    act = s.get("activation_gib")
    seqs = s.get("max_num_seqs")
    seqs_known = s.known("max_num_seqs")
    engine_v1 = s.get("engine") == "v1" or _version_minor(s) >= 8
    evid = [ev, w.evidence if w else None, s.parsed.evidence("activation_gib")]
    kv_bytes = s.context.args.get("kv_cache_memory_bytes") or s.parsed.args.get(
        "kv_cache_memory_bytes"
    )
    if kv_bytes:
        needed = _kv_bytes_for_max_len(s)
        value = f"{max(needed * 5 // 4, 16 * 2**20) // 2**20 + 1}M" if needed else "256M"
        out.add(
            "kv_too_small_for_max_len",
            0.85,
            f"--kv-cache-memory-bytes {kv_bytes} is less than one KV block",
            evid,
            [
                Fix(
                    "--kv-cache-memory-bytes",
                    value,
                    "the KV cache gets exactly this many bytes; it must hold "
                    "at least one max_model_len request"
                    + (f" ({needed / 2**20:.1f} MiB)" if needed else ""),
                    STEP_UTIL,
                )
            ],
            "With --kv-cache-memory-bytes vLLM skips profiling and gives the KV cache exactly that budget.",
        )
        return
    # what the GPU held before this engine started: another engine or a leftover process
    # (the V0 0.6 profiling line, or V1's initial free memory); in those releases the budget
    # also counted it against this engine
    startup_total = s.get("startup_total_gib") or total
    held_before = s.get("initial_used_gib")
    if held_before is None and s.get("startup_free_gib") is not None and startup_total:
        held_before = float(startup_total) - float(s.get("startup_free_gib"))
    if (
        held_before is not None
        and startup_total
        and float(held_before) >= 0.25 * float(startup_total)
        and not s.context.expect_cotenant
        and s.get("platform") != "cpu"  # node RAM others use is the CPU backend's normal state
    ):
        held, tot = float(held_before), float(startup_total)
        counted = min(ceil2(held / tot + (util or 0.9)), 0.95) if util is not None else None
        fixes = [
            Fix(
                "action",
                "stop the other process holding the GPU (nvidia-smi), or give each engine its "
                "own GPU (CUDA_VISIBLE_DEVICES)",
                f"{held:.1f} GiB of {tot:.1f} GiB were in use before this engine started",
                STEP_ACTION,
            )
        ]
        if counted is not None and held / tot + (util or 0.9) <= 0.95:
            fixes.append(
                Fix(
                    "--gpu-memory-utilization",
                    f"{counted:.2f}",
                    f"this release charges the {held:.1f} GiB already in use to this engine's "
                    "budget: count them in the fraction",
                    STEP_UTIL,
                )
            )
        out.add(
            "leak_or_other_process",
            0.72,
            f"{held:.1f} GiB ({held / tot:.0%}) of the GPU were in use before this engine "
            "started: another engine or a leftover process",
            [ev, s.parsed.evidence("initial_used_gib"), s.parsed.evidence("startup_free_gib")],
            fixes,
            "vLLM measures what it may use from the GPU's state when it starts; memory another "
            "process holds then is gone from this engine's budget.",
        )
    graphs_est = s.get("cudagraph_estimate_gib")
    if graphs_est is not None and float(graphs_est) >= (max(2.0, 0.2 * budget) if budget else 8.0):
        # vLLM ≥ 0.21 reserves its estimate of the CUDA graphs' memory before the KV cache:
        # an estimate this size is what left the KV cache nothing
        est = float(graphs_est)
        out.add(
            "cuda_graph",
            0.82,
            f"vLLM reserved {est:.2f} GiB for CUDA graphs"
            + (f", {est / budget:.0%} of the {budget:.1f} GiB budget," if budget else "")
            + " before sizing the KV cache",
            [ev, s.parsed.evidence("cudagraph_estimate_gib")],
            [
                *capture_fixes(
                    "no graphs, so no reservation for them: if start-up then succeeds, the "
                    "estimate was what took the KV budget"
                ),
                Fix(
                    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",
                    "0",
                    "keeps the graphs but stops reserving the estimate up front (the memory "
                    "they really use then comes out of the headroom outside the budget)",
                    STEP_ENV,
                ),
            ],
            "Since v0.21 the start-up profiler estimates the memory CUDA graph capture will take "
            "and subtracts it from utilization × total before the KV cache gets anything.",
        )
    low_util = s.util_stated and util is not None and util <= 0.6
    if s.get("cpu_offload_gib") and util is not None and util <= 0.6:
        low_util = True
    if not low_util and util is not None and total and weights is not None and act is not None:
        # the log's own numbers: weights + activations + non-torch + a little KV fit the GPU
        # at a utilization vLLM accepts, so the budget, not the weights, is what is short
        nt = float(s.get("non_torch_gib") or 0.0)
        need = weights + float(act) + nt + 2 * CONTEXT_SLACK_GIB
        if need <= 0.92 * total and util < need / total:
            low_util = True
    if low_util and util is not None:
        fixes = []
        if total and weights is not None:
            need = (weights + float(act or 1.0) + 1.0 + CONTEXT_SLACK_GIB) / total
            new = min(max(ceil2(need + 0.05), round(util + 0.1, 2)), 0.9)
            fixes.append(
                Fix(
                    "--gpu-memory-utilization",
                    f"{new:.2f}",
                    f"weights {weights:.1f} GiB + activations "
                    f"must fit inside utilization × {total:.2f} GiB with room left for the KV cache",
                    STEP_UTIL,
                )
            )
        else:
            fixes.append(
                Fix(
                    "--gpu-memory-utilization",
                    f"{min(util + 0.2, 0.9):.2f}",
                    f"{util:g} is this instance's whole budget (weights + activations + KV cache), "
                    "not just the KV cache",
                    STEP_UTIL,
                )
            )
        out.add(
            "kv_too_small_for_max_len",
            0.75,
            f"gpu_memory_utilization {util:g} leaves nothing for the KV cache",
            evid,
            fixes,
            "gpu_memory_utilization is the fraction of the GPU for everything vLLM holds; at this "
            "value the weights and the profiled activations already use it up.",
        )
        return
    if weights is not None and budget is not None and weights >= 0.85 * budget:
        wt = s.get("weights_total_gib") or weights * s.tp
        out.add(
            "weights_dont_fit",
            0.8,
            f"weights take {weights:.1f} GiB of the {budget:.1f} GiB budget per GPU: no room for a KV cache",
            evid,
            weights_fixes(s, float(wt), budget),
            "The weights alone nearly fill gpu_memory_utilization × total memory; no utilization or "
            "length setting makes room — reduce the weights per GPU.",
        )
        return
    if p.has("mm_encoder_profile") or p.has("mm_encoder_frames"):
        rule_multimodal(s, out, base=0.7, evidence=[ev])
        return
    heavy_act = act is not None and budget is not None and float(act) > 0.2 * budget
    if (seqs_known is not None and seqs_known.stated and int(seqs) >= 512) or heavy_act:
        target = fewer_seqs(int(seqs) if seqs else None)
        fixes = [
            Fix(
                "--max-num-seqs",
                str(target),
                f"the profiling run and sampler warm-up size their buffers "
                f"for max_num_seqs={seqs or 1024} sequences; {target} cuts that peak",
                STEP_MAX_NUM_SEQS,
            )
        ]
        if heavy_act:
            keep, basis = None, ""
            if weights is not None and budget is not None and act:
                kv_bytes = _kv_bytes_for_max_len(s)
                kv_gib = kv_bytes / GIB if kv_bytes else 0.0
                nt = float(s.get("non_torch_gib") or 0.0)
                room = budget - weights - nt - kv_gib
                if room > 0:
                    keep = room / float(act)
                    basis = (
                        f"room for activations {budget:.1f} − {weights:.1f} weights − "
                        f"{nt:.2f} non-torch − {kv_gib:.2f} KV for one request = {room:.2f} GiB "
                        f"÷ the {float(act):.2f} GiB peak"
                    )
            fixes.append(
                batched_tokens_fix(
                    s,
                    keep,
                    f"the profiled activation peak ({float(act):.1f} GiB) is driven by the "
                    "tokens per batch",
                    2048,
                    basis,
                )
            )
        out.add(
            "concurrency_or_batch",
            0.7,
            f"the profiling run for {seqs or 'the default'} sequences used the memory meant for the KV cache",
            evid,
            fixes,
            "vLLM profiles one batch of max_num_batched_tokens over max_num_seqs sequences (and their "
            "sampler logits); that peak is subtracted before the KV cache gets anything.",
        )
        return
    # NCCL's record_stream inflating the profiled peak under TP is a V0-era mechanism (torch
    # before 2.1.2); the V1 engine's peak is its own profiling batch
    tp_fragmentation = (weights is not None and budget is not None and weights <= 0.5 * budget) or (
        (weights is None or budget is None) and not engine_v1
    )
    if s.tp > 1 and tp_fragmentation:
        out.add(
            "fragmentation",
            0.55,
            f"with tensor parallelism ({s.tp} GPUs) the profiled peak was inflated although the "
            "weights leave room",
            evid,
            [
                Fix(
                    "TORCH_NCCL_AVOID_RECORD_STREAMS",
                    "1",
                    "with TP>1 NCCL's record_stream keeps activation "
                    "blocks from being reused, inflating the profiled peak (needs torch ≥ 2.1.2)",
                    STEP_ENV,
                ),
                Fix(
                    "PYTORCH_CUDA_ALLOC_CONF",
                    "expandable_segments:True",
                    "reduces allocator fragmentation",
                    STEP_ENV + 0.1,
                ),
            ]
            if not s.sleep_mode
            else [],
            "Nothing in the weights explains an empty KV budget; with TP>1 the known mechanism is "
            "allocator fragmentation from NCCL streams inflating the profiled peak.",
        )
        return
    # nothing known but the message: the V1 engine's defaults (1024 sequences on large GPUs, a
    # profiling batch of max_num_batched_tokens plus the sampler warm-up for every sequence)
    # are the usual consumer, ahead of a utilization or length the log does not state
    bare = weights is None and act is None and not s.util_stated and not s.known("max_model_len")
    if bare and (engine_v1 or (s.get("engine") is None and _version_minor(s) == 0)):
        out.add(
            "concurrency_or_batch",
            0.5,
            "nothing but the message is known: the profiling batch and sampler warm-up for "
            "vLLM's default number of sequences most often take the KV budget",
            evid,
            [
                Fix(
                    "--max-num-seqs",
                    "256",
                    "the V1 default (1024 sequences on ≥ 70 GiB GPUs) sizes the sampler "
                    "warm-up and the profiling batch; 256 cuts that peak",
                    STEP_MAX_NUM_SEQS,
                ),
                Fix(
                    "--max-num-batched-tokens",
                    "4096",
                    "the profiling batch is max_num_batched_tokens long (8192 or more by "
                    "default in V1); its activation peak comes out of the KV budget",
                    STEP_BATCHED_TOKENS,
                ),
                Fix(
                    "--gpu-memory-utilization",
                    f"{min(round((util or 0.9) + 0.05, 2), 0.95):.2f}",
                    "gives the KV cache more of the GPU (if nothing else uses it)",
                    STEP_UTIL + 3,
                ),
            ],
            "vLLM subtracts the weights and the profiled peak from utilization × total before "
            "the KV cache gets anything; the message alone does not say which term grew. Check "
            "'Model loading took' and the profiling lines: weights near the budget mean a "
            "quantized checkpoint or more GPUs, a low utilization means raising it.",
        )
        out.add(
            "kv_too_small_for_max_len",
            0.45,
            "or the utilization is too low for weights plus KV cache",
            evid,
            [
                Fix(
                    "--gpu-memory-utilization",
                    f"{min(round((util or 0.9) + 0.05, 2), 0.95):.2f}",
                    "gives the KV cache more of the GPU (if nothing else uses it)",
                    STEP_UTIL,
                )
            ],
        )
        return
    # generic: the budget is too small for weights + activation at these settings
    fixes = []
    if util is not None and util < 0.95:
        fixes.append(
            Fix(
                "--gpu-memory-utilization",
                f"{min(round(util + 0.05, 2), 0.95):.2f}",
                "gives the KV cache more of the GPU (if nothing else uses it)",
                STEP_UTIL,
            )
        )
    if engine_v1 and not (seqs_known and seqs_known.stated):
        fixes.append(
            Fix(
                "--max-num-seqs",
                "256",
                "the V1 default of 1024 sequences on large GPUs inflates the profiling peak",
                STEP_MAX_NUM_SEQS,
            )
        )
    # a short max_model_len and a utilization already high leave the profiling batch as the
    # term to cut: the message is about zero blocks, not about one request's length
    length = s.get("max_model_len") if s.known("max_model_len") else None
    short_len = length is not None and int(length) <= 16384
    batch_first = engine_v1 and short_len and util is not None and util >= 0.85
    out.add(
        "kv_too_small_for_max_len",
        0.35 if batch_first else 0.5,
        "no memory left for the KV cache after weights and activations",
        evid,
        fixes,
        "The budget (utilization × total) minus weights, activation peak and non-torch "
        "memory is zero or negative.",
    )
    if engine_v1:
        seqs_fix = str(fewer_seqs(int(seqs) if seqs else None)) if batch_first else "256"
        out.add(
            "concurrency_or_batch",
            0.5 if batch_first else 0.3,
            (
                f"max_model_len is only {int(length):,} and utilization {util:g}: the profiling "
                "batch over max_num_seqs sequences took what the weights left"
                if batch_first and length is not None and util is not None
                else "the profiling peak for many sequences may have consumed the budget"
            ),
            evid,
            [
                Fix(
                    "--max-num-seqs",
                    seqs_fix,
                    f"a quarter of the {int(seqs) if seqs else 1024} sequences the profiling "
                    "batch and sampler warm-up are sized for"
                    if batch_first
                    else "smaller profiling and sampler peak",
                    STEP_MAX_NUM_SEQS,
                ),
                Fix(
                    "--max-num-batched-tokens",
                    "2048",
                    "the profiling batch is max_num_batched_tokens long; its activation peak "
                    "comes out of the KV budget",
                    STEP_BATCHED_TOKENS,
                ),
            ],
        )


_CPU_KV = re.compile(r"requested memory for kv \((-?[\d.]+)(?:/([\d.]+))? GiB\)")


def rule_cpu_kv_allocation(s: Situation, out: Findings) -> None:
    """CPU backend: utilization × node RAM minus the process RSS left nothing for the KV cache."""
    ev = s.parsed.evidence("cpu_kv_allocation_failed")
    if ev is None:
        return
    m = _CPU_KV.search(ev.text)
    total = s.get("startup_total_gib") or s.total_gib
    util = s.util
    fixes: list[Fix] = []
    if m and total and util is not None and s.util_stated:
        kv = float(m.group(1))
        wanted = max(float(m.group(2) or 0.5), 0.5)
        rss = util * float(total) - kv  # requested − RSS = kv
        new = min(ceil2((rss + wanted + 0.25) / float(total)), 0.9)
        fixes.append(
            Fix(
                "--gpu-memory-utilization",
                f"{new:.2f}",
                f"on the CPU backend the flag is the share of "
                f"node RAM; {util:g} × {float(total):.2f} GiB is below the {rss:.2f} GiB the worker already "
                "holds",
                STEP_UTIL,
            )
        )
    out.add(
        "kv_too_small_for_max_len",
        0.8,
        "utilization × RAM minus what the worker holds leaves no KV cache",
        [ev],
        fixes,
        "On the CPU backend vLLM gives the KV cache gpu_memory_utilization × node RAM minus the "
        "process's resident memory; a utilization below the RSS leaves a negative budget.",
    )


def rule_mamba(s: Situation, out: Findings) -> None:
    p = s.parsed
    ev = p.evidence("mamba_blocks_exceeded")
    if ev is None:
        return
    blocks = int(s.get("mamba_cache_blocks") or 0)
    seqs = int(s.get("mamba_max_num_seqs") or 0)
    target = max((blocks // 8) * 8 if blocks >= 16 else blocks, 1)
    nice = power_of_two_at_most(blocks) if blocks else target
    if nice >= 0.9 * blocks:
        target = nice
    out.add(
        "concurrency_or_batch",
        0.92,
        f"max_num_seqs {seqs} exceeds the {blocks} Mamba state blocks the memory holds",
        [ev],
        [
            Fix(
                "--max-num-seqs",
                str(target),
                f"each running sequence needs one Mamba state block; {blocks} fit",
                STEP_MAX_NUM_SEQS,
            )
        ],
        "Hybrid (Mamba/linear-attention) models keep a fixed-size state per running sequence; the "
        "pool must hold max_num_seqs of them.",
    )


def rule_sampler(s: Situation, out: Findings) -> None:
    p = s.parsed
    ev = p.evidence("sampler_warmup_oom")
    fp = p.failure_phase
    if ev is None and p.ooms and fp is not None and fp.value == Phase.SAMPLER_WARMUP:
        # the OOM's traceback runs through the sampler warm-up (its message may be cut)
        ev = fp.evidence
    if ev is None:
        return
    stated_seqs = s.get("sampler_warmup_oom_seqs") or s.get("max_num_seqs")
    seqs = int(stated_seqs or 1024)
    target = fewer_seqs(seqs)
    oom = p.first_oom
    fixes = [
        Fix(
            "--max-num-seqs",
            str(target),
            f"the sampler warm-up materialises logits for {seqs} "
            f"sequences × the vocabulary; {target} needs a quarter",
            STEP_MAX_NUM_SEQS,
        )
    ]
    extra = 0.0
    if oom is not None and oom.tried_gib is not None and oom.free_gib is not None:
        extra = max(oom.tried_gib - oom.free_gib, 0.0)
    util_fix = lower_util(s, max(extra, 0.0), "leaves headroom for the sampler's logits")
    if util_fix is not None:
        fixes.append(util_fix)
    out.add(
        "concurrency_or_batch",
        0.9,
        f"the sampler warm-up with {seqs} dummy requests ran out of memory"
        if stated_seqs
        else "the sampler warm-up (one dummy request per max_num_seqs, 1024 by default on large "
        "GPUs) ran out of memory",
        [ev, oom.evidence if oom else None],
        fixes,
        "vLLM warms up the sampler with max_num_seqs requests; their logits (sequences × vocabulary, "
        "in float32, plus sort buffers) can take several GiB on large-vocabulary models.",
    )


def rule_multimodal(
    s: Situation,
    out: Findings,
    base: float = 0.8,
    evidence: list[Evidence | None] | None = None,
    runtime: bool = False,
) -> None:
    """The vision/audio encoder ran out of memory: its profiling run on maximal dummy items
    (start-up) or, with ``runtime``, a real request's oversized image while serving."""
    p = s.parsed
    ev = (
        p.evidence("mm_encoder_profile")
        or p.evidence("failing_in_mm_encoder")
        or p.evidence("mm_encoder_frames")
    )
    if ev is None:
        return
    if runtime:
        out.add(
            "multimodal_encoder",
            base,
            "the vision/audio encoder ran out of memory on a request's input while serving",
            [ev, *(evidence or [])],
            [
                Fix(
                    "--mm-processor-kwargs",
                    '{"max_pixels": 1003520}',
                    "bounds the image size the encoder processes (Qwen-VL style processors; "
                    "other models: resize images before sending them)",
                    STEP_MULTIMODAL,
                ),
                Fix(
                    "--limit-mm-per-prompt",
                    '{"image": 1}',
                    "fewer images per prompt in one encoder batch",
                    STEP_MULTIMODAL + 0.1,
                ),
            ],
            "The encoder's memory grows with the pixels (patches) of the images in one batch; "
            "images larger than the profiled maximum allocate beyond the budget.",
        )
        return
    seqs = s.get("max_num_seqs")
    items = s.get("encoder_profile_items")
    profiled = int(items or seqs or 0)
    fraction = oom_fit_fraction(s)
    if profiled and fraction is not None:
        target = max(power_of_two_at_most(int(profiled * fraction)), 1)
        why = (
            f"the encoder profile runs up to one maximal item per sequence; {profiled} "
            f"{'items' if items else 'sequences'} × {fraction:.2f} (free ÷ tried of the failed "
            f"allocation) = {profiled * fraction:.1f}, rounded down to {target}"
        )
    else:
        target = max(int(seqs) // 8, 1) if seqs else 32
        why = (
            "the encoder profile runs one maximal image per sequence ("
            + (f"max_num_seqs {seqs}" if seqs else "max_num_seqs at vLLM's default")
            + (f", {items} items" if items else "")
            + "); a first step, the log does not give the sizes to compute it"
        )
    fixes = [
        Fix("--max-num-seqs", str(target), why, STEP_MAX_NUM_SEQS),
        Fix(
            "--limit-mm-per-prompt",
            '{"image": 1}',
            "profiles one image per prompt instead of the maximum",
            STEP_MULTIMODAL,
        ),
        Fix(
            "--mm-processor-kwargs",
            '{"max_pixels": 1003520}',
            "caps the image size the vision encoder is profiled with (Qwen-VL style processors)",
            STEP_MULTIMODAL + 0.1,
        ),
    ]
    profiling = p.has("mm_encoder_profile") or (
        p.failure_phase is not None and p.failure_phase.value == Phase.PROFILING
    )
    out.add(
        "multimodal_encoder",
        base,
        "the vision encoder's profiling run (dummy images of maximal size) ran out of memory"
        if profiling
        else "the vision/audio encoder ran out of memory (the failing traceback runs through it; "
        "at start-up that is its profiling run on maximal dummy images)",
        [ev, p.evidence("mm_encoder_frames"), *(evidence or [])],
        fixes,
        "Before sizing the KV cache vLLM runs the vision/audio encoder on the worst case: maximal "
        "images for many sequences. Its peak scales with max_num_seqs and the per-prompt item limits, "
        "not with max_model_len.",
    )


def rule_host_memory(s: Situation, out: Findings) -> None:
    p = s.parsed
    swap = p.evidence("cpu_swap_exhausted")
    if swap is not None:
        current = s.get("swap_space_gib")
        new = f"{int(current * 2) if current else 16}"
        out.add(
            "cpu_ram",
            0.9,
            "vLLM ran out of its CPU swap space for preempted sequences",
            [swap],
            [
                Fix(
                    "--max-num-seqs",
                    str(fewer_seqs(s.get("max_num_seqs") or default_max_num_seqs(s), factor=2)),
                    "fewer sequences in flight need less swap when preempted",
                    STEP_MAX_NUM_SEQS,
                ),
                Fix(
                    "--swap-space",
                    new,
                    "CPU memory (GiB per GPU) for KV blocks of preempted sequences "
                    "(n>1 / beam search)",
                    STEP_SWAP,
                ),
            ],
            "This is vLLM's own CPU swap area (--swap-space), not the OS swap file.",
        )
    too_large = p.evidence("cpu_swap_too_large")
    if too_large is not None:
        current = s.get("swap_space_gib")
        out.add(
            "cpu_ram",
            0.9,
            "vLLM refused a swap space larger than 70 % of the host's RAM",
            [too_large],
            [
                Fix(
                    "--swap-space",
                    f"{max(int(float(current) // 4), 1) if current else 2}",
                    "swap_space is pinned host RAM per GPU (× the tensor-parallel size); keep the "
                    "total well under the host's RAM",
                    STEP_SWAP - 8.5,
                )
            ],
            "V0 checks swap_space × GPUs against the host's total RAM at start-up.",
        )
    kill = (
        p.evidence("host_ram_kill")
        or p.evidence("host_alloc_failure")
        or p.evidence("host_ram_low")
    )
    died = p.evidence("died_unexpectedly")
    explained = p.ooms or any(
        p.has(sig)
        for sig in (
            "no_cache_blocks",
            "kv_too_small",
            "startup_check_failed",
            "cpu_kv_allocation_failed",
            "mamba_blocks_exceeded",
            "sampler_warmup_oom",
            "weight_load_oom",
            "auto_fit_failed",
        )
    )
    if kill is None and died is not None and not explained and "exit code: 0" not in died.text:
        kill = died
    if kill is not None:
        unified = p.has("unified_memory")
        fixes = []
        if s.get("cpu_blocks") or s.get("engine") == "v0":
            fixes.append(
                Fix(
                    "--swap-space",
                    "0",
                    "V0 pins swap_space GiB of host RAM per GPU for preempted sequences",
                    STEP_SWAP,
                )
            )
        if unified:
            fixes.append(
                lower_util(s, 2.0, "on unified memory the GPU budget is taken from system RAM")
                or Fix(
                    "--gpu-memory-utilization", "0.6", "GPU budget comes from system RAM", STEP_UTIL
                )
            )
        if s.get("cpu_offload_gib"):
            fixes.append(
                Fix("--cpu-offload-gb", "0", "offloaded weights live in host RAM", STEP_OFFLOAD)
            )
        if p.has("pinned_host_memory") and not any(f.flag == "--swap-space" for f in fixes):
            fixes.append(
                Fix(
                    "--swap-space",
                    "0",
                    "the failing allocation is pinned host memory: V0 pins swap_space GiB per "
                    "GPU for preempted sequences without checking what is free",
                    STEP_SWAP - 8.5,
                )
            )
        if s.sleep_mode:
            fixes.append(
                Fix(
                    "action",
                    "sleep mode level 1 parks each engine's weights in host RAM: count engines "
                    "× weights against the node's RAM, or sleep at level 2 (weights discarded)",
                    "sleep mode moves GPU memory to the host",
                    STEP_ACTION + 0.5,
                )
            )
        ray = p.has("ray_oom")
        fixes.append(
            Fix(
                "action",
                "give the node/container more RAM or stop other memory users (fewer API-server "
                "processes or Ray workers per node, no full-vocabulary logits returned to the "
                "host); "
                + (
                    "Ray's monitor kills above RAY_memory_usage_threshold (0.95 of the node)"
                    if ray
                    else "check `dmesg | grep -i oom` and `free -h`"
                ),
                "Ray's memory monitor killed workers for host RAM"
                if ray
                else "the kernel killed the process for host RAM",
                STEP_ACTION + 9,
            )
        )
        capture = _killed_in_capture(s)
        conf = 0.85 if kill is not died else 0.6
        if capture is not None and not ray:
            # killed with graph capture the last step the log shows: the capture (and the
            # compilation before it) is what grew, whichever memory the killer counted
            conf = 0.55
            out.add(
                "cuda_graph",
                0.62,
                "the process was killed while CUDA graphs were being captured",
                [capture, kill],
                capture_fixes(
                    "skips graph capture (and its compilation) entirely; if start-up then "
                    "succeeds, the capture was the step that ran out"
                ),
                "A kill right after 'Capturing CUDA graphs' is not automatically host RAM: the V1 "
                "engine compiles and captures many batch sizes, and the kill lands on the step "
                "that was growing.",
            )
        out.add(
            "cpu_ram",
            conf,
            "Ray's memory monitor killed workers: the node ran out of host RAM"
            if ray
            else "the process was killed for lack of host RAM",
            [kill],
            fixes,
            "A kill without a CUDA error is the kernel's (or Ray's) OOM killer: host memory ran "
            "out (weights staged in RAM while loading, pinned swap space, CPU offload, sleep-mode "
            "weights, returned logits, or unified memory).",
        )
    drv = p.evidence("driver_oom")
    if drv is not None and not any(o.kind == "torch" for o in p.ooms):
        if p.has("cumem_allocator"):
            cumem_fix = lower_util(
                s, 2.0, "the co-located process needs the rest of the GPU"
            ) or Fix(
                "--gpu-memory-utilization",
                "0.5",
                "share the GPU with the co-located trainer",
                STEP_UTIL,
            )
            out.add(
                "util_overshoot",
                0.7,
                "the GPU ran out while vLLM's sleep-mode pool mapped memory",
                [drv, p.evidence("cumem_allocator")],
                [cumem_fix],
                "cumem_allocator maps vLLM's whole budget; with a trainer or another engine on the same "
                "GPU, utilization × total plus the other process exceeds the card.",
            )
        elif p.has("pinned_host_memory"):
            out.add(
                "cpu_ram",
                0.75,
                "allocating pinned host memory failed",
                [drv, p.evidence("pinned_host_memory")],
                [
                    Fix(
                        "--swap-space",
                        "0",
                        "pinned (page-locked) host memory for the CPU swap blocks is what failed",
                        STEP_SWAP - 8.5,
                    )
                ],
                "A CUDA error on a pinned (cudaHostAlloc) allocation is host memory running out, "
                "not the GPU.",
            )
        elif (
            (s.get("cpu_blocks") or 0) > 0
            and s.parsed.failure_phase is not None
            and s.parsed.failure_phase.value in (Phase.KV_ALLOCATION, Phase.PROFILING)
        ):
            conf = 0.75 if p.has("wsl") else 0.6
            out.add(
                "cpu_ram",
                conf,
                "allocating the pinned CPU swap cache failed",
                [drv, p.evidence("wsl")],
                [
                    Fix(
                        "--swap-space",
                        "0",
                        f"{s.get('cpu_blocks')} CPU blocks of pinned host memory were "
                        "requested right before the failure"
                        + (" (WSL limits pinned memory)" if p.has("wsl") else ""),
                        STEP_SWAP,
                    )
                ],
                "A CUDA driver error (not a PyTorch allocation) right after the CPU block count is the "
                "pinned host-memory allocation of the swap space failing.",
            )
        elif p.has("said_capture") and not s.get("enforce_eager"):
            # the driver's own allocation failing where the text places graph capture: the
            # graphs' pools are allocated by the driver, outside the profiled peak
            out.add(
                "cuda_graph",
                0.55,
                "the driver ran out of memory where the text places CUDA-graph capture",
                [drv, p.evidence("said_capture")],
                capture_fixes(
                    "skips graph capture; if start-up then succeeds, the capture was what ran out"
                ),
                "CUDA graphs are captured after the KV cache is allocated, and releases that do "
                "not reserve their memory during profiling leave them only what utilization "
                "left outside its budget.",
            )
        else:
            fix_opt = lower_util(s, 1.0, "leaves room for memory allocated outside PyTorch")
            out.add(
                "util_overshoot",
                0.4,
                "the CUDA driver could not allocate memory outside PyTorch's pool",
                [drv],
                [fix_opt] if fix_opt else [],
            )


def capture_fixes(why_eager: str) -> list[Fix]:
    """Eager mode first (it proves the capture was the step), then fewer, smaller graphs."""
    return [
        Fix("--enforce-eager", None, why_eager, STEP_CUDAGRAPH),
        Fix(
            "--max-cudagraph-capture-size",
            "128",
            "captures fewer, smaller graphs (older releases: --cudagraph-capture-sizes)",
            STEP_CUDAGRAPH + 0.1,
        ),
    ]


def _killed_in_capture(s: Situation) -> Evidence | None:
    """The capture marker when graph capture is the last phase the log reached (nothing of
    serving after it)."""
    p = s.parsed
    if s.get("enforce_eager"):
        return None
    reached = p.phase_reached
    if reached != Phase.CUDA_GRAPH_CAPTURE:
        return None
    return p.phases.get(Phase.CUDA_GRAPH_CAPTURE)


def rule_leak(s: Situation, out: Findings) -> None:
    ev = s.parsed.evidence("memory_growth")
    if ev is None:
        return
    out.add(
        "leak_or_other_process",
        0.75,
        "memory use grows over time at a steady load",
        [ev],
        [
            Fix(
                "action",
                "watch per-process memory (nvidia-smi --query-compute-apps=pid,used_memory "
                "--format=csv -l 60) to see which process grows; upgrade vLLM/torch if it is the engine",
                "vLLM's KV pool is fixed at start-up: growth comes from elsewhere",
                STEP_ACTION,
            ),
            Fix(
                "--gpu-memory-utilization",
                f"{max(round((s.util or 0.9) - 0.1, 2), 0.1):.2f}",
                "headroom while the growth is found",
                STEP_UTIL,
            ),
        ],
        "vLLM allocates its KV cache once; steady growth under constant load is a leak (multimodal "
        "caches, LoRA adapters, NCCL buffers) or another process.",
    )


_STARTUP_PHASES = (
    Phase.STARTUP,
    Phase.WEIGHT_LOADING,
    Phase.PROFILING,
    Phase.KV_ALLOCATION,
    Phase.SAMPLER_WARMUP,
    Phase.CUDA_GRAPH_CAPTURE,
)


def rule_listed_processes(s: Situation, out: Findings) -> None:
    """A process listing (nvidia-smi) that shows another Python / vLLM process holding GPU
    memory while vLLM failed to start is evidence of a leftover or co-located process.

    At the start-up check vLLM itself holds only its CUDA context, so any sizeable Python
    process listed is another one; after that the failing engine may be in the listing
    itself, so it takes two sizeable Python processes on one GPU.
    """
    p = s.parsed
    fp = p.failure_phase
    startup_check = p.has("startup_check_failed")
    if not (startup_check or (fp is not None and fp.value in _STARTUP_PHASES)):
        return
    total = s.total_gib
    floor_gib = max(1.0, 0.1 * total) if total else 1.0
    holders = [g for g in p.gpu_processes if g.is_python and g.gib >= floor_gib]
    if not startup_check:
        per_gpu: dict[int | None, list[GpuProcess]] = {}
        for g in holders:
            per_gpu.setdefault(g.gpu_index, []).append(g)
        holders = [g for group in per_gpu.values() if len(group) >= 2 for g in group]
    if not holders:
        _ps_engines(s, out, startup_check)
        return
    engine = any(g.is_inference_engine for g in holders)
    held = sum(g.gib for g in holders)
    listed = ", ".join(f"PID {g.pid} {g.name} {g.gib:.1f} GiB" for g in holders[:4])
    confidence = 0.88 if engine else 0.65
    if s.context.expect_cotenant:
        confidence = 0.35
    fixes = [
        Fix(
            "action",
            f"stop the listed process{'es' if len(holders) > 1 else ''} ({listed}) if "
            f"{'they are' if len(holders) > 1 else 'it is'} left over from an earlier run, "
            "then start vLLM unchanged",
            "a leftover engine or notebook kernel is not a co-tenant to budget for",
            STEP_ACTION,
        )
    ]
    if total:
        fixes.append(
            util_to_fit_free(
                s,
                max(float(total) - held - CONTEXT_SLACK_GIB, 0.05 * float(total)),
                float(total),
                f"only if the process must stay: {held:.1f} GiB held by it must stay outside "
                "vLLM's utilization × total",
            )
        )
    failure = p.evidence("startup_check_failed") or (fp.evidence if fp else None)
    out.add(
        "leak_or_other_process",
        confidence,
        f"the process listing shows {'a vLLM engine' if engine else 'a Python process'} "
        f"holding {held:.1f} GiB of the GPU while vLLM failed to start",
        [*(g.evidence for g in holders), failure],
        fixes,
        "Memory held by another engine (an orphaned EngineCore or worker from an earlier run, "
        "a notebook kernel) is unavailable to the new one; vLLM's start-up check and profiling "
        "count it as used.",
    )


def _ps_engines(s: Situation, out: Findings, startup_check: bool) -> None:
    """`ps` rows of running vLLM servers while a new one failed to start: their GPU memory is
    not shown, so this is weaker evidence than a GPU process listing."""
    p = s.parsed
    if not p.engine_processes:
        return
    fp = p.failure_phase
    failure = p.evidence("startup_check_failed") or (fp.evidence if fp else None)
    # at the start-up check the new engine holds nothing yet: a running server is the
    # likeliest holder of the memory in use
    confidence = 0.87 if startup_check else 0.55
    if s.context.expect_cotenant:
        confidence = 0.3
    out.add(
        "leak_or_other_process",
        confidence,
        f"a process listing shows {len(p.engine_processes)} vLLM process"
        f"{'es' if len(p.engine_processes) > 1 else ''} running while vLLM failed to start",
        [*p.engine_processes[:4], failure],
        [
            Fix(
                "action",
                "stop the vLLM processes left over from earlier runs (check nvidia-smi "
                "--query-compute-apps=pid,used_memory --format=csv), then start vLLM unchanged",
                "an orphaned engine keeps its weights and KV cache on the GPU",
                STEP_ACTION,
            )
        ],
        "A vLLM engine that did not exit (an orphaned EngineCore or worker) keeps its whole "
        "budget on the GPU; the new engine's start-up check and profiling count it as used.",
    )


def rule_profiling_free_increase(s: Situation, out: Findings) -> None:
    ev = s.parsed.evidence("profiling_free_increase")
    if ev is None:
        return
    grew = s.get("profiling_free_increase")
    out.add(
        "other",
        0.85,
        f"free memory grew{f' by {grew:.2f} GiB' if grew else ''} while vLLM profiled: "
        "another process released GPU memory",
        [ev],
        [
            Fix(
                "action",
                "start vLLM when no other process on the GPU is starting or stopping, or "
                "isolate it on its own GPU",
                "the profiling difference is only valid if nothing else "
                "changes the GPU's free memory",
                STEP_ACTION,
            ),
            Fix(
                "--kv-cache-memory-bytes",
                "<value from an earlier run's suggestion line>",
                "skips the profiling arithmetic entirely",
                STEP_UTIL,
            ),
        ],
        "Not an out-of-memory: vLLM measures its own usage as the drop in free memory, which is "
        "invalid when a co-tenant frees memory (or on unified-memory systems).",
    )


def rule_shm_exhausted(s: Situation, out: Findings) -> None:
    """/dev/shm too small: host shared memory (a container's is 64 MiB unless raised) for
    Ray's object store, NCCL's buffers and the workers' message queues."""
    ev = s.parsed.evidence("shm_exhausted")
    if ev is None:
        return
    out.add(
        "cpu_ram",
        0.8,
        "host shared memory (/dev/shm) is too small for what vLLM's workers put there",
        [ev],
        [
            Fix(
                "action",
                "give the container more shared memory: docker run --ipc=host (or "
                "--shm-size 16g); in Kubernetes mount an emptyDir with medium: Memory at /dev/shm",
                "/dev/shm is host RAM the container may use as files; its default size is 64 MiB",
                STEP_ACTION,
            )
        ],
        "Ray's object store, NCCL's intra-node buffers and vLLM's worker message queues live "
        "in /dev/shm; multi-GPU and pipeline-parallel runs need far more than a container's "
        "default.",
    )


def rule_wsl_resident(s: Situation, out: Findings) -> None:
    """WSL2 failing to make GPU memory resident (dxgkio_make_resident -12): the expandable
    segments the allocator maps and remaps are what WSL's paravirtualised driver refuses."""
    ev = s.parsed.evidence("wsl_resident_enomem")
    if ev is None:
        return
    expandable = s.parsed.evidence("expandable_segments_in_use")
    out.add(
        "other",
        0.75,
        "WSL2's GPU driver refused to make memory resident (ENOMEM from dxgkio_make_resident)",
        [ev, expandable],
        [
            Fix(
                "PYTORCH_CUDA_ALLOC_CONF",
                "expandable_segments:False",
                "under WSL2 the expandable segments' virtual-memory mapping is what fails; "
                "plain cudaMalloc blocks are made resident once",
                STEP_ACTION,  # the change that removes the cause, ahead of the headroom
            ),
            lower_util(s, 1.5, "WSL2 keeps part of the GPU for Windows")
            or Fix(
                "--gpu-memory-utilization",
                "0.85",
                "WSL2 keeps part of the GPU for Windows",
                STEP_UTIL,
            ),
        ],
        "On WSL2 the GPU is reached through Windows' paravirtualised driver; its ENOMEM on "
        "making memory resident surfaces in CUDA as 'device not ready' or a kernel error, not "
        "as PyTorch's out-of-memory message.",
    )


def rule_sleep_expandable(s: Situation, out: Findings) -> None:
    ev = s.parsed.evidence("sleep_expandable_conflict")
    if ev is None:
        return
    out.add(
        "other",
        0.9,
        "expandable_segments is set, which vLLM's sleep-mode memory pool does not allow",
        [ev, s.parsed.evidence("expandable_segments_in_use")],
        [
            Fix(
                "PYTORCH_CUDA_ALLOC_CONF",
                "(unset, or without expandable_segments:True)",
                "sleep mode's cumem pool cannot use expandable segments",
                STEP_ENV,
            )
        ],
        "A configuration conflict, not an out-of-memory: remove expandable_segments from "
        "PYTORCH_CUDA_ALLOC_CONF for engines with --enable-sleep-mode.",
    )


def rule_weight_load_oom(s: Situation, out: Findings) -> None:
    ev = s.parsed.evidence("weight_load_oom")
    if ev is None:
        return
    _weights_finding(s, out, [ev], 0.85)


def _weights_finding(
    s: Situation, out: Findings, evidence: list[Evidence | None], confidence: float
) -> None:
    total = s.total_gib
    wt = s.known("weights_total_gib")
    per_gpu = float(wt.value) / s.tp if wt is not None else None
    budget = budget_gib(s) or (total * 0.9 if total else None)
    if per_gpu is not None and total and per_gpu < 0.6 * total:
        # the arithmetic says the weights fit: something else went wrong while loading
        out.add(
            "other",
            confidence * 0.75,
            f"the weights (~{per_gpu:.1f} GiB per GPU) should fit in {total:.1f} GiB, yet loading ran out of memory",
            evidence,
            [
                Fix(
                    "action",
                    "try the previous vLLM release or report a regression; check for another "
                    "process on the GPU",
                    "the configuration is not the problem by the numbers",
                    STEP_ACTION,
                )
            ],
            "Loading needs the weights plus small transient buffers; an OOM far below the GPU's "
            "size points to a loader regression or an unexpected allocation.",
        )
        out.add(
            "weights_dont_fit",
            confidence * 0.4,
            "weight loading ran out of memory",
            evidence,
            weights_fixes(s, float(wt.value), budget) if wt is not None and budget else [],
        )
        return
    fixes = (
        weights_fixes(s, float(wt.value), budget)
        if wt is not None and budget
        else [
            *(f for f in ([] if _already_4bit(s) else [int4_fix(s)]) if f is not None),
            Fix(
                "--tensor-parallel-size",
                str(max(s.tp * 2, 2)),
                "split the weights over more GPUs" + _tp_available_note(s, max(s.tp * 2, 2)),
                tp_step(s, max(s.tp * 2, 2)),
            ),
        ]
    )
    summary = "the weights do not fit on the GPU"
    if per_gpu is not None and total:
        origin = ", " + wt.origin if wt and wt.origin == "name" else ""
        if per_gpu >= total:
            summary = (
                f"the weights (~{per_gpu:.1f} GiB per GPU{origin}) do not fit in {total:.1f} GiB"
            )
        else:
            summary = (
                f"the weights (~{per_gpu:.1f} GiB per GPU{origin}) leave too little of the "
                f"{total:.1f} GiB GPU for what vLLM needs beside them"
            )
    out.add(
        "weights_dont_fit",
        confidence,
        summary,
        [*evidence, wt.evidence if wt else None],
        fixes,
        "The out-of-memory happened while the model's parameters were being created/loaded: the "
        "weights alone exceed the GPU at this precision and parallelism.",
    )


def estimated_graph_gib(s: Situation) -> tuple[float, str] | None:
    """CUDA-graph memory by the memory model for the log's model and settings (the 0.20+
    estimate's formula, which models what the captured graphs hold), or None."""
    spec = s.model_spec
    if spec is None:
        return None
    try:
        from oomguard.memory.activation import cudagraph_estimate
        from oomguard.memory.versions import resolve_era

        era = resolve_era("0.20", "v1")  # the first release whose estimate is applied
        seqs = int(s.get("max_num_seqs") or default_max_num_seqs(s))
        tokens = int(s.get("max_num_batched_tokens") or 8192)
        pp = int(s.get("pipeline_parallel_size") or 1)
        est = cudagraph_estimate(
            spec,
            era,
            stage_layers=-(-spec.num_layers // pp),
            max_num_seqs=seqs,
            max_num_batched_tokens=tokens,
            enforce_eager=False,
            compute_capability=str(getattr(s.gpu_spec, "compute_capability", "") or ""),
        )
    except Exception:  # a model the estimate cannot price: no computed value
        return None
    if not est.value_bytes:
        return None
    return est.value_bytes / GIB, f"estimated by the memory model for {seqs} sequences"


def graph_util_fix(s: Situation, graphs_gib: float | None, short_gib: float) -> Fix | None:
    """Lower utilization by the graphs' size ÷ total memory, rounded up to 0.01.

    The graphs' size is the log's figure, else the memory model's estimate; the failed
    allocation's shortfall is used when it is larger. Without either, 1 GiB (vLLM's own old
    warning: "CUDA graphs can take additional 1~3 GiB memory per GPU"), said as such.
    """
    util, total = s.util, s.total_gib
    if util is None or not total:
        return None
    if graphs_gib:
        gib, basis = float(graphs_gib), "the log's CUDA-graph figure"
    else:
        estimated = estimated_graph_gib(s)
        if estimated is not None:
            gib, basis = estimated
        else:
            gib, basis = (
                1.0,
                "no graph figure in the log and the model is unknown: vLLM's 1–3 GiB rule, low end",
            )
    if short_gib > gib:
        gib, basis = short_gib, "the failed allocation less the free memory"
    step = max(ceil2(gib / total), 0.01)
    new = round(util - step, 2)
    if new <= 0.1:
        return None
    origin = "" if s.util_stated else f" (vLLM's default {util:g})"
    return Fix(
        "--gpu-memory-utilization",
        f"{new:.2f}",
        f"CUDA graphs are captured after the KV cache is allocated and live outside "
        f"utilization × total: {util:g}{origin} − ⌈{gib:.2f} GiB ({basis}) ÷ {total:.2f} GiB⌉ "
        f"= {util:g} − {step:.2f} = {new:.2f}",
        STEP_UTIL,
    )


def rule_cudagraph(s: Situation, out: Findings) -> None:
    p = s.parsed
    fp = p.failure_phase
    hint = p.evidence("cudagraph_oom_hint")
    in_capture = (
        fp is not None
        and fp.value == Phase.CUDA_GRAPH_CAPTURE
        and (p.ooms or p.has("driver_oom") or hint)
    )
    if not (in_capture or hint):
        return
    oom = p.first_oom
    graphs = s.get("cudagraph_actual_gib") or s.get("cudagraph_estimate_gib")
    short = 0.0
    if oom is not None and oom.tried_gib is not None and oom.free_gib is not None:
        short = max(oom.tried_gib - oom.free_gib, 0.0)
    fixes: list[Fix] = []
    util_fix = graph_util_fix(s, graphs, short)
    util_first = util_fix is not None and s.util_stated and (s.util or 0) >= 0.95
    if util_fix is not None:
        fixes.append(util_fix if util_first else replace(util_fix, step=STEP_CUDAGRAPH + 0.2))
    fixes.append(
        Fix(
            "--max-cudagraph-capture-size",
            "128",
            "captures fewer, smaller graphs (older "
            "releases: --max-seq-len-to-capture / --cudagraph-capture-sizes)",
            STEP_CUDAGRAPH,
        )
    )
    fixes.append(
        Fix(
            "--enforce-eager",
            None,
            "no CUDA graphs at all (slower decoding, no capture memory)",
            STEP_CUDAGRAPH + 0.1,
        )
    )
    out.add(
        "cuda_graph",
        0.85,
        "ran out of memory while capturing CUDA graphs"
        + (f" (graphs took {graphs:.2f} GiB)" if graphs else ""),
        [
            fp.evidence if fp else None,
            hint,
            oom.evidence if oom else None,
            p.evidence("cudagraph_actual_gib"),
        ],
        fixes,
        "CUDA-graph capture runs after the KV cache has taken its share; the graphs' memory must "
        "fit in what gpu_memory_utilization leaves outside vLLM's budget (or be estimated and "
        "subtracted, in 0.18+).",
    )


def rule_torch_oom(s: Situation, out: Findings) -> None:
    """A PyTorch allocator OOM: reason from the phase, the allocator numbers, the failing
    traceback's frames and co-tenants."""
    p = s.parsed
    oom = p.first_oom
    if oom is None or oom.kind == "driver":
        return
    total = oom.total_gib or s.total_gib
    ev = oom.evidence
    phase = p.failure_phase.value if p.failure_phase else None
    unalloc, tried = oom.reserved_unallocated_gib, oom.tried_gib

    if _unbounded_allocation(s, out, oom, total, phase):
        return

    # fragmentation: only when the reserved-but-unallocated memory could have served the request
    if unalloc is not None and tried:
        # a request of a few hundred MiB failing beside as much reserved-but-unallocated
        # memory is fragmentation too; below a quarter GiB the numbers are noise
        big = max(0.25, 0.01 * total) if total else 0.25
        # a co-tenant holding a quarter of the GPU or more is the bigger lever: the
        # fragmented remainder only decided which allocation failed first
        crowded = bool(
            total and oom.other_processes_gib and oom.other_processes_gib >= 0.25 * total
        )
        if unalloc >= tried and unalloc >= big:
            fixes = (
                []
                if s.sleep_mode
                else [
                    Fix(
                        "PYTORCH_CUDA_ALLOC_CONF",
                        "expandable_segments:True",
                        f"{unalloc:.2f} GiB are reserved but unallocated — more than the {tried:.2f} GiB request",
                        STEP_ENV,
                    )
                ]
            )
            if s.sleep_mode:
                fixes.append(
                    lower_util(
                        s,
                        unalloc,
                        "sleep mode cannot use expandable segments; leave the "
                        "fragmented amount outside vLLM's budget",
                    )
                    or Fix("--gpu-memory-utilization", None, "lower it", STEP_UTIL)
                )
            out.add(
                "fragmentation",
                0.45 if crowded else 0.75,
                f"{unalloc:.2f} GiB sit reserved but unallocated while a "
                f"{tried:.2f} GiB allocation failed",
                [ev],
                fixes,
                "PyTorch's caching allocator holds free blocks that are too fragmented to serve the "
                "request; expandable segments let it grow blocks in place.",
            )
        elif unalloc >= 0.5 * tried and unalloc >= 0.25:
            out.add(
                "fragmentation",
                0.3,
                "some reserved memory is unallocated",
                [ev],
                []
                if s.sleep_mode
                else [
                    Fix(
                        "PYTORCH_CUDA_ALLOC_CONF",
                        "expandable_segments:True",
                        "may let the allocator reuse the fragmented blocks",
                        STEP_ENV,
                    )
                ],
            )

    # other processes on the GPU
    others = oom.other_processes_gib
    shortfall = max((tried or 0.0) - (oom.free_gib or 0.0), 0.0) if tried else None
    # a co-tenant counts when it is sizeable, or when what it holds would have covered the
    # failed allocation's shortfall (a trainer's leftover CUDA context tipping a full budget)
    tipped = (
        others is not None
        and (oom.this_process_gib is not None or bool(oom.processes_gib))  # listed, not inferred
        and others >= 0.25
        and shortfall is not None
        and 0 < shortfall <= others
    )
    if others is not None and total and (others >= max(1.0, 0.05 * total) or tipped):
        share = others / total
        free_for_us = total - others - CONTEXT_SLACK_GIB
        fix = util_to_fit_free(
            s,
            free_for_us,
            total,
            f"{others:.1f} GiB are used by another process; vLLM's "
            "utilization is a fraction of the whole GPU, so it must leave that out",
        )
        lowered = lower_util(
            s,
            others + (shortfall or 0.0),
            f"{others:.2f} GiB held by another process (and the {shortfall or 0.0:.2f} GiB the "
            "allocation lacked) must stay outside vLLM's utilization × total",
        )
        if lowered is not None and float(lowered.value or 1) < float(fix.value or 1):
            fix = lowered  # the budget in force already exceeds what is free beside the co-tenant
        if share >= LEFTOVER_SHARE and not (
            s.context.expect_cotenant or (s.util_stated and (s.util or 1) <= 0.6)
        ):
            out.add(
                "leak_or_other_process",
                0.7,
                f"{others:.1f} GiB ({share:.0%}) of the GPU is held by another process",
                [ev],
                [
                    Fix(
                        "action",
                        "stop the process holding the GPU (see nvidia-smi)",
                        "a leftover process should be removed, not budgeted",
                        STEP_ACTION,
                    ),
                    fix,
                ],
            )
            out.add(
                "util_overshoot",
                0.4,
                "utilization does not budget for the other process",
                [ev],
                [fix],
            )
        else:
            # a sizeable co-tenant is a measured cause; a small one that merely tipped the
            # allocation over is weaker than what the failing frame or batch says
            sizeable = others >= max(1.0, 0.05 * total)
            out.add(
                "util_overshoot",
                0.78 if sizeable else 0.58,
                f"another process uses {others:.1f} GiB of the GPU that "
                "gpu_memory_utilization does not budget for",
                [ev],
                [fix],
                "vLLM's budget is utilization × total memory, regardless of what others use; a "
                "co-tenant must be subtracted by lowering utilization.",
            )

    if phase == Phase.WEIGHT_LOADING:
        # loading failed while other processes held most of the GPU and this one little of
        # it: the weights never had the GPU to themselves
        crowded = bool(
            total
            and others is not None
            and others >= 0.5 * total
            and (oom.this_process_gib is None or oom.this_process_gib < others)
        )
        _weights_finding(
            s,
            out,
            [ev, p.failure_phase.evidence if p.failure_phase else None],
            0.5 if crowded else 0.8,
        )
    elif phase == Phase.PROFILING:
        if p.has("mm_encoder_profile") or p.has("mm_encoder_frames"):
            rule_multimodal(s, out, base=0.8, evidence=[ev])
        else:
            full_length = v0_profiles_full_length(s)
            out.add(
                "concurrency_or_batch",
                # in V0 the batch is a whole max_model_len prompt: the length, not the
                # weights, is the lever unless the weights alone fill the budget
                0.7 if full_length else 0.6,
                "the profiling forward pass ran out of memory"
                + (" (V0 profiles one max_model_len-token batch)" if full_length else ""),
                [ev],
                activation_fixes(
                    s, "the profiling pass runs one batch of max_num_batched_tokens tokens"
                ),
                "Before sizing the KV cache vLLM runs one dummy batch of the largest size it "
                "will schedule; its activation peak must fit next to the weights."
                + (
                    " In V0 without chunked prefill that batch is max_model_len tokens long."
                    if full_length
                    else ""
                ),
            )
            _maybe_weights(s, out, [ev], 0.35)
    elif phase == Phase.KV_ALLOCATION:
        if is_multimodal_model(s) and (s.get("gpu_blocks") or s.get("kv_tokens")):
            # the KV cache was sized (a block count was logged) and the OOM came after it on
            # a vision-language model: the encoder's memory was not in the budget
            out.add(
                "multimodal_encoder",
                0.6,
                "a vision-language model ran out of memory after its KV cache was sized: the "
                "vision encoder's activations were not in the budget",
                [ev, s.parsed.evidence("gpu_blocks") or s.parsed.evidence("kv_tokens")],
                [
                    Fix(
                        "--limit-mm-per-prompt",
                        '{"image": 1}',
                        "fewer images per prompt in one encoder batch",
                        STEP_MULTIMODAL,
                    ),
                    Fix(
                        "--mm-processor-kwargs",
                        '{"max_pixels": 1003520}',
                        "bounds the image size the encoder processes (Qwen-VL style processors)",
                        STEP_MULTIMODAL + 0.1,
                    ),
                    *(
                        [f]
                        if (
                            f := lower_util(
                                s,
                                max((tried or 0) - (oom.free_gib or 0), 2.0),
                                "leaves room outside the KV budget for the encoder's activations "
                                "(or upgrade to a vLLM that profiles the encoder)",
                            )
                        )
                        else []
                    ),
                ],
                "Releases whose profile run skipped the vision encoder sized the KV cache from "
                "text-only activations; the first real image then needs memory that is gone.",
            )
        fix_opt = lower_util(
            s,
            max((tried or 0) - (oom.free_gib or 0), 0.0),
            "the KV tensors did not fit next to what was already allocated",
        )
        out.add(
            "util_overshoot",
            0.55,
            "allocating the KV cache itself ran out of memory",
            [ev],
            [fix_opt] if fix_opt else [],
        )
    elif phase == Phase.SERVING:
        if p.has("failing_in_mm_encoder"):
            rule_multimodal(
                s, out, base=0.65, evidence=[ev, p.evidence("failing_in_mm_encoder")], runtime=True
            )
        _runtime_oom(s, out, oom, total)
    elif phase == Phase.CUDA_GRAPH_CAPTURE or phase == Phase.SAMPLER_WARMUP:
        pass  # handled by their own rules
    else:
        _phaseless_oom(s, out, oom, total)


# A single allocation this large is a batch's intermediate tensor (activations, logits, an
# image's patches), not a weight tensor or a KV block: the largest weight tensors of common
# models (embeddings, stacked MoE experts per TP rank) stay below it.
BATCH_SIZED_SHARE = 0.1
BATCH_SIZED_MIN_GIB = 1.0


def _held_gib(oom: Any) -> float | None:
    """What the failing process holds on the GPU, as the OOM report states it."""
    return (
        oom.this_process_gib
        or oom.reserved_gib
        or (oom.processes_gib[0][1] if len(oom.processes_gib) == 1 else None)
        or oom.allocated_gib
    )


def _unbounded_allocation(
    s: Situation, out: Findings, oom: Any, total: float | None, phase: Phase | None
) -> bool:
    """One allocation larger than the whole device (or at least half of it outside weight
    loading and KV allocation) is not a full GPU: an intermediate without a bound grew with
    the input — attention materialising the full score matrix without a memory-efficient
    backend, or an image far larger than the encoder was profiled for. No budget fixes it."""
    tried = oom.tried_gib
    if not tried or not total:
        return False
    huge = tried > total or (
        tried >= 0.5 * total and phase not in (Phase.WEIGHT_LOADING, Phase.KV_ALLOCATION)
    )
    if not huge:
        return False
    p = s.parsed
    free = oom.free_gib
    room = f"{free:.2f} GiB were free" if free is not None else "the GPU's free memory"
    what = (
        f"a single {tried:.2f} GiB allocation on a {total:.2f} GiB GPU"
        f"{' — larger than the whole device' if tried > total else ''} ({room})"
    )
    backend = Fix(
        "action",
        "check the attention backend in the start-up log: install flash-attn (or use a "
        "backend with memory-efficient attention instead of an eager/SDPA-math fallback) "
        "and bound the input size",
        f"{what}: an attention score matrix or another intermediate that grows with the input "
        "length squared, not a budget that is slightly too large",
        STEP_ACTION,
    )
    mm = p.has("failing_in_mm_encoder") or (
        phase == Phase.PROFILING and (p.has("mm_encoder_profile") or p.has("mm_encoder_frames"))
    )
    # a vision-language model whose failing step is not known: its unbounded input is the
    # images (patches × images per prompt), which the encoder attends over in one batch
    mm_model = not mm and phase in (None, Phase.PROFILING, Phase.SERVING) and is_multimodal_model(s)
    if mm or mm_model:
        out.add(
            "multimodal_encoder",
            0.85 if mm else 0.7,
            f"the vision/audio encoder asked for {tried:.2f} GiB at once: an unbounded "
            "intermediate for an oversized input",
            [oom.evidence, p.evidence("failing_in_mm_encoder") or p.evidence("mm_encoder_frames")],
            [
                backend,
                Fix(
                    "--mm-processor-kwargs",
                    '{"max_pixels": 1003520}',
                    "bounds the image size the encoder sees (Qwen-VL style processors; other "
                    "models: resize images before sending them)",
                    STEP_MULTIMODAL,
                ),
                Fix(
                    "--limit-mm-per-prompt",
                    '{"image": 1}',
                    "one image per prompt in the encoder's batch",
                    STEP_MULTIMODAL + 0.1,
                ),
            ],
            "The encoder's attention over all patches of a very large image (or many images) "
            "without a memory-efficient kernel needs memory quadratic in the patch count.",
        )
        return True
    out.add(
        "other",
        0.85,
        f"{what}: an unbounded intermediate, not a full GPU",
        [oom.evidence],
        [
            backend,
            Fix(
                "--max-num-batched-tokens",
                "2048",
                "bounds the tokens one forward pass processes (with chunked prefill), so a "
                "long prompt cannot create one giant intermediate",
                STEP_BATCHED_TOKENS,
            ),
        ],
        "No setting of gpu_memory_utilization makes an allocation larger than the GPU fit: the "
        "size comes from a code path whose memory grows with the input (eager attention on "
        "long inputs, a missing flash-attention backend, a huge image).",
    )
    return True


def _runtime_oom(s: Situation, out: Findings, oom: Any, total: float | None) -> None:
    """An OOM while serving, graded by the measured headroom.

    vLLM's budget (utilization × total) is allocated at start-up; at runtime only what lives
    outside it still grows: CUDA graphs, non-torch memory (NCCL, CUDA context), multi-step
    scheduling buffers and batches larger than profiled. (1 − util) × total is the headroom
    for all of them. A failed allocation that is small next to what remains of the headroom
    means steady consumers used it up (utilization too high); one that takes most of it is a
    batch spike (too many tokens or sequences at once).
    """
    ev = oom.evidence
    util = s.util
    tried = oom.tried_gib or 0.0
    free = oom.free_gib or 0.0
    short = max(tried - free, 0.0)
    if util is None or not total:
        out.add(
            "concurrency_or_batch",
            0.6,
            "a batch at runtime needed more memory than profiled",
            [ev],
            _runtime_batch_fixes(s),
        )
        return
    headroom = (1 - util) * total
    graphs = oom.private_pools_gib
    graphs_basis = "the OOM report's private pools"
    if graphs is None and not s.get("enforce_eager"):
        graphs = s.get("cudagraph_actual_gib") or s.get("cudagraph_estimate_gib")
        graphs_basis = "the log's CUDA-graph figure"
    graphs = float(graphs or 0.0)
    non_torch = s.get("non_torch_gib")
    non_torch_gib = float(non_torch) if non_torch is not None else 0.5
    args = {**s.parsed.args, **s.context.args}
    steps = _int_or_none(args.get("num_scheduler_steps"))
    multistep = steps is not None and steps > 1
    left = headroom - graphs - non_torch_gib
    spike_ratio = tried / left if left > 0 else float("inf")
    consumers = [f"CUDA graphs {graphs:.2f} GiB ({graphs_basis})"] if graphs else []
    consumers.append(
        f"non-torch memory {non_torch_gib:.2f} GiB"
        + ("" if non_torch is not None else " (typical CUDA context + NCCL, not in the log)")
    )
    if multistep:
        consumers.append(
            f"--num-scheduler-steps {steps}: per-step output buffers for {steps} steps"
        )
    held = _held_gib(oom)
    held_text = f"; the process holds {held:.2f} GiB of {total:.2f}" if held else ""
    setting = (
        f"gpu_memory_utilization {util:g}"
        if s.util_stated
        else f"vLLM's default gpu_memory_utilization {util:g}"
    )
    steady = (
        left <= 0
        or spike_ratio <= 0.25
        or multistep
        or (s.util_stated and util >= 0.95 and spike_ratio < 1.5)
    )
    util_conf = 0.72 if steady else (0.55 if spike_ratio <= 0.5 else 0.35)
    batch_conf = 0.4 if steady else (0.5 if spike_ratio <= 0.5 else 0.62)
    fix_opt = lower_util(
        s,
        max(short, tried, 1.0) if steady else max(short, 0.5),
        "leaves room outside the budget for CUDA graphs, non-torch memory"
        + (", multi-step buffers" if multistep else "")
        + " and runtime allocations",
    )
    out.add(
        "util_overshoot",
        util_conf,
        f"{setting} leaves {headroom:.2f} GiB outside vLLM's "
        f"budget and a {tried:.2f} GiB allocation no longer fit{held_text}",
        [ev],
        [fix_opt] if fix_opt else [],
        f"At runtime the KV pool is already allocated; what still allocates must fit in "
        f"(1 − {util:g}) × {total:.2f} = {headroom:.2f} GiB beside {', '.join(consumers)}. "
        + (
            "The failed allocation is small next to that headroom, so steady consumers "
            "outside the budget had used it up."
            if steady
            else "The failed allocation takes most of what remains: a batch larger than profiled."
            if spike_ratio > 0.5
            else "The failed allocation is a sizeable share of that headroom: steady consumers "
            "and a large batch both contributed."
        ),
    )
    fixes = _runtime_batch_fixes(s)
    if multistep and steps is not None:
        fixes.append(
            Fix(
                "--num-scheduler-steps",
                str(max(steps // 2, 1)),
                f"multi-step scheduling keeps buffers for {steps} steps outside the profiled budget",
                STEP_MAX_NUM_SEQS + 0.2,
            )
        )
    out.add(
        "concurrency_or_batch",
        batch_conf,
        "a batch at runtime needed more memory than profiled"
        if not steady
        else "a burst of long requests may have needed more activation memory",
        [ev],
        fixes,
        "Runtime allocations beyond the profiled peak (long prompts with logprobs, n>1, "
        "multimodal inputs) come out of the memory outside the KV pool.",
    )


def _phaseless_oom(s: Situation, out: Findings, oom: Any, total: float | None) -> None:
    """An OOM whose phase the excerpt does not show: tell weights from activations by what the
    failing traceback ran through, the failed allocation's size against the GPU and the
    weights' size when known (a vLLM process normally holds about util × total, so holding
    most of the GPU alone proves nothing)."""
    p = s.parsed
    ev = oom.evidence
    tried = oom.tried_gib
    util = s.util
    held = _held_gib(oom)
    this_share = held / total if held is not None and total else None
    wt = s.known("weights_total_gib")
    per_gpu = float(wt.value) / s.tp if wt is not None else None
    if p.has("failing_in_mm_encoder"):
        rule_multimodal(s, out, base=0.75, evidence=[ev, p.evidence("failing_in_mm_encoder")])
        return
    if s.util_stated and util is not None and util >= FULL_UTIL:
        fix_full = lower_util(
            s, max(tried or 0.0, 1.0), "headroom for allocations outside the budget"
        )
        out.add(
            "util_overshoot",
            0.65,
            f"gpu_memory_utilization {util:g} leaves no headroom: any allocation outside "
            "vLLM's budget fails",
            [ev],
            [fix_full] if fix_full else [],
            "At utilization ≥ 0.98 vLLM hands (almost) the whole GPU to weights, the profiled "
            "activations and the KV cache; CUDA graphs, an encoder's or sampler's buffers and "
            "runtime allocations have nowhere to go.",
        )
    activation_frames = p.has("failing_in_activation")
    batch_sized = bool(
        tried and total and tried >= max(BATCH_SIZED_SHARE * total, BATCH_SIZED_MIN_GIB)
    )
    weights_fill = per_gpu is not None and total is not None and per_gpu >= 0.85 * total
    if (activation_frames or batch_sized) and not weights_fill:
        reasons = []
        if batch_sized and tried and total:
            reasons.append(
                f"the failed allocation ({tried:.2f} GiB, {tried / total:.0%} of the GPU) is "
                "batch-sized, larger than any weight tensor"
            )
        if activation_frames:
            frame = p.evidence("failing_in_activation")
            reasons.append(
                "the failing traceback runs through "
                + (f"`{frame.text[:80]}`" if frame else "an activation op")
            )
        if per_gpu is not None and total:
            reasons.append(f"the weights (~{per_gpu:.1f} GiB per GPU) fit in {total:.1f} GiB")
        out.add(
            "concurrency_or_batch",
            0.6 if (batch_sized and activation_frames) or per_gpu is not None else 0.55,
            "a batch's activations did not fit: " + "; ".join(reasons),
            [ev, p.evidence("failing_in_activation")],
            activation_fixes(s, "the activation peak grows with the tokens per batch"),
            "Activation memory (attention, MLP intermediates, logits) scales with the tokens "
            "in one forward pass: the profiling batch or the largest prefill."
            + (
                " In V0 without chunked prefill that is a whole max_model_len prompt."
                if v0_profiles_full_length(s)
                else ""
            ),
        )
        if this_share is not None and this_share >= 0.9 and per_gpu is None:
            out.add("weights_dont_fit", 0.3, "weights plus buffers may exceed the GPU", [ev])
        return
    if this_share is not None and this_share >= 0.9:
        if per_gpu is not None and total:
            if weights_fill:
                _weights_finding(s, out, [ev], 0.8)
            elif per_gpu < 0.6 * total:
                budget = (util or 0.9) * total
                out.add(
                    "other",
                    0.55,
                    f"PyTorch holds {this_share:.0%} of the GPU although the weights "
                    f"need ~{per_gpu:.1f} GiB and vLLM's budget is {budget:.1f} GiB",
                    [ev],
                    [
                        Fix(
                            "action",
                            "compare with the previous vLLM release (possible regression) "
                            "and report it",
                            "the configuration does not explain the allocation",
                            STEP_ACTION,
                        )
                    ],
                    "vLLM's own accounting caps what it allocates at utilization × total; "
                    "allocations beyond it, with weights that fit, are not a configuration error.",
                )
                out.add("weights_dont_fit", 0.25, "weights plus buffers may exceed the GPU", [ev])
            else:
                _weights_finding(s, out, [ev], 0.55)
        else:
            # a small allocation failing with the process at the GPU's size: creating or
            # loading parameters is the usual way there without a phase marker
            _weights_finding(s, out, [ev], 0.45)
            fix_opt = lower_util(s, 1.0, "headroom outside the budget")
            out.add(
                "util_overshoot",
                0.3,
                "vLLM's budget left too little headroom",
                [ev],
                [fix_opt] if fix_opt else [],
            )
    elif s.util_stated and util is not None and util >= 0.95:
        fix_opt = lower_util(s, 1.0, "headroom for memory outside the budget")
        out.add(
            "util_overshoot",
            0.6,
            f"gpu_memory_utilization {util:g} leaves almost no headroom",
            [ev],
            [fix_opt] if fix_opt else [],
        )
    else:
        fix_opt = lower_util(
            s, max((tried or 0) - (oom.free_gib or 0), 0.5), "headroom outside the budget"
        )
        out.add(
            "util_overshoot",
            0.3,
            "the GPU was full when PyTorch needed more",
            [ev],
            [fix_opt] if fix_opt else [],
        )
        out.add(
            "concurrency_or_batch",
            0.25,
            "a large batch may have needed more activation memory",
            [ev],
            _runtime_batch_fixes(s),
        )


_VLM_NAME_WORDS = (
    "-vl",
    "vl-",
    "_vl",
    "vision",
    "llava",
    "internvl",
    "minicpm-v",
    "minicpm-o",
    "pixtral",
    "idefics",
    "paligemma",
    "mllama",
    "molmo",
    "phi-3-vision",
    "phi-3.5-vision",
    "gemma-3-",
    "qwen2-vl",
    "qwen2.5-vl",
    "glm-4v",
    "cogvlm",
    "deepseek-vl",
    "kimi-vl",
    "omni",
)


def is_multimodal_model(s: Situation) -> bool:
    """Whether the model (the resolved spec, else its name) takes images/audio."""
    spec = s.model_spec
    if spec is not None and getattr(spec, "vision", None) is not None:
        return True
    for args in (s.parsed.args, s.context.args):
        # per-prompt limits or processor settings for images are stated for a multimodal model
        if any(args.get(k) for k in ("limit_mm_per_prompt", "mm_processor_kwargs")):
            return True
    name = str(s.get("model") or "").lower()
    return bool(name) and any(word in name for word in _VLM_NAME_WORDS)


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def v0_profiles_full_length(s: Situation) -> bool:
    """Whether the engine is V0 with chunked prefill off, where the profiling batch (and the
    largest prefill) is max(max_model_len, max_num_batched_tokens) tokens (§3.3)."""
    engine = s.get("engine")
    minor = _version_minor(s)
    v0 = engine == "v0" or (engine is None and 0 < minor < 8)
    if not v0:
        return False
    args = {**s.parsed.args, **s.context.args}
    chunked = s.parsed.has("chunked_prefill_on") or str(
        args.get("enable_chunked_prefill", "")
    ).lower() in ("true", "1")
    return not chunked


def v0_max_model_len_fix(s: Situation) -> Fix:
    """``--max-model-len`` that shrinks V0's profiling batch: the length in force (the log,
    the command, else the model's default) × free ÷ tried of the failed allocation, down to a
    power of two, never below V0's 2048-token floor."""
    known = s.known("max_model_len")
    length = int(known.value) if known is not None else None
    basis = "the length in force"
    if length is None and s.model_spec is not None:
        length = int(getattr(s.model_spec, "derived_max_model_len", 0) or 0) or None
        basis = "the model's default context"
    batched = s.get("max_num_batched_tokens")
    tokens = max(length or 0, int(batched or 0)) or None
    fraction = oom_fit_fraction(s)
    head = (
        "V0 without chunked prefill profiles (and prefills) one batch of "
        "max(max_model_len, max_num_batched_tokens) tokens; its activation peak grows with it"
    )
    if length and tokens and fraction is not None:
        target = max(power_of_two_at_most(int(tokens * fraction)), 2048)
        if target < length:
            return Fix(
                "--max-model-len",
                str(target),
                f"{head}: {tokens:,} tokens ({basis}) × {fraction:.2f} (free ÷ tried of the "
                f"failed allocation) = {tokens * fraction:,.0f}, rounded down to {target:,}",
                STEP_MAX_MODEL_LEN,
            )
    if length and length > 2048:
        target = max(power_of_two_at_most(length // 2), 2048)
        return Fix(
            "--max-model-len",
            str(target),
            f"{head}: half of {length:,} ({basis}) as a first step; the log does not give the "
            "numbers to size it",
            STEP_MAX_MODEL_LEN,
        )
    return Fix(
        "--max-model-len",
        "8192",
        f"{head}, and max_model_len defaults to the model's full context; 8192 is a first "
        "step (the log states neither the length nor the model): cap it to the real P99 "
        "prompt + output length",
        STEP_MAX_MODEL_LEN,
    )


def activation_fixes(s: Situation, what: str) -> list[Fix]:
    """Fixes for an activation peak (a batch's intermediate tensors) that did not fit: in V0
    without chunked prefill the length first, then the tokens and sequences per batch."""
    seqs = s.get("max_num_seqs")
    fixes: list[Fix] = []
    if v0_profiles_full_length(s):
        fixes.append(v0_max_model_len_fix(s))
        fixes.append(
            Fix(
                "--enable-chunked-prefill",
                None,
                "profiles and prefills max_num_batched_tokens per step instead of a whole "
                "max_model_len prompt",
                STEP_BATCHED_TOKENS,
            )
        )
    else:
        fixes.append(
            batched_tokens_fix(
                s, oom_fit_fraction(s), what, 2048, "free ÷ tried of the failed allocation"
            )
        )
    fixes.append(
        Fix(
            "--max-num-seqs",
            str(fewer_seqs(int(seqs) if seqs else default_max_num_seqs(s))),
            "fewer sequences in the batch and its sampler logits",
            STEP_MAX_NUM_SEQS,
        )
    )
    return fixes


def _maybe_weights(
    s: Situation, out: Findings, evidence: list[Evidence | None], confidence: float
) -> None:
    wt = s.known("weights_total_gib")
    total = s.total_gib
    if wt is not None and total and float(wt.value) / s.tp >= 0.8 * total:
        _weights_finding(s, out, evidence, confidence + 0.3)


def _runtime_batch_fixes(s: Situation) -> list[Fix]:
    seqs = s.get("max_num_seqs")
    fixes = [
        Fix(
            "--max-num-seqs",
            str(fewer_seqs(int(seqs) if seqs else default_max_num_seqs(s), factor=2)),
            "fewer sequences in flight per step",
            STEP_MAX_NUM_SEQS,
        ),
        batched_tokens_fix(
            s,
            oom_fit_fraction(s),
            "smaller prefill chunks cap the activation peak",
            4096,
            "free ÷ tried of the failed allocation",
        ),
    ]
    return fixes


def rule_truncated(s: Situation, out: Findings) -> None:
    """A traceback cut before its exception line: the phase is all we have."""
    p = s.parsed
    if not p.has("truncated_traceback") or p.ooms or out.by_cause:
        return
    fp = p.failure_phase
    if p.has("failing_in_mm_encoder") and (fp is None or fp.value == Phase.PROFILING):
        # the excerpt ends inside a vision/audio encoder: its worst-case profiling run
        rule_multimodal(s, out, base=0.65, evidence=[p.evidence("failing_in_mm_encoder")])
        return
    if fp is None:
        return
    if fp.value == Phase.PROFILING and (p.has("mm_encoder_profile") or p.has("mm_encoder_frames")):
        rule_multimodal(s, out, base=0.65, evidence=[fp.evidence])
    elif fp.value == Phase.PROFILING:
        out.add(
            "concurrency_or_batch",
            0.35,
            "start-up failed in the profiling run",
            [fp.evidence],
            [Fix("--max-num-seqs", "256", "smaller profiling batch", STEP_MAX_NUM_SEQS)],
        )
    elif fp.value == Phase.WEIGHT_LOADING:
        _weights_finding(s, out, [fp.evidence], 0.45)
    elif fp.value == Phase.CUDA_GRAPH_CAPTURE:
        out.add(
            "cuda_graph",
            0.45,
            "start-up failed while capturing CUDA graphs",
            [fp.evidence],
            [Fix("--enforce-eager", None, "skip graph capture", STEP_CUDAGRAPH)],
        )
    elif fp.value == Phase.KV_ALLOCATION and not p.has("kv_too_small"):
        # the traceback ends inside allocating the cache that profiling had just sized: the
        # memory it counted on was gone by then (a trainer or another engine on the GPU), or
        # the budget left nothing beside what runs outside it
        out.add(
            "util_overshoot",
            0.45 if p.has("said_colocated") or p.has("said_other_process") else 0.35,
            "start-up failed allocating the KV cache that profiling had sized",
            [fp.evidence, p.evidence("said_colocated"), p.evidence("said_other_process")],
            [
                lower_util(
                    s,
                    2.0,
                    "leaves room for what else holds the GPU when the cache is allocated",
                )
                or Fix(
                    "--gpu-memory-utilization",
                    "0.7",
                    "a smaller budget leaves room for what else holds the GPU",
                    STEP_UTIL,
                )
            ],
            "vLLM sizes the KV cache from utilization × total minus what it measured, then "
            "allocates it; anything that takes GPU memory in between (a trainer's step, another "
            "engine starting) makes that allocation fail.",
        )


def _kv_bytes_for_max_len(s: Situation) -> int | None:
    """KV bytes one max_model_len request needs, from the memory model when the model resolves."""
    if s.model_spec is None:
        return None
    try:
        from oomguard.facts.gpus import custom_gpu
        from oomguard.memory.engine import EngineSettings, predict

        settings = EngineSettings(
            platform="cpu" if s.get("platform") == "cpu" else "cuda",
            max_model_len=s.get("max_model_len"),
            kv_cache_memory_bytes=2**30,
            enforce_eager=True,
        )
        return int(
            predict(
                s.model_spec, custom_gpu(float(s.total_gib or 64.0)), settings, strict=False
            ).needed_bytes_for_max_len
        )
    except Exception:  # the fallback value in the fix is used
        return None


def _version_minor(s: Situation) -> int:
    import re

    version = s.get("vllm_version")
    if not version:
        return 0
    m = re.match(r"v?0\.(\d+)", str(version))
    return int(m.group(1)) if m else 0


# the memory of the GPU most deployments top out at (an 80 GB card, in GiB): weights per GPU
# above it do not fit whichever GPU a log without a device name ran on, bar the few larger ones
COMMON_LARGEST_GPU_GIB = 79.0


def rule_weights_exceed_gpu(s: Situation, out: Findings) -> None:
    """A CUDA OOM where the weights per GPU alone are the whole GPU or more: whatever else
    the log shows (other processes, a full cache), the model cannot fit at this parallelism,
    so the weights outrank every other cause; with no GPU named, weights beyond an 80 GB card
    are still the likeliest cause."""
    p = s.parsed
    wt = s.known("weights_total_gib")
    if not p.ooms or wt is None:
        return
    pp = int(s.get("pipeline_parallel_size") or 1)
    per_gpu = float(wt.value) / (s.tp * max(pp, 1))
    total = s.total_gib
    ev = p.ooms[0].evidence
    measured = wt.origin == "log"
    if not measured and _loaded_past_weights(s):
        # weights as large as the GPU could not have loaded: the log contradicts an estimate
        # made from the model's name (a quantized or differently sized checkpoint)
        return
    if total:
        if per_gpu >= 0.95 * total:
            # the log's own weight figure is a measurement; one from the name is an estimate
            _weights_finding(s, out, [ev], 0.9 if measured else 0.85)
    elif per_gpu >= COMMON_LARGEST_GPU_GIB:
        _weights_finding(s, out, [ev], 0.6)


def _loaded_past_weights(s: Situation) -> bool:
    """Whether the failure came after the weights were on the GPU: its phase (a log line or a
    traceback frame) is profiling, KV allocation, warm-up, capture or serving."""
    failed = s.parsed.failure_phase
    return failed is not None and failed.value.rank > Phase.WEIGHT_LOADING.rank


RULES: tuple[Callable[[Situation, Findings], None], ...] = (
    rule_startup_check,
    rule_kv_too_small,
    rule_no_cache_blocks,
    rule_cpu_kv_allocation,
    rule_mamba,
    rule_sampler,
    rule_cudagraph,
    rule_weight_load_oom,
    rule_profiling_free_increase,
    rule_sleep_expandable,
    rule_shm_exhausted,
    rule_wsl_resident,
    rule_host_memory,
    rule_leak,
    rule_listed_processes,
    rule_torch_oom,
    rule_weights_exceed_gpu,
    rule_truncated,
)


def never_expandable_with_sleep(s: Situation, findings: list[Finding]) -> None:
    """The trap: expandable_segments breaks sleep mode's memory pool — never advise it for the
    engine then (an action naming another process, such as a co-located trainer, stays)."""
    if not s.sleep_mode:
        return
    for finding in findings:
        finding.fixes = [
            f
            for f in finding.fixes
            if f.flag == "action" or "expandable_segments:True" not in str(f.value)
        ]


def apply_rules(s: Situation) -> list[Finding]:
    """Run every rule and return the findings, best first, with the sleep-mode trap applied."""
    out = Findings()
    for rule in RULES:
        rule(s, out)
    # prose reuses this module's fix builders
    from oomguard.doctor.prose import rule_prose, rule_tried_in_vain

    rule_prose(s, out)
    rule_tried_in_vain(s, out)
    for finding in out.by_cause.values():
        finding.confidence = min(max(finding.confidence, 0.05), 0.97)
    ranked = out.ranked()
    never_expandable_with_sleep(s, ranked)
    return ranked
