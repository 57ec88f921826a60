"""Check a ``vllm serve`` command before launch against the seeds' "what not to do" list.

Every KV-capacity statement comes from the memory model's prediction for the command on the
named GPU. vLLM's KV cache is paged: a sequence holds the blocks its tokens use, not
``max_model_len`` of them, so how many sequences the pool serves is its tokens ÷ the
workload's length (the P99 when given, else a typical request), never ÷ ``max_model_len``.

A flag vLLM does not have is an error (:class:`BadInput`, exit code 2) naming the closest real
flag. Findings are ``problem`` (the command will not start, leaves no headroom, or the pool
cannot hold the stated workload: exit code 1) or ``tip`` (worth changing, not wrong — a
max_num_seqs above what the pool serves at the P99, a max_model_len far above it: exit 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomguard.doctor.findings import Finding, Fix
from oomguard.doctor.situation import floor2
from oomguard.errors import BadInput
from oomguard.logs.parsed import Evidence
from oomguard.units import GIB
from oomguard.workload import Workload

NO_HEADROOM_UTIL = 0.98
# without a P99, sequences are priced at a typical chat request (prompt + output tokens)
TYPICAL_REQUEST_TOKENS = 2048
# the pool keeps this share spare when sizing max_num_seqs (block rounding, the null block)
POOL_KEEP = 0.9
# a max_model_len this many times the P99 is worth capping (a tip)
LENGTH_OVER_P99 = 2.0
COTENANT_MARGIN_GIB = 1.0


@dataclass
class LintFinding(Finding):
    """A finding of the lint: ``severity`` is ``problem`` or ``tip``."""

    severity: str = "problem"

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "severity": self.severity}


@dataclass(frozen=True)
class _Command:
    text: str
    args: dict[str, Any]
    other: dict[str, Any]
    workload: Workload
    prediction: Any = None
    gpu_total_gib: float | None = None
    evidence: list[Evidence] = field(default_factory=list)
    prefix: Any = None  # PrefixCacheAdvice from a measured hit rate (None: none measured)


@dataclass
class LintReport:
    """The lint's findings (problems first) and notes on what it could not check."""

    findings: list[LintFinding]
    notes: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[LintFinding]:
        return [f for f in self.findings if f.severity == "problem"]

    def to_dict(self) -> dict[str, Any]:
        return {"findings": [f.to_dict() for f in self.findings], "notes": self.notes}


def lint_command(
    command: str, *, gpu: str | None = None, workload: Workload | None = None
) -> LintReport:
    """Check a command line. The KV-capacity checks need the model and the GPU to resolve
    offline; the others need only the command. Raises :class:`BadInput` for an unreadable
    command, a misspelt flag or an unknown GPU name.
    """
    from oomguard.vllm_args import parse_command

    parsed = parse_command(command)
    parsed.check_flags()
    prediction, gpu_spec = _predict(parsed, gpu)
    notes: list[str] = []
    if gpu_spec is None:
        notes.append("KV-capacity checks skipped: pass --gpu to size the KV cache")
    elif prediction is None:
        notes.append(
            f"KV-capacity checks skipped: {parsed.model} is not in the offline "
            "catalogue or a local path"
        )
    c = _Command(
        text=command,
        args=dict(parsed.settings_kwargs),
        other=dict(parsed.other_flags),
        workload=workload or Workload(),
        prediction=prediction,
        gpu_total_gib=gpu_spec.total_bytes / GIB if gpu_spec is not None else None,
        evidence=[Evidence.of(0, command)],
        prefix=_measured_prefix(parsed, gpu_spec, notes),
    )
    findings = [f for check in _CHECKS if (f := check(c)) is not None]
    findings.sort(key=lambda f: (f.severity != "problem", -f.confidence))
    return LintReport(findings, notes)


def _finding(
    c: _Command,
    cause: str,
    summary: str,
    fixes: list[Fix],
    why: str,
    severity: str = "problem",
    confidence: float = 0.9,
) -> LintFinding:
    return LintFinding(
        cause=cause,
        confidence=confidence,
        summary=summary,
        evidence=list(c.evidence),
        fixes=fixes,
        explanation=why,
        sure=True,
        mechanism="lint",
        severity=severity,
    )


def _check_headroom(c: _Command) -> LintFinding | None:
    util = c.args.get("gpu_memory_utilization")
    if util is None or util < NO_HEADROOM_UTIL:
        return None
    return _finding(
        c,
        "util_overshoot",
        f"gpu_memory_utilization {util:g} leaves no headroom",
        [
            Fix(
                "--gpu-memory-utilization",
                "0.90",
                "the CUDA context, NCCL buffers and what vLLM "
                "does not account for live outside the budget",
            )
        ],
        "The budget is a fraction of the whole GPU; what vLLM does not account for needs the "
        "rest, and the start-up check fails when anything else holds memory.",
    )


