"""Calibration: parse real start-up logs (V0 and V1), store, look up, through the CLI too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.calibration import Store, lookup, model_family, observation_from_log, record_logs
from oomguard.cli import main
from oomguard.errors import BadInput, MalformedConfig
from oomguard.logs import parse_stream

ROWS = [
    json.loads(line)
    for line in Path("/work/shared/data/vllm-startup-logs.jsonl").read_text().splitlines()
    if line.strip()
]
V1_ROW = ROWS[35]  # vLLM 0.19.0, Llama-3.1-8B, H100, TP=1 (non-default args + DEBUG profiling line)
V0_ROW = ROWS[59]  # vLLM 0.8.2 V0 fallback, Llama-3.2-3B, T4


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OOMGUARD_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_model_family() -> None:
    assert model_family("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    assert model_family("RedHatAI/Llama-3.3-70B-Instruct-fp8-dynamic") == "llama-3.3-70b-fp8"
    assert model_family("google/gemma-2-27b-it") == "gemma-2-27b"


def test_v1_log_is_stored_and_found(home: Path, tmp_path: Path) -> None:
    log = tmp_path / "v1.log"
    log.write_text(V1_ROW["raw"])
    stored, skipped = record_logs([log], gpu="NVIDIA H100 80GB HBM3", vllm_version="0.19.0")
    assert not skipped and len(stored) == 1
    obs = stored[0]
    assert (obs.weights_gib, obs.activation_gib, obs.non_torch_gib, obs.cudagraph_gib) == (
        14.99,
        1.89,
        0.25,
        0.91,
    )
    assert obs.tp == 1 and obs.family == "llama-3.1-8b"
    assert (home / "calibration.json").exists()
    assert not [
        p for p in home.iterdir() if p.name.startswith(".calibration-")
    ]  # no temp file left
    terms = lookup("NVIDIA H100 80GB HBM3", "0.19.2", "meta-llama/Llama-3.1-8B-Instruct", 1)
    assert terms is not None
    assert terms.weights_bytes == int(14.99 * 2**30)
    assert terms.activation_bytes == int(1.89 * 2**30)
    assert "calibration" in terms.source
    assert lookup("NVIDIA H100 80GB HBM3", "0.19.0", "meta-llama/Llama-3.1-8B-Instruct", 2) is None
    assert lookup("NVIDIA H100 80GB HBM3", "0.20.0", "meta-llama/Llama-3.1-8B-Instruct", 1) is None


def test_v0_log_and_newest_observation_wins(home: Path) -> None:
    parsed = parse_stream(V0_ROW["raw"].splitlines())
    obs = observation_from_log(parsed, gpu="Tesla T4")
    assert obs is not None
    assert obs.vllm_version == "0.8.2" and obs.model == "unsloth/Llama-3.2-3B-Instruct"
    assert (obs.weights_gib, obs.activation_gib, obs.non_torch_gib) == (
        6.016,
        0.9,
        0.05,
    )  # "Model loading took 6.0160 GB", the more precise statement
    store = Store()
    store.add([obs])
    newer = observation_from_log(parsed, gpu="Tesla T4", model="unsloth/Llama-3.2-3B-Instruct")
    assert newer is not None
    store.add([newer])
    assert store.get(obs.key) is not None
    terms = lookup("Tesla T4", "0.8.2", "unsloth/Llama-3.2-3B-Instruct", 1)
    assert terms is not None and terms.non_torch_bytes == int(0.05 * 2**30)


def test_missing_key_parts_are_named() -> None:
    parsed = parse_stream(["INFO Model loading took 14.99 GiB memory and 1.0 seconds"])
    with pytest.raises(BadInput, match="gpu.*vllm-version.*model|--gpu"):
        observation_from_log(parsed)
    assert (
        observation_from_log(
            parse_stream(["nothing here"]), gpu="x", vllm_version="0.19.0", model="m"
        )
        is None
    )


def test_corrupt_store_is_a_clear_error(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "calibration.json").write_text("{not json")
    with pytest.raises(MalformedConfig, match="not valid JSON"):
        Store().load()


def test_cli_calibrate(home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v1 = tmp_path / "v1.log"
    v1.write_text(V1_ROW["raw"])
    v0 = tmp_path / "v0.log"
    v0.write_text(V0_ROW["raw"])
    empty = tmp_path / "empty.log"
    empty.write_text("hello\n")
    code = main(
        [
            "calibrate",
            str(v1),
            str(v0),
            str(empty),
            "--gpu",
            "NVIDIA H100 80GB HBM3",
            "--vllm-version",
            "0.19.0",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stored"]) == 2 and len(data["skipped"]) == 1
    assert (
        main(["calibrate", str(empty), "--gpu", "x", "--vllm-version", "0.19.0", "--model", "m"])
        == 3
    )
    assert main(["calibrate", str(tmp_path / "missing.log")]) == 2
