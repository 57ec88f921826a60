"""Fixes for weights that do not fit: a quantized checkpoint or more GPUs, sized by the memory
model (the per-GPU weights of each option come from the model's config, not a rule of thumb,
whenever the model is catalogued)."""

from __future__ import annotations

from typing import Any

from oomguard.doctor.findings import Fix
from oomguard.doctor.situation import GIB, Situation

# the weights may take this share of the per-GPU budget: the rest is activations and KV cache
WEIGHTS_SHARE = 0.8
_INT4_ORDER = ("awq", "gptq", "compressed-tensors", "bitsandbytes")
_QUANTIZED_WORDS = (
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


def rank_weights_gib(spec: Any, tp: int, quantization: str | None = None) -> float | None:
    """Weights on one tensor-parallel rank by the memory model (None when it cannot price it)."""
    if spec is None:
        return None
    try:
        from oomguard.memory.weights import resolve_model_dtype, weight_bytes_per_stage

        dtype = resolve_model_dtype(spec, "auto")
        per_stage = weight_bytes_per_stage(
            spec, model_dtype=dtype, tp=tp, quantization=quantization
        )
        return float(per_stage.max_bytes) / GIB
    except Exception:  # an exotic format the weight model does not price
        return None


def valid_tp(spec: Any, tp: int) -> bool:
    """Whether vLLM accepts ``tp`` for the model (the heads divide evenly)."""
    if spec is None:
        return True
    if spec.num_attention_heads % tp:
        return False
    kv = spec.num_kv_heads
    return not kv or kv % tp == 0 or tp % kv == 0


def already_quantized(s: Situation) -> bool:
    """Whether the model already runs quantized (its config, the flag, or its name)."""
    if s.model_spec is not None and s.model_spec.quant.method:
        return True
    text = f"{s.get('model') or ''} {s.get('quantization') or ''}".lower()
    return any(word in text for word in _QUANTIZED_WORDS)


def catalogued_int4(s: Situation) -> tuple[str, Any] | None:
    """The catalogue's preferred ≤ 4-bit checkpoint of the model and its spec (never invented)."""
    try:
        from oomguard.errors import OomguardError
        from oomguard.facts import known_quantized_variants, resolve_model
    except ImportError:
        return None
    names = [str(n) for n in (s.get("model"), getattr(s.model_spec, "name", None)) if n]
    for name in dict.fromkeys(names):
        try:
            variants = [v for v in known_quantized_variants(name) if v[1].weight_bits <= 4]
        except OomguardError:
            continue
        ranked = sorted(
            variants,
            key=lambda v: (
                _INT4_ORDER.index(v[1].method) if v[1].method in _INT4_ORDER else 99,
                v[0].lower(),
            ),
        )
        for repo, _quant in ranked:
            try:
                return repo, resolve_model(repo, allow_hub=False)
            except OomguardError:
                continue
    return None


def _quantized_fix(s: Situation, current: float, limit: float) -> Fix | None:
    """Online fp8 when the GPU runs it and it fits, else the catalogue's 4-bit checkpoint."""
    if already_quantized(s):
        return None
    cc = str(getattr(s.gpu_spec, "compute_capability", "") or "")
    fp8_hardware = not cc or _float(cc) >= 8.0
    fp8 = rank_weights_gib(s.model_spec, s.tp, "fp8")
    if fp8_hardware and fp8 is not None and fp8 <= limit:
        return Fix(
            "--quantization",
            "fp8",
            f"online fp8 weights take {fp8:.1f} GiB per GPU instead of {current:.1f} "
            f"(the memory model on the model's config); ≤ {WEIGHTS_SHARE:.0%} of the "
            "budget leaves room for the KV cache",
        )
    variant = catalogued_int4(s)
    if variant is None:
        return None
    repo, spec = variant
    gib = rank_weights_gib(spec, s.tp)
    if gib is None or gib > limit:
        return None
    return Fix(
        "--model",
        repo,
        f"the catalogue's 4-bit checkpoint takes {gib:.1f} GiB per GPU "
        f"instead of {current:.1f} (the memory model on its config)",
    )


def _tp_fix(s: Situation, weights_total_gib: float, limit: float) -> Fix | None:
    """The smallest tensor-parallel size whose per-GPU weights fit the limit."""
    for tp in (2, 4, 8, 16):
        if tp <= s.tp or not valid_tp(s.model_spec, tp):
            continue
        per_rank = rank_weights_gib(s.model_spec, tp, s.get("quantization"))
        basis = "the memory model: layers split, norms replicated"
        if per_rank is None:
            per_rank, basis = weights_total_gib / tp, f"{weights_total_gib:.1f} GiB ÷ {tp}"
        if per_rank <= limit:
            return Fix(
                "--tensor-parallel-size",
                str(tp),
                f"{per_rank:.1f} GiB of weights per GPU ({basis}) leaves room for the "
                "KV cache; needs that many GPUs",
            )
    return None


def weights_fixes(s: Situation, weights_total_gib: float, budget_per_gpu_gib: float) -> list[Fix]:
    """A quantized checkpoint and/or tensor parallelism that leave room for the KV cache.

    The option that keeps one GPU comes first unless the log shows several GPUs in use.
    """
    limit = WEIGHTS_SHARE * budget_per_gpu_gib
    current = weights_total_gib / s.tp
    quantized = _quantized_fix(s, current, limit)
    tp = _tp_fix(s, weights_total_gib, limit)
    several = s.tp > 1 or int(s.get("gpu_count") or 1) > 1
    ordered = [tp, quantized] if several else [quantized, tp]
    return [fix for fix in ordered if fix is not None]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0
