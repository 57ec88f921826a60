"""``oomguard plan`` end to end: exit codes, one-line errors, JSON, pasted commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oomguard.cli import main
from oomguard.plan.service import plan

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def bad_config_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": ')
    return str(d)


BAD_INPUTS = [
    ["no-such-org/no-such-model-xyz", "--gpu", "L4", "--offline"],  # unknown model offline
    [LLAMA_8B, "--gpu", "GTX 9999 Ultra"],  # unknown GPU
    [LLAMA_8B, "--gpu", "H100", "-tp", "3", "--gpu-count", "4"],  # impossible TP (32 heads)
    [LLAMA_8B, "--gpu", "H100", "-tp", "4", "--gpu-count", "2"],  # TP over more GPUs than given
    [LLAMA_8B, "--gpu", "L4", "--max-model-len", "-5"],  # negative length
    [LLAMA_8B, "--gpu", "L4", "--p99-tokens", "-5", "--concurrency", "2"],
    [LLAMA_8B, "--gpu", "L4", "--concurrency", "0"],
    [LLAMA_8B, "--gpu", "L4", "--gpu-memory-utilization", "1.5"],
    [LLAMA_8B, "--gpu", "L4", "--kv-cache-dtype", "fp7"],
    [LLAMA_8B, "--gpu", "L4", "--max-num-batched-tokens", "1.5K"],
    [LLAMA_8B, "--gpu", "L4", "--p99-tokens", "10000000"],  # longer than the model's context
    [LLAMA_8B, "--gpu", "L4", "--shared-prefix", "-3", "--p99-tokens", "4096"],
    [LLAMA_8B, "--gpu-memory-gib", "-4"],
    [LLAMA_8B, "--gpu", "L4", "--gpu-count", "0"],
    ["--gpu", "L4", "--", "vllm", "serve", LLAMA_8B, "--max-num-seqs", "many"],
    ["--gpu", "L4", "--", "vllm", "chat", LLAMA_8B],
    [LLAMA_8B, "--gpu", "L4", "--no-such-flag"],  # usage error from the parser
]


@pytest.mark.parametrize("args", BAD_INPUTS, ids=lambda a: " ".join(a)[:60])
def test_bad_input_exits_2_with_one_line(capsys, args) -> None:
    code, out, err = _run(capsys, *args)
    assert code == 2
    assert "Traceback" not in out + err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines, "an error line is printed"
    assert out == ""


def test_malformed_local_config_exits_2(capsys, bad_config_dir) -> None:
    code, out, err = _run(capsys, bad_config_dir, "--gpu", "L4")
    assert code == 2 and "Traceback" not in err and err.startswith("error:")
    assert len(err.strip().splitlines()) <= 2  # one line (rich may wrap long lines in a narrow tty)


def test_fits_exits_0_and_prints_commands(capsys) -> None:
    code, out, _ = _run(
        capsys, LLAMA_8B, "--gpu", "H100", "--p99-tokens", "8k", "--concurrency", "16"
    )
    assert code == 0
    assert "fits" in out and "vllm serve meta-llama/Llama-3.1-8B-Instruct" in out
    assert "LLM(model=" in out and "max-model-len: 8000" in out
    assert "Recommendation" in out and "max-num-seqs" in out


def test_does_not_fit_exits_1(capsys) -> None:
    code, out, _ = _run(capsys, LLAMA_8B, "--gpu", "RTX 4090", "--max-model-len", "131072")
    assert code == 1
    expected = plan(LLAMA_8B, "RTX 4090", max_model_len=131072, allow_hub=False)
    suggested = expected.plan.prediction.estimated_max_model_len
    assert suggested is not None and 30_000 < suggested < 60_000
    assert "✗ does not start" in out and f"--max-model-len {suggested}" in out


def test_json_output_is_one_object(capsys) -> None:
    code, out, _ = _run(
        capsys, LLAMA_8B, "--gpu", "L4", "--p99-tokens", "8192", "--concurrency", "16", "--json"
    )
    data = json.loads(out)
    assert code == (0 if data["fits"] else 1)
    assert data["gpu"]["name"] == "L4" and data["settings"]["max_model_len"] == 8192
    assert data["recommendation"]["flags"]


def test_pasted_command_after_double_dash(capsys) -> None:
    code, out, _ = _run(
        capsys,
        "--gpu",
        "A100 80GB",
        "--json",
        "--",
        "vllm",
        "serve",
        LLAMA_8B,
        "--max-model-len",
        "16k",
        "--port",
        "8000",
    )
    data = json.loads(out)
    assert code == 0
    assert data["settings"]["max_model_len"] == 16000
    assert "--port 8000" in data["command"]


def test_misspelt_flag_in_a_pasted_command_names_the_real_one(capsys) -> None:
    code, out, err = _run(
        capsys,
        "--gpu",
        "A100 80GB",
        "--",
        "vllm",
        "serve",
        LLAMA_8B,
        "--max-model-length",
        "16k",
    )
    assert code == 2
    assert "--max-model-length is not a vLLM flag" in out + err
    assert "--max-model-len" in (out + err).split("not a vLLM flag", 1)[1]


def test_70b_on_4090_subprocess_is_useful() -> None:
    args = [
        sys.executable,
        "-m",
        "oomguard.cli",
        "plan",
        "meta-llama/Llama-3.1-70B-Instruct",
        "--gpu",
        "RTX 4090",
        "--p99-tokens",
        "8192",
        "--concurrency",
        "16",
        "--offline",
    ]
    proc = subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "HF_HUB_OFFLINE": "1",
            "PATH": "/usr/bin:/bin",
            "COLUMNS": "160",
            "OOMGUARD_HOME": os.environ["OOMGUARD_HOME"],
        },
    )
    assert proc.returncode == 1, proc.stderr
    assert "Alternatives, ranked" in proc.stdout
    assert "llama-server" in proc.stdout and "--tensor-parallel-size" in proc.stdout
    assert "Traceback" not in proc.stderr
    # how long it took is printed (bench/plan_speed.py measures it on a quiet machine)
    assert float(proc.stdout.rsplit("planned in ", 1)[1].split(" ms")[0]) > 0


def test_bad_input_subprocess_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "oomguard.cli", "plan", LLAMA_8B, "--gpu", "nosuchgpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "COLUMNS": "300",
            "OOMGUARD_HOME": os.environ["OOMGUARD_HOME"],
        },
    )
    assert proc.returncode == 2
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
