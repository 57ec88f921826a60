"""The memory model's prediction of a restart with a fix applied, anchored to the log.

The log's own measurements (weights, activation peak, non-torch memory, CUDA graphs) replace
the model's estimates; when the log states the KV budget but not the activation peak, the
estimate is shifted so the prediction of the failed run reproduces that budget. A prediction
needs the model (catalogue or local config) and the device's total memory; without them there
is none, and the doctor says so rather than guessing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from oomguard.doctor.findings import Fix
from oomguard.doctor.situation import GIB, Situation

# the settings a fix may change, by flag: (EngineSettings field, type)
FLAG_SETTINGS: dict[str, tuple[str, type]] = {
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--max-model-len": ("max_model_len", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--quantization": ("quantization", str),
    "--kv-cache-memory-bytes": ("kv_cache_memory_bytes", int),
}
_SETTING_NAMES = (
    "dtype",  # the model's dtype sets the weights' and (KV dtype auto) the KV cache's bytes
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_dtype",
    "quantization",
)


def current_settings(s: Situation) -> dict[str, Any]:
    """The EngineSettings fields the failed run used, as far as the log and command say."""
    out: dict[str, Any] = {"engine": str(s.get("engine") or "v1")}
    for name in _SETTING_NAMES:
        known = s.known(name)
        if known is not None and (known.stated or name == "gpu_memory_utilization"):
            out[name] = known.value
    if s.get("enforce_eager"):
        out["enforce_eager"] = True
    if s.get("platform") == "cpu":
        out["platform"] = "cpu"
    kv_bytes = s.context.args.get("kv_cache_memory_bytes") or s.parsed.args.get(
        "kv_cache_memory_bytes"
    )
    if kv_bytes:
        try:
            from oomguard.vllm_args import parse_human_int

            out["kv_cache_memory_bytes"] = parse_human_int(str(kv_bytes))
        except Exception:  # an unreadable value: the prediction sizes the pool by utilization
            pass
    version = s.get("vllm_version")
    if version:
        out["vllm_version"] = str(version)
    return out


def apply_fix(settings: dict[str, Any], fix: Fix) -> dict[str, Any] | None:
    """``settings`` with a flag fix applied; None when the fix is not a setting the model knows."""
    out = dict(settings)
    for flag, value in fix.flags().items():
        if flag == "--enforce-eager":
            out["enforce_eager"] = True
            continue
        spec = FLAG_SETTINGS.get(flag)
        if spec is None or value is None:
            return None
        try:
            out[spec[0]] = _human_int(value) if spec[1] is int else spec[1](value)
        except ValueError:
            return None
    return out if fix.is_flag else None


def predict_run(
    s: Situation, settings: dict[str, Any], free_gib: float | None = None, *, anchor: bool = True
) -> Any | None:
    """The memory model's prediction for ``settings`` (a MemoryPrediction), or None when the
    model or the device is unknown or the predictor cannot handle the model. ``anchor=False``
    keeps the estimates as they are (to compare them with the log)."""
    if s.model_spec is None or not s.total_gib:
        return None
    try:
        from oomguard.facts.gpus import custom_gpu
        from oomguard.memory.engine import EngineSettings, predict
    except ImportError:
        return None
    gpu = s.gpu_spec or custom_gpu(float(s.total_gib), name=str(s.get("gpu_name") or "device"))
    if s.gpu_spec is not None and abs(s.gpu_spec.total_bytes / GIB - float(s.total_gib)) > 0.5:
        gpu = replace(s.gpu_spec, total_bytes=int(float(s.total_gib) * GIB))
    free = int(free_gib * GIB) if free_gib is not None else None
    for keep_version in (True, False):
        attempt = dict(settings)
        if not keep_version:
            attempt.pop("vllm_version", None)
        try:
            terms = _anchored_terms(s, gpu, attempt) if anchor else _measured_terms(s)
            return predict(
                s.model_spec,
                gpu,
                EngineSettings(**attempt),
                free_bytes=free,
                measured=terms,
                strict=False,
            )
        except Exception:  # a version string or model the predictor rejects: try without it
            continue
    return None


def _anchored_terms(s: Situation, gpu: Any, settings: dict[str, Any]) -> Any:
    """The log's measured terms; the activation estimate shifted to reproduce a logged KV
    budget when the log states the budget but not the activation peak."""
    from oomguard.memory.engine import EngineSettings, predict

    measured = _measured_terms(s)
    logged_kv = s.get("available_kv_gib")
    if logged_kv is None or measured.activation_bytes is not None:
        return measured
    base = current_settings(s)
    if "vllm_version" not in settings:
        base.pop("vllm_version", None)
    as_logged = predict(s.model_spec, gpu, EngineSettings(**base), measured=measured, strict=False)
    offset = as_logged.kv_cache_bytes - int(float(logged_kv) * GIB)
    return replace(
        measured,
        activation_bytes=max(as_logged.activation.value_bytes + offset, 0),
        source="log (activation anchored to the logged KV budget)",
    )


def _measured_terms(s: Situation) -> Any:
    from oomguard.memory.engine import MeasuredTerms

    return MeasuredTerms(
        weights_bytes=_bytes(s.get("weights_gib")),
        activation_bytes=_bytes(s.get("activation_gib")),
        non_torch_bytes=_bytes(s.get("non_torch_gib")),
        cudagraph_bytes=_bytes(s.get("cudagraph_estimate_gib") or s.get("cudagraph_actual_gib")),
        source="log",
    )


def unaccounted_memory_note(s: Situation) -> str | None:
    """When the log's KV budget is far below what the memory model predicts for the same
    settings, something outside the model holds the difference: say how much."""
    logged = s.get("available_kv_gib")
    total = s.total_gib
    if logged is None or not total:
        return None
    prediction = predict_run(s, current_settings(s), anchor=False)
    if prediction is None:
        return None
    predicted = prediction.kv_cache_bytes / GIB
    gap = predicted - float(logged)
    if gap < max(2.0, 0.1 * float(total)):
        return None
    return (
        f"The memory model predicts {predicted:.1f} GiB of KV cache for these settings; the log "
        f"shows {float(logged):.1f} GiB. About {gap:.1f} GiB are held by something the model "
        "does not see (another process, a leak, adapters or a draft model): a fix sized by the "
        "model alone would overestimate what it frees."
    )


def predicted_outcome(s: Situation, fix: Fix) -> dict[str, Any] | None:
    """What the memory model predicts for a restart with ``fix``: KV cache, tokens, whether
    it starts. None when the fix is not a setting or the model cannot predict this run."""
    settings = apply_fix(current_settings(s), fix)
    if settings is None:
        return None
    prediction = predict_run(s, settings)
    if prediction is None:
        return None
    data = prediction.to_dict()
    return {
        "applied": [fix.as_text],
        "fits": data["fits"],
        "kv_cache_gib": data["memory"]["kv_cache_gib"],
        "kv_cache_tokens": data["kv_cache_tokens"],
        "max_concurrency": data["max_concurrency"],
        "estimated_max_model_len": data["estimated_max_model_len"],
        "memory": data["memory"],
        "measured_terms": data["measured_terms"],
        "problems": data["problems"],
    }


def _human_int(text: str) -> int:
    from oomguard.errors import BadInput
    from oomguard.vllm_args import parse_human_int

    try:
        return parse_human_int(text)
    except BadInput as exc:
        raise ValueError(str(exc)) from None


def _bytes(gib: Any) -> int | None:
    return None if gib is None else int(float(gib) * GIB)