def _check_cotenant(c: _Command) -> LintFinding | None:
    need = c.workload.headroom_bytes / GIB  # memory another workload on the GPU needs
    total = c.gpu_total_gib
    if need <= 0 or total is None:
        return None
    util = c.args.get("gpu_memory_utilization")
    if util is None:
        util = c.prediction.settings.gpu_memory_utilization if c.prediction else 0.9
    if util * total + need <= total - COTENANT_MARGIN_GIB:
        return None
    new = floor2((total - need - COTENANT_MARGIN_GIB) / total)
    return _finding(
        c,
        "util_overshoot",
        f"a co-tenant needing {need:g} GiB is not budgeted",
        [
            Fix(
                "--gpu-memory-utilization",
                f"{new:.2f}",
                f"{util:g} × {total:.1f} GiB + {need:g} GiB exceeds the GPU; {new:.2f} leaves "
                f"{COTENANT_MARGIN_GIB:g} GiB spare",
            )
        ],
        "vLLM and another CUDA workload on one GPU must be budgeted together.",
    )


def _check_fit(c: _Command) -> LintFinding | None:
    """The memory model predicts the command will not start."""
    p = c.prediction
    if p is None or p.fits:
        return None
    codes = {problem.code for problem in p.problems}
    message = "; ".join(problem.message for problem in p.problems)
    if codes & {"weights_exceed_gpu", "weights_exceed_budget"}:
        cause, fixes = "weights_dont_fit", []
    else:
        cause, fixes = "kv_too_small_for_max_len", _length_fix(p)
    return _finding(
        c,
        cause,
        f"this configuration will not start: {message}",
        fixes,
        "The memory model's prediction of vLLM's start-up for this command, model "
        "and GPU (oomguard plan shows the whole breakdown).",
    )


