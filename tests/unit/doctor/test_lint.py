"""The lint (``oomguard doctor --command``): advice a new user can follow safely."""

from __future__ import annotations

import json

import pytest

from oomguard.cli import main
from oomguard.doctor.lint import lint_command
from oomguard.errors import BadInput
from oomguard.facts.gpus import find_gpu
from oomguard.facts.resolve import resolve_model
from oomguard.memory.engine import EngineSettings, predict
from oomguard.units import GIB
from oomguard.workload import Workload

QWEN_32B = "vllm serve Qwen/Qwen3-32B --max-model-len 32768"


def _pool_tokens(model: str, gpu: str, **settings: object) -> int:
    prediction = predict(
        resolve_model(model, allow_hub=False), find_gpu(gpu), EngineSettings(**settings)
    )  # type: ignore[arg-type]
    return prediction.kv_cache_tokens


@pytest.mark.parametrize("p99", [4096, 8192, 16384, 32768])
def test_qwen3_32b_at_32k_gets_max_num_seqs_the_pool_serves_at_the_p99(p99: int) -> None:
    report = lint_command(QWEN_32B, gpu="A100 80GB", workload=Workload(p99_tokens=p99))
    seqs = [f for f in report.findings if f.flag_changes().get("--max-num-seqs")]
    assert seqs, [f.summary for f in report.findings]
    value = int(str(seqs[0].flag_changes()["--max-num-seqs"]))
    pool = _pool_tokens("Qwen/Qwen3-32B", "A100 80GB", max_model_len=32768)
    assert value >= 1
    assert value * p99 <= pool  # the pool holds that many P99 requests at once
    if p99 < 32768:
        assert value > 1  # paged KV: short requests share the pool, not one per max_model_len


def test_without_a_workload_the_default_sequences_are_not_judged() -> None:
    report = lint_command(QWEN_32B, gpu="A100 80GB")
    assert not [f for f in report.findings if "--max-num-seqs" in f.flag_changes()]


def test_llama_8b_at_16k_on_an_h100_raises_no_kv_warning() -> None:
    for workload in (None, Workload(p99_tokens=12000), Workload(p99_tokens=4000, concurrency=64)):
        report = lint_command(
            "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 16384",
            gpu="H100",
            workload=workload,
        )
        assert not report.problems, [f.summary for f in report.problems]
        assert not [f for f in report.findings if f.cause == "kv_too_small_for_max_len"]


def test_a_workload_the_pool_cannot_hold_is_kv_too_small() -> None:
    report = lint_command(
        QWEN_32B, gpu="A100 80GB", workload=Workload(p99_tokens=16384, concurrency=32)
    )
    top = report.problems[0]
    assert top.cause == "kv_too_small_for_max_len" and "not the 32" in top.summary


def test_a_command_that_will_not_start_is_a_problem_with_a_fitting_length() -> None:
    report = lint_command("vllm serve meta-llama/Llama-3.1-8B-Instruct", gpu="L4")
    top = report.problems[0]
    assert top.cause == "kv_too_small_for_max_len" and "will not start" in top.summary
    length = int(str(top.flag_changes()["--max-model-len"]))
    pool = _pool_tokens(LLAMA := "meta-llama/Llama-3.1-8B-Instruct", "L4", max_model_len=length)
    assert length <= 0.9 * pool and LLAMA


@pytest.mark.parametrize(
    ("typo", "real"),
    [
        ("--max-num-seq", "--max-num-seqs"),
        ("--gpu-memory-utilisation", "--gpu-memory-utilization"),
        ("--tensor-paralel-size", "--tensor-parallel-size"),
        ("--max_model_length", "--max-model-len"),
    ],
)
def test_a_misspelt_flag_names_the_real_one(typo: str, real: str) -> None:
    with pytest.raises(BadInput) as raised:
        lint_command(f"vllm serve Qwen/Qwen3-8B {typo} 64")
    assert f"did you mean {real}?" in raised.value.one_line()


def test_full_utilization_and_an_unbudgeted_cotenant() -> None:
    report = lint_command(
        "vllm serve Qwen/Qwen3-8B --gpu-memory-utilization 1.0",
        gpu="L40S",
        workload=Workload(headroom_bytes=8 * GIB),
    )
    causes = [f.cause for f in report.problems]
    assert causes.count("util_overshoot") == 2
    cotenant = next(f for f in report.problems if "co-tenant" in f.summary)
    util = float(str(cotenant.flag_changes()["--gpu-memory-utilization"]))
    total = find_gpu("L40S").total_bytes / 2**30
    assert util * total + 8 <= total - 1.0 + 1e-9


def test_cli_exit_codes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "doctor",
                "--json",
                "--gpu",
                "H100",
                "--",
                "vllm",
                "serve",
                "meta-llama/Llama-3.1-8B-Instruct",
                "--max-model-len",
                "16384",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["findings"] == [] and data["notes"] == []
    assert (
        main(["doctor", "--command", "vllm serve Qwen/Qwen3-8B --gpu-memory-utilization 1.0"]) == 1
    )
    out = capsys.readouterr().out
    assert "--gpu-memory-utilization 0.90" in out and "pass --gpu" in out
    assert main(["doctor", "--command", "vllm serve Qwen/Qwen3-8B --max-num-seq 8"]) == 2
    assert "did you mean --max-num-seqs?" in capsys.readouterr().err
    # a tip does not fail the command
    assert main(["doctor", "--command", "vllm serve Qwen/Qwen3-8B --enable-prefix-caching"]) == 0
    assert "prefix caching" in capsys.readouterr().out


def test_tips_are_labelled_and_never_followed_by_no_problems_found(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # two tips (max_num_seqs above what the pool serves at the P99, max_model_len far above it)
    code = main(["doctor", "--command", QWEN_32B, "--gpu", "A100 80GB", "--p99-tokens", "8192"])
    out = capsys.readouterr().out
    assert code == 0  # tips are worth changing, not wrong
    assert "No problems found" not in out
    assert out.count("[concurrency_or_batch, tip,") == 1
    assert out.count("[max_model_len_above_p99, tip,") == 1
    assert "2 tips, no problem" in out
    # a problem says how many were found and fails the command
    assert (
        main(["doctor", "--command", "vllm serve Qwen/Qwen3-8B --gpu-memory-utilization 1.0"]) == 1
    )
    out = capsys.readouterr().out
    assert "1 problem found in this command." in out and "No problems found" not in out
    # nothing to say is still said plainly
    assert (
        main(
            [
                "doctor",
                "--gpu",
                "H100",
                "--",
                "vllm",
                "serve",
                "meta-llama/Llama-3.1-8B-Instruct",
                "--max-model-len",
                "16384",
            ]
        )
        == 0
    )
    assert "No problems found in this command." in capsys.readouterr().out


def test_the_lint_prices_lora_and_multimodal_flags_as_vllm_reads_them() -> None:
    base = "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 8192"
    assert not lint_command(base, gpu="L4").problems
    # 16 adapters of rank 256 preallocate about 20 GiB of buffers: no room left for the KV cache
    heavy = lint_command(base + " --enable-lora --max-loras 16 --max-lora-rank 256", gpu="L4")
    assert heavy.problems
    assert not lint_command(base + " --enable-lora --max-loras 2", gpu="L4").problems
    limits = " --limit-mm-per-prompt.image 2 --mm-encoder-tp-mode data --skip-mm-profiling"
    assert not lint_command(base + limits, gpu="L4").problems
    with pytest.raises(BadInput, match="not JSON"):
        lint_command(base + " --limit-mm-per-prompt image=2", gpu="L4")
