"""One fix generator: the change serve's heal runs is the first fix ``oomguard doctor LOG --json``
prints for the same log and command, when serve's checks have nothing to refuse (memory free
now as at the failure or more, no workload stated, a precision change allowed, GPUs enough).

The logs: every failure the integration tests provoke with real vLLM (recorded in
``tests/integration/data``, the commands from ``tests/integration/scenarios.py``), and every case
of the doctor's corpus (``bench/data/oom-cases-corpus.jsonl``). Where the doctor's first fix is
an action for a person, serve runs its first flag or environment fix instead and says why it
passed over each action; where the doctor finds no memory failure, serve runs nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from oomguard.cli import main
from oomguard.logs import parse_stream
from oomguard.logs.follow import LogFollower
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device
from oomguard.serve.heal import HealContext, HealDecision, decide, doctor_context

from .conftest import DATA_DIR, GIB, cpu_node

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "bench" / "data" / "oom-cases-corpus.jsonl"
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import scenarios  # noqa: E402

GENEROUS_FREE = 1024 * GIB
NO_MODEL = "org/unnamed-model"  # serve always has a model; a corpus case may name none


def _scenario_flags(scenario: scenarios.Scenario) -> list[str]:
    """The flags the integration tests start the failing server with (``ServeConfig.argv``)."""
    flags = ["--load-format", "dummy", "--enforce-eager"]
    for flag, value in (
        ("--kv-cache-memory-bytes", scenario.kv_cache_memory_bytes),
        ("--max-model-len", scenario.max_model_len),
        ("--max-num-seqs", scenario.max_num_seqs),
        ("--gpu-memory-utilization", scenario.gpu_memory_utilization),
    ):
        if value is not None:
            flags += [flag, str(value)]
    return flags + list(scenario.extra_args)


def _corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def _doctor_json(log: Path, ctx: HealContext, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``oomguard doctor LOG --json`` with the model and command serve tells the doctor."""
    told = doctor_context(ctx)
    capsys.readouterr()
    code = main(["doctor", str(log), "--json", "--model", told.model, "--command", told.command])
    out = capsys.readouterr().out
    assert code in (0, 3, 4), out[-2000:]
    return dict(json.loads(out))


def _heal(log: Path, command: EngineCommand, spec: ModelSpec | None, device: Device) -> HealContext:
    follower = LogFollower()
    for line in log.read_text(errors="replace").splitlines():
        follower.feed(line)
    return HealContext(
        parsed=follower.parsed(),
        failure=follower.failure,
        command=command,
        tried={command.key(): 1},
        spec=spec,
        device=device,
        vllm_version="0.32.0",
        session_logs=[],
        free_bytes=device.free_bytes,
        use_calibration=False,
        allow_precision_change=True,
    )


def _runnable(fix: dict[str, Any]) -> bool:
    flag = str(fix["flag"])
    return flag.startswith("--") or (flag != "action" and fix["value"] is not None)


def _changes(fix: dict[str, Any]) -> dict[str, str | None]:
    """The change a fix of the doctor's JSON makes, as serve's heal names it."""
    also = {a["flag"]: a["value"] for a in fix.get("also", [])}
    return {
        name: None if value in (None, "") else str(value)
        for name, value in {fix["flag"]: fix["value"], **also}.items()
    }


def _same_fix(report: dict[str, Any], decision: HealDecision) -> dict[str, Any] | None:
    """Check serve's change against the doctor's fixes; return the doctor's first fix."""
    findings = report["findings"]
    fixes = findings[0]["fixes"] if findings else []
    runnable = [f for f in fixes if _runnable(f)]
    if not runnable:
        assert decision.attempt is None, (fixes, decision.to_dict())
        return fixes[0] if fixes else None
    first = runnable[0]
    assert decision.attempt is not None, (first, decision.rejected)
    assert decision.attempt.changes == _changes(first), (fixes, decision.to_dict())
    assert decision.attempt.why == first["why"]
    assert decision.cause == findings[0]["cause"]
    skipped = fixes[: fixes.index(first)]
    assert [r for _, r in decision.rejected] == ["not a flag or environment variable to set"] * len(
        skipped
    ), decision.rejected
    return dict(fixes[0])


@pytest.mark.parametrize("scenario", scenarios.FAILING, ids=lambda s: s.name)
def test_a_provoked_failure_gets_the_doctors_first_fix(
    scenario: scenarios.Scenario,
    model_dir: Path,
    tiny_spec: ModelSpec,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The real vLLM failures: the doctor's first fix is a flag, and it is serve's change."""
    log = DATA_DIR / f"{scenario.name}.log"
    flags = _scenario_flags(scenario)
    command = EngineCommand.from_tokens(["vllm", "serve", str(model_dir), *flags])
    ctx = _heal(log, command, tiny_spec, Device(cpu_node(), "cpu", GENEROUS_FREE))
    first = _same_fix(_doctor_json(log, ctx, capsys), decide(ctx))
    assert first is not None and _runnable(first), first


@pytest.mark.parametrize("case", _corpus(), ids=lambda row: str(row["id"]))
def test_a_corpus_case_gets_the_doctors_first_fix(
    case: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(case["log"])
    model = str(case.get("model") or NO_MODEL).split()[0]
    command = EngineCommand.from_tokens(["vllm", "serve", model])
    gpu = GPUSpec(name="H200", total_bytes=140 * GIB, marketing_gb=141.0, vendor="nvidia")
    ctx = _heal(log, command, None, Device(gpu, "cuda", GENEROUS_FREE, count=64))
    report = _doctor_json(log, ctx, capsys)
    _same_fix(report, decide(ctx))


def test_the_corpus_comparison_is_not_empty() -> None:
    """Most corpus cases have a flag or environment fix first: the comparison above bites."""
    from oomguard.doctor.diagnose import diagnose

    runnable = 0
    rows = _corpus()[:60]
    for row in rows:
        top = diagnose(parse_stream(row["log"].splitlines())).top
        runnable += bool(top and top.fixes and (top.fixes[0].is_flag or top.fixes[0].is_env))
    assert runnable >= len(rows) // 4, runnable