def _length_fix(p: Any) -> list[Fix]:
    estimate = p.estimated_max_model_len
    if not estimate or estimate <= 0:
        return []
    length = max(int(estimate * POOL_KEEP) // p.block_size * p.block_size, p.block_size)
    return [
        Fix(
            "--max-model-len",
            str(length),
            f"the KV cache holds {p.kv_cache_tokens:,} tokens; {length:,} keeps 10 % spare",
        )
    ]


def _check_seqs_against_pool(c: _Command) -> LintFinding | None:
    """max_num_seqs against what the paged pool serves at the workload's length."""
    p = c.prediction
    if p is None or not p.fits or p.kv_cache_tokens <= 0:
        return None
    p99 = c.workload.p99_tokens
    stated_seqs = c.args.get("max_num_seqs")
    if not p99 and stated_seqs is None:
        return None  # vLLM's default and no workload: nothing to compare with
    length = p99 or min(TYPICAL_REQUEST_TOKENS, p.settings.max_model_len or TYPICAL_REQUEST_TOKENS)
    served = max(int(p.kv_cache_tokens * POOL_KEEP // length), 1)
    seqs = int(p.settings.max_num_seqs or stated_seqs or 0)
    wanted = c.workload.concurrency
    if wanted and wanted > served:
        return _pool_too_small(c, length, served, wanted)
    if seqs <= served or (not p99 and seqs <= 4 * served):
        return None
    target = min(served, wanted) if wanted else served
    basis = f"the P99 of {p99:,}" if p99 else f"a typical {length:,}-token request"
    return _finding(
        c,
        "concurrency_or_batch",
        f"max_num_seqs {seqs} is more than the {served} sequences of {basis} tokens the KV pool "
        f"serves",
        [
            Fix(
                "--max-num-seqs",
                str(target),
                f"the pool holds {p.kv_cache_tokens:,} tokens; {target} × {length:,} = "
                f"{target * length:,} keeps 10 % spare, so a burst is not preempted",
            )
        ],
        "vLLM's KV cache is paged: a sequence holds the blocks its tokens use. A burst of "
        "max_num_seqs requests of this length overflows the pool, and vLLM preempts and "
        "recomputes them.",
        severity="tip",
        confidence=0.85 if p99 else 0.6,
    )


def _pool_too_small(c: _Command, length: int, served: int, wanted: int) -> LintFinding:
    p = c.prediction
    return _finding(
        c,
        "kv_too_small_for_max_len",
        f"the KV pool ({p.kv_cache_tokens:,} tokens) serves {served} requests of {length:,} "
        f"tokens, not the {wanted} the workload needs",
        [
            Fix(
                "--max-num-seqs",
                str(served),
                f"{served} × {length:,} tokens fit with 10 % spare; "
                "more GPU memory (tensor parallelism, fp8 KV cache, a quantized model) serves more",
            )
        ],
        "oomguard plan with --p99-tokens and --concurrency finds a configuration that serves "
        "the whole workload.",
    )


def _check_length_against_p99(c: _Command) -> LintFinding | None:
    p99 = c.workload.p99_tokens
    if not p99:
        return None
    p = c.prediction
    length = c.args.get("max_model_len")
    if length in (None, -1) and p is not None:
        length = p.settings.max_model_len
    if not length or length <= LENGTH_OVER_P99 * p99:
        return None
    target = int(math.ceil(p99 * 1.1 / 256) * 256)
    return _finding(
        c,
        "max_model_len_above_p99",
        f"max_model_len {length:,} is far above the P99 of {p99:,}",
        [Fix("--max-model-len", str(target), f"covers the P99 ({p99:,}) with 10 % margin")],
        "The KV cache is paged, so an unused context costs no memory by itself; but one request "
        "may then grow to max_model_len and take that much of the pool from the others.",
        severity="tip",
        confidence=0.5,
    )


def _measured_prefix(parsed: Any, gpu_spec: Any, notes: list[str]) -> Any:
    """Advice from a prefix-cache hit rate bench or watch measured for this GPU, model, TP and
    PP (the command's vLLM version when it names one); None when none was, or without --gpu."""
    if gpu_spec is None:
        return None
    from oomguard.calibration.prefix import measured_advice
    from oomguard.errors import OomguardError

    args = parsed.settings_kwargs
    version = args.get("vllm_version")
    try:
        advice = measured_advice(
            gpu_spec.name,
            None if version in (None, "", "latest") else str(version),
            parsed.model,
            int(args.get("tensor_parallel_size") or 1),
            int(args.get("pipeline_parallel_size") or 1),
        )
    except OomguardError as exc:
        notes.append(f"prefix caching not checked against the calibration store: {exc.one_line()}")
        return None
    if advice is not None and (
        advice.enable is None or advice.enable is _prefix_on(parsed.settings_kwargs)
    ):
        notes.append(f"prefix caching: {advice.reason}")
    return advice


def _prefix_on(args: Any) -> bool:
    """Whether the command leaves prefix caching on (unset: vLLM's default, on for most models;
    0.32: config/cache.py and EngineArgs)."""
    return args.get("enable_prefix_caching") is not False


def _check_prefix_caching(c: _Command) -> LintFinding | None:
    advice = c.prefix
    if advice is not None and advice.enable is not None:
        return _check_measured_prefix(c, advice)
    if not c.args.get("enable_prefix_caching") or c.workload.shared_prefix_tokens > 0:
        return None
    return _finding(
        c,
        "prefix_caching_unused",
        "prefix caching is on but the prompts are not known to share prefixes",
        [
            Fix(
                "--no-enable-prefix-caching",
                None,
                "without shared prefixes it saves no prefill (the checklist turns it off below "
                "30 % hits); keep it if prompts share a system prompt, and measure the rate "
                "with `oomguard bench` or `oomguard watch`",
            )
        ],
        "",
        severity="tip",
        confidence=0.5,
    )


def _check_measured_prefix(c: _Command, advice: Any) -> LintFinding | None:
    """The seeds' step 6 on a measured hit rate: a tip when the command does the opposite."""
    on = _prefix_on(c.args)
    if on is advice.enable:
        return None
    rate = advice.window.hit_rate
    state = "left on (vLLM's default)" if c.args.get("enable_prefix_caching") is None else "on"
    summary = (
        f"prefix caching is {state} but its measured hit rate is {rate:.0%}"
        if on
        else f"prefix caching is off but its measured hit rate is {rate:.0%}"
    )
    return _finding(
        c,
        "prefix_caching_unused" if on else "prefix_caching_off",
        summary,
        [Fix(advice.flag, None, advice.reason)],
        "",
        severity="tip",
        confidence=0.8,
    )


def _check_sleep_expandable(c: _Command) -> LintFinding | None:
    text = c.text.lower()
    sleep = "enable-sleep-mode" in text or "enable_sleep_mode" in text
    if not (sleep and "expandable_segments:true" in text):
        return None
    return _finding(
        c,
        "other",
        "expandable_segments is set together with sleep mode",
        [
            Fix(
                "PYTORCH_CUDA_ALLOC_CONF",
                "(unset)",
                "sleep mode's memory pool rejects expandable segments",
            )
        ],
        "",
    )


_CHECKS: tuple[Callable[[_Command], LintFinding | None], ...] = (
    _check_headroom,
    _check_cotenant,
    _check_fit,
    _check_seqs_against_pool,
    _check_length_against_p99,
    _check_prefix_caching,
    _check_sleep_expandable,
)


def _predict(parsed: Any, gpu: str | None) -> tuple[Any, Any]:
    """The memory model's prediction for the command (None when model or GPU is unknown)."""
    gpu_spec = spec = None
    if gpu:
        try:
            from oomguard.facts.gpus import find_gpu

            gpu_spec = find_gpu(gpu)
        except BadInput:
            raise
        except Exception:  # the facts layer failing is not the user's input: skip the KV checks
            gpu_spec = None
    try:
        from oomguard.facts.resolve import resolve_model_with_quantization

        spec = resolve_model_with_quantization(
            parsed.model, parsed.settings_kwargs.get("quantization"), allow_hub=False
        )
    except Exception:  # a model not catalogued offline: the KV checks are skipped, said so
        spec = None
    if spec is None or gpu_spec is None:
        return None, gpu_spec
    try:
        from oomguard.facts.resolve import attach_drafter
        from oomguard.memory.engine import predict

        settings = attach_drafter(parsed.settings())
        return predict(spec, gpu_spec, settings, strict=False), gpu_spec
    except BadInput:
        raise
    except Exception:  # an architecture the predictor rejects: `oomguard plan` explains it
        return None, gpu_spec
