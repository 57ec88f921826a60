"""``oomguard plan`` with LoRA and multimodal flags: given as options or in a pasted command."""

from __future__ import annotations

import json

import pytest

from oomguard.cli import main

QWEN3_8B = "Qwen/Qwen3-8B"
QWEN_VL = "Qwen/Qwen2.5-VL-7B-Instruct"
BASE = ["--gpu", "H100 SXM", "--max-model-len", "8192", "--offline", "--json"]


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else {}), err


def test_lora_flags_raise_the_weights_and_stay_in_the_command(capsys) -> None:
    _, plain, _ = _plan(capsys, QWEN3_8B, *BASE)
    lora_flags = ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"]
    code, got, _ = _plan(capsys, QWEN3_8B, *BASE, *lora_flags, "--max-cpu-loras", "8")
    assert code == 0
    assert got["memory"]["weights_gib"] > plain["memory"]["weights_gib"]
    assert got["memory"]["kv_cache_gib"] < plain["memory"]["kv_cache_gib"]
    assert "--enable-lora --max-loras 4 --max-lora-rank 64 --max-cpu-loras 8" in got["command"]
    assert any(note.startswith("LoRA: buffers for 4 adapter(s)") for note in got["notes"])
    assert not any("not modelled" in note for note in got["notes"])


def test_a_pasted_lora_command_plans_as_the_options_do(capsys) -> None:
    options = ["--enable-lora", "--max-loras", "2", "--lora-dtype", "float16"]
    _, given, _ = _plan(capsys, QWEN3_8B, *BASE, *options)
    pasted = ["vllm", "serve", QWEN3_8B, "--max-model-len", "8192", *options]
    code, got, _ = _plan(capsys, "--gpu", "H100 SXM", "--offline", "--json", "--", *pasted)
    assert code == 0
    assert got["memory"]["weights_gib"] == given["memory"]["weights_gib"]
    assert got["settings"]["lora_dtype"] == "float16"


def test_multimodal_limits_drop_the_tower_and_the_encoder_profile(capsys) -> None:
    _, plain, _ = _plan(capsys, QWEN_VL, *BASE)
    limits = '{"image": 0, "video": 0}'
    code, got, _ = _plan(capsys, QWEN_VL, *BASE, "--limit-mm-per-prompt", limits)
    assert code == 0
    assert got["memory"]["weights_gib"] < plain["memory"]["weights_gib"]
    assert any("Encoder cache will be initialized" in line for line in plain["log_lines"])
    assert not any("Encoder cache" in line for line in got["log_lines"])
    assert "--limit-mm-per-prompt" in got["command"]


def test_dotted_limits_and_encoder_flags_in_a_pasted_command(capsys) -> None:
    pasted = [
        "vllm", "serve", QWEN_VL, "--max-model-len", "8192", "-tp", "2",
        "--limit-mm-per-prompt.image", "2", "--mm-encoder-tp-mode", "data",
        "--skip-mm-profiling", "--mm-processor-cache-gb", "1", "--mm-processor-cache-type", "shm",
    ]  # fmt: skip
    code, got, _ = _plan(capsys, "--gpu", "H100 SXM", "--offline", "--json", "--", *pasted)
    assert code == 0
    settings = got["settings"]
    assert settings["limit_mm_per_prompt"] == '{"image":{"count":2}}'
    assert settings["mm_encoder_tp_mode"] == "data" and settings["skip_mm_profiling"]
    notes = " ".join(got["notes"])
    assert "--skip-mm-profiling" in notes and "1.0 GiB of host memory (shm)" in notes


@pytest.mark.parametrize(
    "args",
    [
        [QWEN3_8B, "--max-lora-rank", "24", "--enable-lora"],
        [QWEN3_8B, "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"],
        [QWEN_VL, "--limit-mm-per-prompt", "image=2,video=0"],
        [QWEN_VL, "--mm-encoder-tp-mode", "split"],
        [QWEN_VL, "--mm-processor-cache-type", "disk"],
    ],
    ids=lambda a: " ".join(a[1:])[:50],
)
def test_malformed_lora_and_multimodal_values_exit_2_in_one_line(capsys, args) -> None:
    code, out, err = _plan(capsys, *args, "--gpu", "H100 SXM", "--offline")
    assert code == 2 and not out
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 2 and "Traceback" not in err
