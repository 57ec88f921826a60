"""Entry points: a parsed log (plus what the user knows) → a :class:`Diagnosis`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from oomguard.doctor.findings import Diagnosis, Finding
from oomguard.doctor.rules import apply_rules
from oomguard.doctor.situation import GIB, Context, Situation, build_situation
from oomguard.logs import ParsedLog, parse_file

_FLAG_TO_SETTING = {
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--max-model-len": ("max_model_len", int),
    "--max-num-seqs": ("max_num_seqs", int),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--quantization": ("quantization", str),
}


def diagnose(parsed: ParsedLog, context: Context | None = None) -> Diagnosis:
    """Name the root causes of the memory failure in ``parsed``, best first, with fixes.

    ``context`` carries what the log may lack (model, GPU, the original command line). When
    the log shows no memory failure the diagnosis has ``oom_found=False`` and no findings.
    """
    context = context or Context()
    situation = build_situation(parsed, context)
    failed = parsed.shows_failure or (
        parsed.has("truncated_traceback")
        and (parsed.failure_phase is not None or parsed.has("failing_in_mm_encoder"))
    )
    findings = apply_rules(situation) if failed else []
    derived = _derived(situation)
    plan = _resulting_plan(situation, findings[0]) if findings else None
    return Diagnosis(
        findings=findings, parsed=parsed, derived=derived, plan=plan, oom_found=bool(findings)
    )


def diagnose_file(path: str | Path, context: Context | None = None) -> Diagnosis:
    """Parse the log at ``path`` (``-`` for stdin) in bounded memory and diagnose it.

    Raises :class:`~oomguard.errors.BadInput` for a missing or unreadable file.
    """
    return diagnose(parse_file(path), context)


def _derived(s: Situation) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in (
        "model",
        "gpu_name",
        "gpu_total_gib",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "weights_per_gpu_gib",
        "weights_total_gib",
        "max_model_len",
        "max_num_seqs",
        "vllm_version",
        "engine",
    ):
        known = s.known(name)
        if known is None:
            continue
        value = round(known.value, 3) if isinstance(known.value, float) else known.value
        out[name] = {"value": value, "from": known.origin}
    out["block_size"] = s.block_size
    out["sleep_mode"] = s.sleep_mode
    return out


def _resulting_plan(s: Situation, top: Finding) -> dict[str, Any] | None:
    """Predict vLLM's start-up numbers with the top finding's fixes applied, when the model and
    GPU are known and the memory model is importable; log measurements replace estimates."""
    if s.model_spec is None or not s.total_gib:
        return None
    try:
        from oomguard.facts.gpus import custom_gpu
        from oomguard.memory.engine import EngineSettings, MeasuredTerms, predict
    except ImportError:
        return None
    settings_kwargs: dict[str, Any] = {"engine": str(s.get("engine") or "v1")}
    for name in (
        "tensor_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "kv_cache_dtype",
        "quantization",
    ):
        known = s.known(name)
        if known is not None and (
            known.origin in ("log", "command") or name == "gpu_memory_utilization"
        ):
            settings_kwargs[name] = known.value
    if s.get("enforce_eager"):
        settings_kwargs["enforce_eager"] = True
    before = dict(settings_kwargs)
    applied: list[str] = []
    for fix in top.ordered_fixes():
        spec = _FLAG_TO_SETTING.get(fix.flag)
        if fix.flag == "--enforce-eager":
            settings_kwargs["enforce_eager"] = True
            applied.append("--enforce-eager")
            break
        if spec is None or fix.value is None:
            continue
        try:
            settings_kwargs[spec[0]] = spec[1](fix.value)
        except ValueError:
            continue
        applied.append(fix.as_text)
        break  # the first applicable fix: the plan shows its effect
    version = s.get("vllm_version")
    if version:
        settings_kwargs["vllm_version"] = str(version)
    measured = MeasuredTerms(
        weights_bytes=_bytes(s.get("weights_gib")),
        activation_bytes=_bytes(s.get("activation_gib")),
        non_torch_bytes=_bytes(s.get("non_torch_gib")),
        cudagraph_bytes=_bytes(s.get("cudagraph_estimate_gib") or s.get("cudagraph_actual_gib")),
        source="log",
    )
    gpu = s.gpu_spec or custom_gpu(
        float(s.total_gib), name=str(s.get("gpu_name") or "GPU from the log")
    )
    logged_kv = s.get("available_kv_gib")
    if logged_kv is None:
        logged_kv = s.get("kv_available_gib")
    if s.gpu_spec is not None and abs(s.gpu_spec.total_bytes / GIB - float(s.total_gib)) > 0.5:
        gpu = replace(s.gpu_spec, total_bytes=int(float(s.total_gib) * GIB))
    for keep_version in (True, False):
        attempt = dict(settings_kwargs)
        base = dict(before)
        if not keep_version:
            attempt.pop("vllm_version", None)
            base.pop("vllm_version", None)
        try:
            terms = measured
            if logged_kv is not None and measured.activation_bytes is None:
                # anchor the estimate to the log: the KV budget it stated absorbs the estimates' error
                as_logged = predict(
                    s.model_spec, gpu, EngineSettings(**base), measured=measured, strict=False
                )
                offset = as_logged.kv_cache_bytes - int(float(logged_kv) * GIB)
                terms = replace(
                    measured,
                    activation_bytes=max(as_logged.activation.value_bytes + offset, 0),
                    source="log (activation anchored to the logged KV budget)",
                )
            prediction = predict(
                s.model_spec, gpu, EngineSettings(**attempt), measured=terms, strict=False
            )
        except Exception:  # the plan is a bonus: a model the predictor cannot handle gives none
            continue
        data = prediction.to_dict()
        return {
            "applied": applied,
            "fits": data["fits"],
            "kv_cache_gib": data["memory"]["kv_cache_gib"],
            "kv_cache_tokens": data["kv_cache_tokens"],
            "max_concurrency": data["max_concurrency"],
            "estimated_max_model_len": data["estimated_max_model_len"],
            "memory": data["memory"],
            "measured_terms": data["measured_terms"],
            "problems": data["problems"],
        }
    return None


def _bytes(gib: Any) -> int | None:
    return None if gib is None else int(float(gib) * GIB)
