"""Findings, fixes and the diagnosis value the CLI renders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from oomguard.logs.parsed import Evidence, ParsedLog

CAUSES = (
    "util_overshoot",
    "kv_too_small_for_max_len",
    "concurrency_or_batch",
    "weights_dont_fit",
    "cuda_graph",
    "fragmentation",
    "multimodal_encoder",
    "leak_or_other_process",
    "cpu_ram",
    "other",
)

# Causes in the order the seeds' checklist reaches them (step 1 measures what else holds the
# GPU, step 2 utilization, CUDA graphs beside it, step 3 max_model_len, step 4 the batch, then
# what the model itself needs, and the allocator, host and unknown last): two findings with the
# same confidence are ranked in this order.
CHECKLIST_ORDER: dict[str, int] = {
    cause: rank
    for rank, cause in enumerate(
        (
            "leak_or_other_process",
            "util_overshoot",
            "cuda_graph",
            "kv_too_small_for_max_len",
            "concurrency_or_batch",
            "multimodal_encoder",
            "weights_dont_fit",
            "fragmentation",
            "cpu_ram",
            "other",
        )
    )
}


def rank_key(cause: str, confidence: float) -> tuple[float, int]:
    """Sort key for findings, best first: higher confidence (to 0.01), then checklist order."""
    return (-round(confidence, 2), CHECKLIST_ORDER.get(cause, len(CHECKLIST_ORDER)))


# The seeds' checklist order (measure → utilization → max_model_len → max_num_seqs → batch
# tokens → fp8 KV → quantize → more GPUs → tier), extended with the levers it does not name.
STEP_ACTION = 1
STEP_UTIL = 2
STEP_CUDAGRAPH = 2.5
STEP_MAX_MODEL_LEN = 3
STEP_MAX_NUM_SEQS = 4
STEP_BATCHED_TOKENS = 4.5
STEP_MULTIMODAL = 4.6
STEP_KV_DTYPE = 5
STEP_QUANTIZE = 6
STEP_TP = 7
STEP_OFFLOAD = 8
STEP_SWAP = 9
STEP_ENV = 10


@dataclass(frozen=True)
class Fix:
    """One concrete change: a vLLM flag (``--max-model-len``), an environment variable
    (``PYTORCH_CUDA_ALLOC_CONF``) or an ``action`` to take, with the value and the reason."""

    flag: str
    value: str | None
    why: str
    step: float = STEP_ENV

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value, "why": self.why}

    @property
    def as_text(self) -> str:
        if self.flag == "action":
            return str(self.value)
        if self.flag.startswith("--"):
            return self.flag if self.value in (None, "") else f"{self.flag} {self.value}"
        return f"{self.flag}={self.value}"


@dataclass
class Finding:
    """A root cause with its confidence (0–1), evidence lines, explanation and fixes."""

    cause: str
    confidence: float
    summary: str
    evidence: list[Evidence] = field(default_factory=list)
    fixes: list[Fix] = field(default_factory=list)
    explanation: str = ""

    def ordered_fixes(self) -> list[Fix]:
        return sorted(self.fixes, key=lambda f: f.step)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "confidence": round(self.confidence, 2),
            "summary": self.summary,
            "explanation": self.explanation,
            "evidence": [e.to_dict() for e in _dedupe(self.evidence)],
            "fixes": [f.to_dict() for f in self.ordered_fixes()],
        }


def _dedupe(evidence: list[Evidence]) -> list[Evidence]:
    seen: set[int] = set()
    out: list[Evidence] = []
    for ev in sorted(evidence, key=lambda e: e.line):
        if ev.line not in seen:
            seen.add(ev.line)
            out.append(ev)
    return out


@dataclass
class Diagnosis:
    """The doctor's answer: findings best first, the parsed log, and the derived numbers."""

    findings: list[Finding]
    parsed: ParsedLog
    derived: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] | None = None
    oom_found: bool = True

    @property
    def top(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "oom_found": self.oom_found,
            "findings": [f.to_dict() for f in self.findings],
            "derived": self.derived,
            "plan": self.plan,
            "parsed": self.parsed.to_dict(),
        }
