"""One Workload, with its flags parsed the same way by plan, the doctor's lint and bench."""

from __future__ import annotations

import json

import pytest

from oomguard.cli import main
from oomguard.errors import BadInput
from oomguard.units import GIB
from oomguard.workload import Workload, shared_prefix_tokens, stated_workload, token_count


def test_token_counts_read_like_vllm() -> None:
    assert token_count("16k", "--p99-tokens") == 16000
    assert token_count("16K", "--p99-tokens") == 16384
    assert token_count(None, "--p99-tokens") is None
    with pytest.raises(BadInput, match="--p99-tokens -5"):
        token_count("-5", "--p99-tokens")


def test_shared_prefix_is_a_fraction_or_tokens() -> None:
    assert shared_prefix_tokens("0.25", 8000) == 2000
    assert shared_prefix_tokens("2k", 8000) == 2000
    assert shared_prefix_tokens(None, None) == 0
    assert shared_prefix_tokens("2048", None) == 2048  # a count needs no P99
    with pytest.raises(BadInput, match="fraction of the P99, which is not given"):
        shared_prefix_tokens("0.3", None)
    with pytest.raises(BadInput, match="longer than --p99-tokens"):
        shared_prefix_tokens("9000", 8000)


def test_stated_workload_keeps_what_was_not_said_at_zero() -> None:
    w = stated_workload("16k", None, "0.5", headroom_gib=2)
    assert w == Workload(
        p99_tokens=16000,
        concurrency=0,
        shared_prefix_tokens=8000,
        headroom_bytes=2 * GIB,
        stated=True,
    )
    assert not stated_workload().stated
    with pytest.raises(BadInput, match="--concurrency 0"):
        stated_workload(concurrency=0)


def test_doctor_lint_takes_the_workload_flags_plan_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    command = "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 131072"
    argv = [
        "doctor",
        "--json",
        "--gpu",
        "H100",
        "--p99-tokens",
        "4k",
        "--shared-prefix",
        "0.5",
        "--command",
        command,
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert any("P99" in f["summary"] for f in data["findings"])  # 131072 is far above 4k
