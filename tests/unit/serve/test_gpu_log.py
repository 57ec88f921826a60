"""A GPU start-up log (vLLM 0.19.0, Llama-3.1-8B-Instruct, H100, utilization 0.95): every term
it states is compared with the prediction, and what it measured is what the calibration store
keeps for the next plan."""

from __future__ import annotations

from pathlib import Path

from oomguard.facts.gpus import find_gpu
from oomguard.facts.resolve import resolve_model
from oomguard.logs.follow import LogFollower
from oomguard.serve.calibrate import observation_of
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device
from oomguard.serve.predict import predict_command
from oomguard.serve.verify import compare

LOG = (
    Path(__file__).resolve().parents[1] / "plan" / "data" / "llama-3.1-8b-h100-tp1-vllm-0.19.0.log"
)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _setup() -> tuple[EngineCommand, Device, LogFollower]:
    command = EngineCommand.from_tokens(
        [
            "vllm",
            "serve",
            MODEL,
            "--max-model-len",
            "8192",
            "--gpu-memory-utilization",
            "0.95",
            "--no-enable-prefix-caching",
        ]
    )
    device = Device(find_gpu("H100 SXM"), "cuda", None)
    follower = LogFollower()
    for line in LOG.read_text().splitlines():
        follower.feed(line)
    return command, device, follower


def test_every_stated_term_is_compared() -> None:
    command, device, follower = _setup()
    spec = resolve_model(MODEL, allow_hub=False)
    prediction = predict_command(command, spec, device, "0.19.0", use_calibration=False)
    rows = {r.term.name: r for r in compare(follower.parsed(), prediction.terms)}
    assert set(rows) >= {
        "weights",
        "activation",
        "non_torch",
        "cudagraph",
        "kv_cache_gib",
        "kv_cache_tokens",
        "max_concurrency",
    }
    assert rows["weights"].observed == 14.99 and abs(rows["weights"].diff or 0) < 0.05
    assert rows["kv_cache_tokens"].observed == 476016
    assert all(r.predicted is not None and r.diff is not None for r in rows.values())


def test_the_next_prediction_uses_what_the_log_measured() -> None:
    command, device, follower = _setup()
    spec = resolve_model(MODEL, allow_hub=False)
    observation = observation_of(follower.parsed(), device, spec, "0.19.0", source="test")
    assert observation is not None and observation.gpu == "H100 SXM"
    assert observation.weights_gib == 14.99 and observation.non_torch_gib == 0.25
    first = predict_command(command, spec, device, "0.19.0", use_calibration=False)
    again = predict_command(
        command,
        spec,
        device,
        "0.19.0",
        use_calibration=False,
        session_logs=[(follower.parsed(), first.memory)],
    )
    rows = {r.term.name: r for r in compare(follower.parsed(), again.terms)}
    assert abs(rows["kv_cache_gib"].diff or 0) < 0.02  # measured terms: the budget as logged
    assert abs(rows["kv_cache_tokens"].diff_pct or 0) < 0.05
    assert "launch 1 of this session" in again.measured_from
