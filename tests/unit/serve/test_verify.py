"""Predicted against observed on real logs: each stated term beside its prediction, the
difference, and whether it fell in the predicted range."""

from __future__ import annotations

import json
from pathlib import Path

from oomguard.memory.spec import ModelSpec
from oomguard.serve.command import EngineCommand
from oomguard.serve.device import Device
from oomguard.serve.events import KINDS, EventLog
from oomguard.serve.predict import predict_command
from oomguard.serve.verify import compare

from .conftest import GIB, cpu_node, follow


def test_explicit_pool_compares_exactly(model_dir: Path, tiny_spec: ModelSpec) -> None:
    """guard_pool_2048_tokens: 16 blocks of 128 tokens, max_model_len 1024."""
    command = EngineCommand.from_tokens(
        [
            "vllm",
            "serve",
            str(model_dir),
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            "1048576",
        ]
    )
    device = Device(cpu_node(11.96), "cpu", int(8 * GIB))
    prediction = predict_command(command, tiny_spec, device, "0.32.0", use_calibration=False)
    rows = {
        r.term.name: r for r in compare(follow("guard_pool_2048_tokens").parsed(), prediction.terms)
    }
    assert rows["kv_cache_tokens"].observed == 2048 and rows["kv_cache_tokens"].diff == 0
    assert rows["max_concurrency"].diff == 0 and rows["max_concurrency"].in_range
    assert rows["kv_cache_gib"].in_range  # 1 MiB printed as 0.0 GiB
    assert rows["kv_cache_tokens"].to_dict()["diff_pct"] == 0.0


def test_auto_pool_states_the_worker_memory_and_its_estimate(
    model_dir: Path, tiny_spec: ModelSpec
) -> None:
    """startup_auto_kv_util: utilization 0.25 of 12.09 GiB; 0.62 GiB outside the KV cache."""
    command = EngineCommand.from_tokens(
        [
            "vllm",
            "serve",
            str(model_dir),
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--max-num-seqs",
            "16",
            "--gpu-memory-utilization",
            "0.25",
        ]
    )
    device = Device(cpu_node(12.09), "cpu", int(8 * GIB))
    prediction = predict_command(command, tiny_spec, device, "0.32.0", use_calibration=False)
    rows = {
        r.term.name: r for r in compare(follow("startup_auto_kv_util").parsed(), prediction.terms)
    }
    non_kv = rows["cpu_non_kv"]
    assert non_kv.observed == 0.62 and non_kv.in_range  # estimate 0.6 GiB + the tiny weights
    assert rows["kv_cache_gib"].observed == 2.4 and rows["kv_cache_gib"].in_range
    assert rows["kv_cache_tokens"].in_range and rows["kv_cache_tokens"].diff != 0  # an estimate


def test_no_prediction_still_reports_the_observed() -> None:
    rows = compare(follow("default_len_10mib").parsed(), None)
    assert {r.term.name for r in rows} >= {"kv_cache_tokens", "max_concurrency"}
    assert all(r.predicted is None and r.diff is None for r in rows)


def test_events_are_one_json_object_each_with_a_timestamp() -> None:
    seen = []
    log = EventLog([seen.append])
    for kind in KINDS:
        log.emit(kind, kind_of_failure="x" if kind == "failure" else None)
    assert [e.kind for e in seen] == list(KINDS)
    for event in log.events:
        data = json.loads(event.to_json())
        assert data["event"] == event.kind and data["ts"].endswith("+00:00")
        assert data["elapsed_s"] >= 0
