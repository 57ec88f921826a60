"""``oomguard plan`` with context parallelism, KV offloading, sleep mode and CUDA-graph flags
(docs/memory-model.md §14): the flags as vLLM takes them, the verdicts and the notes."""

from __future__ import annotations

import json

import pytest

from oomguard.cli import main

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict, str]:
    code = main(["plan", "--offline", "--no-calibration", "--json", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else {}), err


def test_dcp_doubles_concurrency_on_the_same_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--gpu", "H100", "-tp", "2", "--max-model-len", "32768", "--vllm-version", "0.32"]
    code, plain, _ = _plan(capsys, LLAMA_8B, *args)
    code_dcp, dcp, _ = _plan(capsys, LLAMA_8B, *args, "-dcp", "2")
    assert code == code_dcp == 0
    assert dcp["num_blocks"] == plain["num_blocks"]
    assert dcp["max_concurrency"] == pytest.approx(2 * plain["max_concurrency"], abs=0.01)
    assert dcp["gpu"]["count"] == plain["gpu"]["count"] == 2
    assert "--decode-context-parallel-size 2" in dcp["command"]


def test_pcp_counts_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _plan(
        capsys, LLAMA_8B, "--gpu", "H100", "--gpu-count", "2", "-tp", "2", "-pcp", "2"
    )
    assert code == 2
    assert "tensor × pipeline × prefill-context × data parallel = 4 GPUs, but only 2" in err


def test_pasted_offload_and_sleep_are_priced_and_checked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = _plan(
        capsys,
        "--gpu",
        "H100",
        "--host-memory-gib",
        "64",
        "--",
        "vllm",
        "serve",
        LLAMA_8B,
        "--kv-offloading-size",
        "100",
        "--enable-sleep-mode",
    )
    assert code == 0
    notes = "\n".join(out["notes"])
    assert (
        "KV offload pins 100.00 GiB of host memory: does NOT fit in the host's 64.00 GiB" in notes
    )
    assert "the GPU KV pool is sized as without it" in notes
    assert "sleep mode:" in notes and "level 1 pins" in notes
    assert not any("not modelled" in n for n in out["notes"])


def test_compilation_config_and_estimate_switch(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", raising=False)
    _, on, _ = _plan(capsys, LLAMA_8B, "--gpu", "H100")
    monkeypatch.setenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "0")
    _, off, _ = _plan(capsys, LLAMA_8B, "--gpu", "H100")
    assert off["estimates"]["cudagraph"]["value_gib"] == 0
    assert on["estimates"]["cudagraph"]["value_gib"] > 0
    assert off["memory"]["kv_cache_gib"] > on["memory"]["kv_cache_gib"]
    monkeypatch.delenv("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS")
    _, none, _ = _plan(capsys, LLAMA_8B, "--gpu", "H100", "-cc", '{"cudagraph_mode": "NONE"}')
    assert none["estimates"]["cudagraph"]["value_gib"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-cc", "{cudagraph_mode: NONE}"], "error: --compilation-config is not valid JSON"),
        (["-tp", "4", "-dcp", "3"], "error: tp_size=4 must be divisible by dcp_size=3"),
        (["--kv-transfer-config", "{}"], "error: --kv-transfer-config names no kv_connector"),
        (["--cudagraph-capture-sizes", "1 2", "--max-cudagraph-capture-size", "8"], "consistent"),
    ],
)
def test_malformed_values_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = _plan(capsys, LLAMA_8B, "--gpu", "H100", "--gpu-count", "4", *args)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
