"""``oomguard doctor --lint`` (a pasted command) takes the flags of docs/memory-model.md §14 as
vLLM does: priced, not reported as unknown or unmodelled; a value vLLM refuses is bad input."""

from __future__ import annotations

import pytest

from oomguard.cli import main

COMMAND = [
    "vllm",
    "serve",
    "meta-llama/Llama-3.1-8B-Instruct",
    "-tp",
    "2",
    "-dcp",
    "2",
    "--kv-offloading-size",
    "32",
    "--enable-sleep-mode",
    "-cc",
    '{"cudagraph_mode": "PIECEWISE"}',
    "--cudagraph-capture-sizes",
    "1",
    "2",
    "4",
]


def test_lint_accepts_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--gpu", "H100", "--", *COMMAND])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "not modelled" not in out and "not vLLM flags" not in out


def test_lint_refuses_what_vllm_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["doctor", "--gpu", "H100", "--", *COMMAND[:5], "-dcp", "3"])
    _, err = capsys.readouterr()
    assert code == 2
    assert err.strip() == (
        "error: tp_size=2 must be divisible by dcp_size=3 — DCP reuses the tensor-parallel "
        "ranks: pick a DCP size that divides --tensor-parallel-size"
    )
