"""The facts the calibrated ranking reads: a flat, named view of a Situation and the verdicts.

Every feature is a general fact about the failure — a message vLLM or PyTorch printed, the
phase that failed, a setting, a ratio of the memory figures, a cue in the reporter's words —
named so that the shipped weights can be read (``oomguard/doctor/data/cause_model.json``).
Binary facts are 1.0 when present and absent otherwise; ratios are clipped to [0, 1].
"""

from __future__ import annotations

from oomguard.doctor.mechanisms import Verdict
from oomguard.doctor.situation import Situation
from oomguard.logs.parsed import OomEvent

# words in a model name that mark a vision/audio-language model
_MULTIMODAL_NAME_WORDS = (
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
    "qwen2-vl",
    "glm-4v",
    "cogvlm",
    "omni",
    "ocr",
    "whisper",
    "audio",
)
_QUANTIZED_NAME_WORDS = (
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


def _clip(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def extract(s: Situation, verdicts: list[Verdict]) -> dict[str, float]:
    """The feature values of one diagnosis (absent features are zero)."""
    out: dict[str, float] = {}
    _messages(s, out)
    _memory_figures(s, out)
    _settings(s, out)
    for verdict in verdicts:
        out[f"mech:{verdict.mechanism}:{verdict.cause}"] = 1.0
    if verdicts:
        out["mech:any"] = 1.0
    return out


def _messages(s: Situation, out: dict[str, float]) -> None:
    """What was printed: signatures (vLLM's, PyTorch's, the reporter's cues), the phase."""
    p = s.parsed
    for name in p.signatures:
        out[f"sig:{name}"] = 1.0
    phase = p.failure_phase.value.value if p.failure_phase is not None else "none"
    out[f"phase:{phase}"] = 1.0
    reached = p.phase_reached
    out[f"reached:{reached.value if reached is not None else 'none'}"] = 1.0
    for oom in p.ooms[:1]:
        out[f"oom:{oom.kind}"] = 1.0
    if p.oom_count > 1:
        out["oom:several"] = 1.0
    if p.only_said:
        out["only_said"] = 1.0
    if p.errors:
        out["errors"] = 1.0
    if p.gpu_processes:
        out["gpu_processes_listed"] = 1.0
    if p.engine_processes:
        out["engine_processes_listed"] = 1.0


def _memory_figures(s: Situation, out: dict[str, float]) -> None:
    """Ratios of the memory figures: who holds the device, how large the failed request."""
    total = s.get("startup_total_gib") or s.total_gib
    free = s.get("startup_free_gib")
    if total and free is not None:
        out["startup_others_share"] = _clip(1.0 - float(free) / float(total))
    oom = s.parsed.first_oom
    if oom is not None and oom.total_gib:
        _failed_allocation(oom, out)
    weights = s.known("weights_per_gpu_gib")
    if weights is not None and s.total_gib:
        out[f"weights_from:{weights.origin}"] = 1.0
        out["weights_over_total"] = _clip(float(weights.value) / float(s.total_gib))
        if s.util:
            out["weights_over_budget"] = _clip(
                float(weights.value) / (float(s.total_gib) * float(s.util)) / 1.5
            )
    length, capacity = s.get("kv_error_max_model_len"), s.get("kv_capacity_tokens")
    if length and capacity:
        out["kv_capacity_over_len"] = _clip(float(capacity) / float(length))


def _failed_allocation(oom: OomEvent, out: dict[str, float]) -> None:
    """The failed request against the device: its size, who holds the memory, the cache."""
    total = float(oom.total_gib or 0.0)
    others, own = oom.other_processes_gib, oom.own_gib
    if others is not None:
        out["oom_others_share"] = _clip(others / total)
    if own is not None:
        out["oom_own_share"] = _clip(own / total)
        if own >= 0.9 * total:
            out["oom_own:fills_device"] = 1.0
    if oom.free_gib is not None and oom.free_gib < 0.01 * total:
        out["oom_free:none"] = 1.0
    tried = oom.tried_gib
    if tried is None:
        return
    out["oom_tried_share"] = _clip(tried / total)
    # a layer or a small buffer; a batch-sized activation; more than the device holds
    size = (
        "beyond_device"
        if tried > total
        else "large"
        if tried >= 0.1 * total
        else ("medium" if tried >= 0.02 * total else "small")
    )
    out[f"oom_tried:{size}"] = 1.0
    if oom.reserved_unallocated_gib is not None and tried > 0:
        out["oom_spare_over_tried"] = _clip(oom.reserved_unallocated_gib / tried / 4)


def _settings(s: Situation, out: dict[str, float]) -> None:
    """The settings in force and what is known about model and device."""
    util = s.util
    if s.util_stated and util is not None:
        out["util:stated"] = 1.0
        if util >= 0.95:
            out["util:full"] = 1.0
        if util <= 0.6:
            out["util:shared"] = 1.0
    if s.tp > 1:
        out["tensor_parallel"] = 1.0
    engine = s.get("engine")
    if engine:
        out[f"engine:{engine}"] = 1.0
    if s.get("platform") == "cpu":
        out["platform:cpu"] = 1.0
    if s.get("enforce_eager"):
        out["enforce_eager"] = 1.0
    length = s.get("max_model_len")
    if length and s.known("max_model_len") is not None and int(length) >= 32768:
        out["max_model_len:long"] = 1.0
    seqs = s.get("max_num_seqs")
    if seqs and int(seqs) >= 512:
        out["max_num_seqs:many"] = 1.0
    total = s.total_gib or (s.parsed.first_oom.total_gib if s.parsed.first_oom else None)
    if total:
        out[
            "gpu:small"
            if float(total) <= 16.5
            else "gpu:large"
            if float(total) >= 70
            else "gpu:medium"
        ] = 1.0
    name = str(s.get("model") or "").lower()
    if name:
        out["model:named"] = 1.0
        if any(word in name for word in _MULTIMODAL_NAME_WORDS) or _has_vision(s):
            out["model:multimodal"] = 1.0
        if any(word in name for word in _QUANTIZED_NAME_WORDS) or s.get("quantization"):
            out["model:quantized"] = 1.0
    if s.sleep_mode:
        out["sleep_mode"] = 1.0
    if s.get("cpu_offload_gib"):
        out["cpu_offload"] = 1.0
    if s.context.args.get("kv_cache_memory_bytes") or s.parsed.args.get("kv_cache_memory_bytes"):
        out["kv_cache_memory_bytes"] = 1.0


def _has_vision(s: Situation) -> bool:
    spec = s.model_spec
    if spec is not None and getattr(spec, "vision", None) is not None:
        return True
    args = {**s.parsed.args, **s.context.args}
    return any(args.get(k) for k in ("limit_mm_per_prompt", "mm_processor_kwargs"))
