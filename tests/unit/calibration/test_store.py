"""Calibration: parse real start-up logs (V0 and V1), store, look up, through the CLI too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.calibration import Store, lookup, model_family, observation_from_log, record_logs
from oomguard.cli import main
from oomguard.errors import BadInput, MalformedConfig
from oomguard.logs import parse_stream
from oomguard.units import GIB

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


# --- settings, PP and GPU names -------------------------------------------------------------
H100 = "NVIDIA H100 80GB HBM3"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
# vLLM 0.19.0 on an H100, Llama-3.1-8B, TP 1: the same key, measured under different settings
ROW_DEFAULT, ROW_BF16_FP8KV, ROW_FP8, ROW_FP32 = ROWS[35], ROWS[32], ROWS[33], ROWS[34]
ROW_PP2, ROW_PP4 = ROWS[36], ROWS[37]


def _record(tmp_path: Path, rows: list[dict[str, object]]) -> list[Path]:
    paths = []
    for i, row in enumerate(rows):
        path = tmp_path / f"log{i}.log"
        path.write_text(str(row["raw"]))
        paths.append(path)
    record_logs(paths, gpu=H100, vllm_version="0.19.0")
    return paths


def test_settings_and_catalogue_gpu_are_recorded(home: Path) -> None:
    obs = observation_from_log(
        parse_stream(str(ROW_FP8["raw"]).splitlines()), gpu=H100, vllm_version="0.19.0"
    )
    assert obs is not None
    assert obs.gpu == "H100 SXM" and obs.gpu_raw == H100  # catalogue name, raw kept
    assert obs.quantization == "fp8" and obs.user_set == ("quantization",)
    assert obs.enforce_eager is False  # graphs were captured
    assert obs.dtype is None and obs.max_num_batched_tokens is None  # left to vLLM
    assert obs.args_stated
    assert obs.key == "h100 sxm|0.19|llama-3.1-8b|tp1"


def test_settings_from_user_args_and_engine_config() -> None:
    log = [
        "INFO 05-01 10:00:00 [utils.py:233] non-default args: {'model': 'org/Some-7B', "
        "'max_num_batched_tokens': 2048, 'max_num_seqs': 64, 'enforce_eager': True, "
        "'dtype': 'half', 'quantization': 'awq_marlin'}",
        "INFO 05-01 10:00:01 [core.py:70] Initializing a V1 LLM engine (v0.10.1) with config: "
        "model='org/Some-7B', speculative_config=None, dtype=torch.float16, max_seq_len=4096, "
        "tensor_parallel_size=2, pipeline_parallel_size=2, quantization=awq_marlin, "
        "enforce_eager=True, kv_cache_dtype=fp8_e4m3, device_config=cuda",
        "INFO 05-01 10:00:09 [gpu_model_runner.py:1] Model loading took 2.1 GiB and 5.0 seconds",
    ]
    parsed = parse_stream(log)
    assert parsed.user_settings["max_num_batched_tokens"] == 2048
    assert "kv_cache_dtype" not in parsed.user_settings  # only the engine config states it
    obs = observation_from_log(parsed, gpu="RTX 4090")
    assert obs is not None
    assert (obs.tp, obs.pp, obs.vllm_version) == (2, 2, "0.10.1")
    assert obs.settings() == {
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 64,
        "enforce_eager": True,
        "dtype": "float16",
        "quantization": "awq",
        "kv_cache_dtype": "fp8_e4m3",
    }
    assert set(obs.user_set) == {
        "max_num_batched_tokens",
        "max_num_seqs",
        "enforce_eager",
        "dtype",
        "quantization",
    }
    assert obs.key.endswith("|tp2|pp2")


def test_pipeline_parallel_logs_get_their_own_keys(home: Path, tmp_path: Path) -> None:
    _record(tmp_path, [ROW_DEFAULT, ROW_PP2, ROW_PP4])
    entries = Store().load()
    assert {k for k in entries if "llama-3.1-8b" in k} == {
        "h100 sxm|0.19|llama-3.1-8b|tp1",
        "h100 sxm|0.19|llama-3.1-8b|tp1|pp2",
        "h100 sxm|0.19|llama-3.1-8b|tp1|pp4",
    }
    pp1 = lookup(H100, "0.19.0", LLAMA, 1)
    pp2 = lookup(H100, "0.19.0", LLAMA, 1, pp=2)
    pp4 = lookup("H100 SXM", "0.19.0", LLAMA, 1, pp=4)
    assert pp1 is not None and pp2 is not None and pp4 is not None
    assert pp1.weights_bytes == int(14.99 * GIB)
    assert pp2.weights_bytes == int(7.51 * GIB)  # the PP 2 log no longer overwrites PP 1
    assert pp4.weights_bytes is not None and pp4.weights_bytes < pp2.weights_bytes
    assert lookup(H100, "0.19.0", LLAMA, 1, pp=8) is None


def test_lookup_returns_only_the_terms_that_apply(home: Path, tmp_path: Path) -> None:
    # recorded oldest first: the fp32 log is the newest of the four under the same key
    _record(tmp_path, [ROW_DEFAULT])
    _record(tmp_path, [ROW_FP8])
    _record(tmp_path, [ROW_FP32])
    key = "h100 sxm|0.19|llama-3.1-8b|tp1"
    assert len(Store().rows(key)) == 3
    # the old signature: the newest observation's terms, whatever its settings
    newest = lookup(H100, "0.19.0", LLAMA, 1)
    assert newest is not None and newest.weights_bytes == int(29.98 * GIB)

    default = lookup(
        H100,
        "0.19.0",
        LLAMA,
        1,
        max_num_batched_tokens=None,
        max_num_seqs=None,
        enforce_eager=False,
        quantization=None,
        dtype=None,
    )
    assert default is not None
    assert default.weights_bytes == int(14.99 * GIB)  # not the fp32 or the fp8 weights
    assert default.activation_bytes == int(1.89 * GIB)
    assert default.cudagraph_bytes == int(0.91 * GIB)
    assert "log0.log" in default.source

    fp8 = lookup(H100, "0.19.0", LLAMA, 1, quantization="fp8", dtype=None)
    assert fp8 is not None and fp8.weights_bytes == int(8.49 * GIB)
    fp32 = lookup(H100, "0.19.0", LLAMA, 1, dtype="float", quantization=None)
    assert fp32 is not None
    assert fp32.weights_bytes == int(29.98 * GIB) and fp32.activation_bytes == int(2.21 * GIB)
    # a dtype nothing was measured with: weights and activation are left to the estimate
    fp16 = lookup(H100, "0.19.0", LLAMA, 1, dtype="half", quantization=None)
    assert fp16 is not None
    assert fp16.weights_bytes is None and fp16.activation_bytes is None
    assert fp16.cudagraph_bytes is None  # graph buffers are in the model's dtype too
    assert fp16.non_torch_bytes == int(0.25 * GIB)  # depends on TP/PP only

    # another batch-token cap or sequence count: the activation peak does not carry over
    tokens = lookup(
        H100, "0.19.0", LLAMA, 1, quantization=None, dtype=None, max_num_batched_tokens=2048
    )
    assert tokens is not None
    assert tokens.activation_bytes is None and tokens.weights_bytes == int(14.99 * GIB)
    seqs = lookup(H100, "0.19.0", LLAMA, 1, dtype=None, quantization=None, max_num_seqs=16)
    assert seqs is not None and seqs.activation_bytes is None and seqs.cudagraph_bytes is None
    # eager mode captures no graphs: the measured graphs do not apply
    eager = lookup(H100, "0.19.0", LLAMA, 1, enforce_eager=True)
    assert eager is not None and eager.cudagraph_bytes is None


def test_quantized_checkpoint_ignores_the_quantization_filter(home: Path, tmp_path: Path) -> None:
    path = tmp_path / "fp8.log"
    path.write_text(str(ROWS[21]["raw"]))  # a Qwen2.5-7B FP8 checkpoint
    stored, _ = record_logs([path], gpu=H100, vllm_version="0.19.0")
    model = stored[0].model
    assert stored[0].family.endswith("-fp8")
    for quant in (None, "fp8"):
        terms = lookup(H100, "0.19.0", model, 1, quantization=quant)
        assert terms is not None and terms.weights_bytes == int(stored[0].weights_gib * GIB)


def test_rows_under_another_gpu_spelling_and_old_stores(home: Path) -> None:
    """Rows written before settings/PP/catalogue names were recorded still serve lookups."""
    home.mkdir(parents=True)
    old_row = {
        "gpu": H100,
        "vllm_version": "0.19.0",
        "model": LLAMA,
        "family": "llama-3.1-8b",
        "tp": 1,
        "weights_gib": 14.99,
        "activation_gib": 1.89,
        "non_torch_gib": 0.25,
        "cudagraph_gib": 0.91,
        "available_kv_gib": 58.11,
        "kv_tokens": 476016,
        "engine": "v1",
        "source": "old.log",
        "recorded_at": "2025-01-01T00:00:00+00:00",
    }
    (home / "calibration.json").write_text(
        json.dumps(
            {"version": 1, "entries": {"nvidia h100 80gb hbm3|0.19|llama-3.1-8b|tp1": [old_row]}}
        )
    )
    terms = lookup("H100 SXM", "0.19.3", LLAMA, 1, max_num_batched_tokens=None, dtype=None)
    assert terms is not None and terms.activation_bytes == int(1.89 * GIB)
    assert "old.log" in terms.source
    assert lookup("H100 PCIe", "0.19.3", LLAMA, 1) is None  # another GPU


def test_recording_the_same_log_twice_keeps_one_row(home: Path, tmp_path: Path) -> None:
    _record(tmp_path, [ROW_DEFAULT])
    _record(tmp_path, [ROW_DEFAULT])
    assert len(Store().rows("h100 sxm|0.19|llama-3.1-8b|tp1")) == 1


def test_cli_calibrate_reports_settings(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "pp.log"
    log.write_text(str(ROW_PP2["raw"]))
    code = main(["calibrate", str(log), "--gpu", H100, "--vllm-version", "0.19.0", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    stored = data["stored"][0]
    assert stored["key"].endswith("|pp2") and stored["pp"] == 2
    assert stored["gpu"] == "H100 SXM" and stored["gpu_raw"] == H100
    assert stored["settings"]["enforce_eager"] is False
