"""Reading prose: statements of a memory failure, hedged advice, logger levels, and the figures
a writer quotes (GPU, utilization, versions, `free` rows, memory still in use after sleep)."""

from __future__ import annotations

import pytest

from oomguard.logs import parse_stream
from oomguard.logs.lines import iter_records
from oomguard.logs.prose import is_statement, lever_cause, version_tuple


def test_records_keep_the_logger_level() -> None:
    records = list(
        iter_records(
            [
                "INFO 05-02 10:00:00 [core.py:70] Waiting for init message",
                "(EngineCore_DP0 pid=7) ERROR 05-02 10:00:01 [core.py:700] EngineCore failed",
                "Plain text from a reporter",
            ]
        )
    )
    assert [r.level for r in records] == ["INFO", "ERROR", ""]


@pytest.mark.parametrize(
    ("text", "stated"),
    [
        ("I receive OOM when the server starts", True),
        ("to avoid OOM, lower the utilization", False),
        ("If you are running out of memory, consider eager mode", False),
        ("it crashes if the node doesn't have enough free RAM", True),
        ("this can OOM engine init on a 24GB card", True),
        ("This may cause out-of-memory errors.", False),
    ],
)
def test_statements_and_hedges(text: str, stated: bool) -> None:
    parsed = parse_stream([text])
    assert parsed.has("said_oom") is stated


def test_quiet_logger_lines_are_not_statements() -> None:
    assert not is_statement("ran out of memory", 0, "WARNING")
    assert is_statement("ran out of memory", 0, "ERROR")


def test_figures_a_writer_quotes() -> None:
    parsed = parse_stream(
        [
            "Box: 8 A100-80G. The default gpu_memory_utilization is 0.90 and works; with "
            "--gpu-memory-utilization=1.0 it OOMs.",
            "The model is only 3.2G.",
        ]
    )
    assert parsed.get("said_gpu_name") == "A100 80GB"
    assert parsed.get("said_gpu_count") == 8
    assert parsed.get("said_util") == 1.0
    assert parsed.get("said_weights_gib") == pytest.approx(3.2)


def test_versions_skip_checkpoint_names_and_urls() -> None:
    parsed = parse_stream(
        [
            "https://hf.co/org/Model-8x7B-v0.1-AWQ works in vllm 0.4.0 but runs out of memory "
            "in 0.4.2."
        ]
    )
    assert parsed.get("said_version_old") == "0.4.0"
    assert parsed.get("said_version_new") == "0.4.2"
    assert version_tuple("0.8") == (0, 8, 0)


def test_free_rows_in_plain_kib() -> None:
    parsed = parse_stream(
        [
            "Mem:       65842516    64901232      301220       12044      640064      402188",
            "Swap:       2097148     2097148           0",
        ]
    )
    assert parsed.get("host_ram_total_gib") == pytest.approx(65842516 / 2**20)
    assert parsed.has("host_ram_low") and parsed.has("host_swap_full")


def test_memory_still_in_use_rising_over_steps() -> None:
    parsed = parse_stream(
        [
            "- after sleep: `3.02 GiB memory is still in use`",
            "- step 5: `9.87 GiB memory is still in use`",
            "- step 9: around `14-15 GiB memory is still in use`",
        ]
    )
    assert parsed.get("sleep_residual_first_gib") == pytest.approx(3.02)
    assert parsed.get("sleep_residual_gib") == pytest.approx(15.0)
    assert parsed.has("sleep_residual_growth")


@pytest.mark.parametrize(
    ("lever", "cause"),
    [
        ("--enforce-eager", "cuda_graph"),
        ("max_num_seqs", "concurrency_or_batch"),
        ("--max-model-len", "kv_too_small_for_max_len"),
        ("gpu_memory_utilization", "util_overshoot"),
        ("--swap-space", "cpu_ram"),
        ("expandable_segments", "fragmentation"),
    ],
)
def test_levers_map_to_causes(lever: str, cause: str) -> None:
    assert lever_cause(lever) == cause
