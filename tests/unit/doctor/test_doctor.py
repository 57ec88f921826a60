"""The doctor on real cases, on each mechanism trap, and through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.cli import main
from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.situation import Context, nice_max_model_len
from oomguard.logs import parse_stream

ROWS = [
    json.loads(line)
    for line in Path("/work/shared/data/oom-cases.jsonl").read_text().splitlines()
    if line.strip()
]


def _diag(lines: list[str] | str, **context: object):  # type: ignore[no-untyped-def]
    if isinstance(lines, str):
        lines = lines.splitlines()
    return diagnose(parse_stream(lines), Context(**context))  # type: ignore[arg-type]


def _context(row: dict) -> Context:
    return Context(
        model=row["model"], gpu=row["gpu"], args={k: v for k, v in (row["settings"] or {}).items()}
    )


def test_accuracy_on_real_cases() -> None:
    with_context = sum(
        diagnose(parse_stream(r["log"].splitlines()), _context(r)).top.cause == r["label"]
        for r in ROWS
    )
    log_only = sum(
        (d := diagnose(parse_stream(r["log"].splitlines()))).top is not None
        and d.top.cause == r["label"]
        for r in ROWS
    )
    assert with_context / len(ROWS) >= 0.9
    assert log_only / len(ROWS) >= 0.85


def test_every_finding_has_evidence_and_fixes_are_concrete() -> None:
    for row in ROWS:
        diagnosis = diagnose(parse_stream(row["log"].splitlines()), _context(row))
        top = diagnosis.top
        assert top is not None
        assert top.evidence, row["source"]
        assert 0 < top.confidence <= 1
        data = diagnosis.to_dict()
        assert set(data["findings"][0]) >= {"cause", "confidence", "summary", "evidence", "fixes"}


def test_kv_capacity_gives_a_rounded_max_model_len() -> None:
    top = _diag(ROWS[3]["log"]).top
    assert top.cause == "kv_too_small_for_max_len"
    first = top.ordered_fixes()[0]
    assert (first.flag, first.value) == ("--max-model-len", "7200")
    assert "7,344" in first.why


@pytest.mark.parametrize(
    ("capacity", "block", "expected"),
    [(7344, 16, 7200), (6048, 16, 5888), (3664, 16, 3600), (409_600, 128, 405_504)],
)
def test_nice_max_model_len(capacity: int, block: int, expected: int) -> None:
    value = nice_max_model_len(capacity, block)
    assert value == expected
    assert value % block == 0 and 0.95 * capacity <= value < capacity


def test_estimated_max_model_len_is_used() -> None:
    line = (
        "ValueError: To serve at least one request with the model's max seq len (131072), (16.0 GiB KV cache is needed, "
        "which is larger than the available KV cache memory (5.5 GiB). Based on the available memory, the estimated "
        "maximum model length is 45056. Try increasing"
    )
    fix = _diag([line]).top.ordered_fixes()[0]
    assert (
        fix.flag == "--max-model-len" and int(fix.value) == 44544
    )  # ≤ 99 % of 45,056, a multiple of 512


# --- traps -----------------------------------------------------------------------------------


def _oom(tried: str, unalloc: str, total: str = "79.14 GiB", free: str = "500.00 MiB") -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a total capacity of {total} "
        f"of which {free} is free. Process 1 has 78.60 GiB memory in use. Of the allocated memory 70.00 GiB is allocated "
        f"by PyTorch, and {unalloc} is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
        "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


def test_expandable_hint_alone_is_not_fragmentation() -> None:
    d = _diag(["INFO Application startup complete.", _oom("2.00 GiB", "120.00 MiB")])
    causes = [f.cause for f in d.findings]
    assert "fragmentation" not in causes
    assert all("expandable" not in str(f.value) for f in d.top.fixes)


def test_large_reserved_unallocated_is_fragmentation() -> None:
    d = _diag(["INFO Application startup complete.", _oom("960.00 MiB", "2.22 GiB")])
    assert d.top.cause == "fragmentation"
    assert d.top.ordered_fixes()[0].value == "expandable_segments:True"


def test_never_expandable_segments_with_sleep_mode() -> None:
    d = _diag(
        [
            "non-default args: {'model': 'Qwen/Qwen2.5-1.5B-Instruct', 'enable_sleep_mode': True}",
            "INFO Application startup complete.",
            _oom("960.00 MiB", "2.22 GiB"),
        ]
    )
    assert d.top.cause == "fragmentation"
    for finding in d.findings:
        assert all("expandable_segments" not in str(f.value) for f in finding.fixes)
    assert any(f.flag == "--gpu-memory-utilization" for f in d.top.fixes)


def test_tiny_free_fraction_at_startup_is_a_leftover_process() -> None:
    d = _diag(
        [
            "ValueError: Free memory on device cuda:0 (15.65/79.18 GiB) on startup is less than desired GPU memory "
            "utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
        ]
    )
    assert d.top.cause == "leak_or_other_process"
    assert d.top.ordered_fixes()[0].flag == "action"
    assert d.findings[1].cause == "util_overshoot"


def test_expected_cotenant_is_budgeted_not_killed() -> None:
    line = (
        "ValueError: Free memory on device cuda:0 (15.65/79.18 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 71.27 GiB)."
    )
    d = _diag([line], expect_cotenant=True)
    assert d.top.cause == "util_overshoot"


def test_cotenant_gives_the_computed_utilization() -> None:
    # 17.3 GiB used by another process on a 79.18 GiB GPU → 61.88 GiB free → 0.78
    line = (
        "ValueError: Free memory on device cuda:0 (61.88/79.18 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 71.27 GiB)."
    )
    top = _diag([line]).top
    assert top.cause == "util_overshoot"
    fix = top.ordered_fixes()[0]
    assert (fix.flag, fix.value) == ("--gpu-memory-utilization", "0.78")
    assert "17.3 GiB" in fix.why


def test_no_cache_blocks_causes_are_told_apart() -> None:
    msg = "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine."
    assert (
        _diag([msg], args={"gpu_memory_utilization": 0.3}).top.cause == "kv_too_small_for_max_len"
    )
    assert _diag([msg], args={"max_num_seqs": 1024}).top.cause == "concurrency_or_batch"
    assert (
        _diag(
            [msg], args={"tensor_parallel_size": 8}, model="some-70B-model", gpu="8x A800 80GB"
        ).top.cause
        == "fragmentation"
    )
    heavy = ["INFO Model loading took 67.72 GiB memory and 30.0 seconds", msg]
    d = _diag(heavy, gpu="H100 80GB (79.18 GiB)")
    assert d.top.cause == "weights_dont_fit"
    assert any(
        f.flag in ("--tensor-parallel-size", "--quantization", "--model") for f in d.top.fixes
    )


def test_weights_that_exceed_the_gpu() -> None:
    d = _diag(ROWS[17]["log"])
    assert d.top.cause == "weights_dont_fit"
    d = _diag(ROWS[18]["log"], model="meta-llama/Llama-2-13b-hf", gpu="Tesla T4 16GB (14.58 GiB)")
    assert d.top.cause == "weights_dont_fit"
    assert "24" in d.top.summary or "12" in d.top.summary  # ~24 GiB of fp16 weights


def test_weights_that_fit_point_elsewhere() -> None:
    d = _diag(ROWS[30]["log"], model="Qwen2.5-72B FP8", gpu="H20 141GB (139.72 GiB)")
    assert d.top.cause == "other"


def test_graph_capture_phase() -> None:
    top = _diag(ROWS[10]["log"]).top
    assert top.cause == "cuda_graph"
    assert {f.flag for f in top.fixes} >= {"--enforce-eager", "--max-cudagraph-capture-size"}


def test_sampler_warmup_lowers_max_num_seqs() -> None:
    top = _diag(ROWS[13]["log"]).top
    assert top.cause == "concurrency_or_batch"
    assert ("--max-num-seqs", "256") in {(f.flag, f.value) for f in top.fixes}
    assert ("--gpu-memory-utilization", "0.85") in {(f.flag, f.value) for f in top.fixes}


def test_host_ram_kill_and_pinned_swap() -> None:
    assert _diag(ROWS[27]["log"]).top.cause == "cpu_ram"
    top = _diag(ROWS[28]["log"]).top
    assert top.cause == "cpu_ram" and top.ordered_fixes()[0].flag == "--swap-space"


def test_log_without_oom_is_not_diagnosed() -> None:
    rows = [
        json.loads(line)
        for line in Path("/work/shared/data/vllm-startup-logs.jsonl").read_text().splitlines()
        if line.strip()
    ]
    for row in rows:
        assert not _diag(row["raw"]).oom_found
    assert not _diag(["NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"]).oom_found


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_exit_codes_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "oom.log"
    log.write_text(ROWS[3]["log"])
    assert main(["doctor", str(log), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["cause"] == "kv_too_small_for_max_len"
    assert data["findings"][0]["fixes"][0] == {
        "flag": "--max-model-len",
        "value": "7200",
        "why": data["findings"][0]["fixes"][0]["why"],
    }
    assert data["parsed"]["values"]["kv_capacity_tokens"] == {"value": 7344, "line": 4}

    healthy = tmp_path / "ok.log"
    healthy.write_text(
        "INFO Available KV cache memory: 58.11 GiB\nINFO GPU KV cache size: 476,016 tokens\n"
    )
    assert main(["doctor", str(healthy)]) == 3
    assert main(["doctor", str(tmp_path / "missing.log")]) == 2
    assert main(["doctor", str(tmp_path)]) == 2
    capsys.readouterr()
    assert main(["doctor", str(log)]) == 0
    assert "--max-model-len 7200" in capsys.readouterr().out


def test_cli_lint(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "doctor",
                "--json",
                "--",
                "vllm",
                "serve",
                "some/model",
                "--gpu-memory-utilization",
                "1.0",
                "--enable-prefix-caching",
            ]
        )
        == 1
    )
    data = json.loads(capsys.readouterr().out)
    causes = {f["cause"] for f in data["findings"]}
    assert "util_overshoot" in causes and "other" in causes
    assert (
        main(
            [
                "doctor",
                "--command",
                "vllm serve some/model --gpu-memory-utilization 0.85",
                "--shared-prefix",
            ]
        )
        == 0
    )
    assert main(["doctor"]) == 2


def test_cli_lint_max_model_len(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "doctor",
                "--command",
                "vllm serve some/model --max-model-len 131072",
                "--p99-tokens",
                "6000",
                "--json",
            ]
        )
        == 1
    )
    data = json.loads(capsys.readouterr().out)
    fix = data["findings"][0]["fixes"][0]
    assert (
        fix["flag"] == "--max-model-len" and fix["value"] == "6656"
    )  # 6,000 × 1.1 rounded up to 256
