"""Check a ``vllm serve`` command before launch against the seeds' "what not to do" list."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from oomguard.doctor.findings import (
    STEP_ACTION,
    STEP_MAX_MODEL_LEN,
    STEP_MAX_NUM_SEQS,
    STEP_UTIL,
    Finding,
    Fix,
)
from oomguard.doctor.situation import GIB, floor2, power_of_two_at_most
from oomguard.errors import BadInput
from oomguard.logs.parsed import Evidence


@dataclass(frozen=True)
class Workload:
    """What the deployment will see: P99 prompt+output tokens, peak concurrency, prefixes."""

    p99_tokens: int | None = None
    concurrency: int | None = None
    shared_prefix: bool | None = None
    cotenant_gib: float = 0.0  # memory another workload on the same GPU needs


def lint_command(
    command: str, *, gpu: str | None = None, workload: Workload | None = None
) -> list[Finding]:
    """Findings for a command line (empty when nothing is wrong).

    Uses the memory model for the KV-capacity checks when the model and GPU resolve offline;
    the other checks need only the command. Raises :class:`BadInput` for an unreadable command.
    """
    from oomguard.vllm_args import parse_command

    workload = workload or Workload()
    parsed = parse_command(command)
    args: dict[str, Any] = dict(parsed.settings_kwargs)
    line = Evidence.of(0, command)
    findings: list[Finding] = []
    util = args.get("gpu_memory_utilization")

    if util is not None and util >= 0.98:
        findings.append(
            Finding(
                "util_overshoot",
                0.9,
                f"gpu_memory_utilization {util:g} leaves no headroom",
                [line],
                [
                    Fix(
                        "--gpu-memory-utilization",
                        "0.90",
                        "CUDA context, NCCL, graphs and runtime spikes "
                        "live outside vLLM's budget; at ≥ 0.98 the OOM killer does the capacity planning",
                        STEP_UTIL,
                    )
                ],
                "Do not set gpu_memory_utilization to 1.0: the budget is a fraction of the whole GPU and "
                "what vLLM does not account for needs the rest.",
            )
        )

    prediction, spec, gpu_spec = _predict(parsed, gpu)
    if workload.cotenant_gib > 0:
        total = gpu_spec.total_bytes / GIB if gpu_spec is not None else None
        effective = (
            util
            if util is not None
            else (prediction.settings.gpu_memory_utilization if prediction else 0.9)
        )
        if total is not None and effective * total + workload.cotenant_gib > total - 0.25:
            new = floor2((total - workload.cotenant_gib - 0.5) / total)
            findings.append(
                Finding(
                    "util_overshoot",
                    0.85,
                    f"a co-tenant needing {workload.cotenant_gib:g} GiB is not budgeted",
                    [line],
                    [
                        Fix(
                            "--gpu-memory-utilization",
                            f"{new:.2f}",
                            f"{effective:g} × {total:.1f} GiB + "
                            f"{workload.cotenant_gib:g} GiB exceeds the GPU",
                            STEP_UTIL,
                        )
                    ],
                    "Do not run vLLM and another CUDA workload on one GPU with default settings: budget both.",
                )
            )
        elif total is None:
            findings.append(
                Finding(
                    "util_overshoot",
                    0.4,
                    "a co-tenant is expected: budget it",
                    [line],
                    [
                        Fix(
                            "--gpu-memory-utilization",
                            None,
                            "lower it by co-tenant GiB ÷ GPU total",
                            STEP_UTIL,
                        )
                    ],
                )
            )

    max_len = args.get("max_model_len")
    derived = spec.derived_max_model_len if spec is not None else None
    p99 = workload.p99_tokens
    if p99:
        at_max = max_len is None or max_len == -1 or (derived is not None and max_len >= derived)
        if (at_max or (max_len is not None and max_len > 2 * p99)) and (
            derived is None or p99 < derived
        ):
            target = int(math.ceil(p99 * 1.1 / 256) * 256)
            shown = (
                f"{max_len:,}"
                if max_len and max_len > 0
                else (f"the model maximum ({derived:,})" if derived else "the model maximum")
            )
            findings.append(
                Finding(
                    "kv_too_small_for_max_len",
                    0.8,
                    f"max_model_len is {shown} while the P99 request is {p99:,} tokens",
                    [line],
                    [
                        Fix(
                            "--max-model-len",
                            str(target),
                            f"covers the P99 ({p99:,}) with 10 % margin; every "
                            "sequence slot is sized for max_model_len",
                            STEP_MAX_MODEL_LEN,
                        )
                    ],
                    "Do not keep max_model_len at the model's maximum: you pay for that context in KV cache.",
                )
            )

    if prediction is not None:
        per_request = p99 or prediction.settings.max_model_len or 1
        capacity = prediction.kv_cache_tokens / per_request if per_request else 0.0
        seqs = prediction.settings.max_num_seqs or 0
        if not prediction.fits:
            problems = "; ".join(p.message for p in prediction.problems) or "does not fit"
            findings.append(
                Finding(
                    "kv_too_small_for_max_len",
                    0.85,
                    f"this configuration will not start: {problems}",
                    [line],
                    [],
                )
            )
        elif capacity >= 1 and seqs > 4 * capacity:
            target = max(power_of_two_at_most(int(capacity)), 1)
            if workload.concurrency:
                target = min(max(workload.concurrency, 1), max(int(capacity), 1))
            findings.append(
                Finding(
                    "concurrency_or_batch",
                    0.75,
                    f"max_num_seqs {seqs} is far above the ~{capacity:.0f} requests of {per_request:,} tokens the KV cache holds",
                    [line],
                    [
                        Fix(
                            "--max-num-seqs",
                            str(target),
                            f"the KV cache holds {prediction.kv_cache_tokens:,} tokens "
                            f"= {capacity:.1f} × {per_request:,}",
                            STEP_MAX_NUM_SEQS,
                        )
                    ],
                    "Do not let max_num_seqs exceed what the GPU can host: the first burst near the limit "
                    "preempts or drops the server.",
                )
            )

    prefix = args.get("enable_prefix_caching")
    if prefix and workload.shared_prefix is not True:
        findings.append(
            Finding(
                "other",
                0.5 if workload.shared_prefix is None else 0.7,
                "prefix caching is on but the prompts are not known to share prefixes",
                [line],
                [
                    Fix(
                        "--no-enable-prefix-caching",
                        None,
                        "without shared prefixes (hit rate < 30 %) it only "
                        "holds memory; keep it if the prompts share a system prompt or documents",
                        STEP_ACTION + 5,
                    )
                ],
            )
        )

    text = command.lower()
    if "expandable_segments:true" in text and (
        "enable-sleep-mode" in text or "enable_sleep_mode" in text
    ):
        findings.append(
            Finding(
                "other",
                0.9,
                "expandable_segments is set together with sleep mode",
                [line],
                [
                    Fix(
                        "PYTORCH_CUDA_ALLOC_CONF",
                        "(unset)",
                        "sleep mode's memory pool rejects expandable segments",
                        STEP_ACTION,
                    )
                ],
            )
        )
    return sorted(findings, key=lambda f: -f.confidence)


def _predict(parsed: Any, gpu: str | None) -> tuple[Any, Any, Any]:
    """Memory-model prediction for the command, or (None, spec, gpu) when facts are missing."""
    spec = gpu_spec = None
    try:
        from oomguard.facts.resolve import resolve_model_with_quantization

        spec = resolve_model_with_quantization(
            parsed.model, parsed.settings_kwargs.get("quantization"), allow_hub=False
        )
    except BadInput:
        spec = None
    except Exception:  # the facts layer may be incomplete; lint still runs its other checks
        spec = None
    if gpu:
        try:
            from oomguard.facts.gpus import find_gpu

            gpu_spec = find_gpu(gpu)
        except Exception:  # unknown GPU: the KV checks are skipped, the rest still run
            gpu_spec = None
    if spec is None or gpu_spec is None:
        return None, spec, gpu_spec
    try:
        from oomguard.memory.engine import predict

        return predict(spec, gpu_spec, parsed.settings(), strict=False), spec, gpu_spec
    except Exception:  # a configuration the model rejects is reported by `oomguard plan`
        return None, spec, gpu_spec
