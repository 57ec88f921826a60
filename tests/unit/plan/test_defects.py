"""Defects a new user hit in `oomguard plan`, each pinned by the behaviour that replaced it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from oomguard.facts.catalogue import lookup_entry
from oomguard.plan.service import plan

LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oomguard.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_gpus_without_bf16_are_not_offered_bf16() -> None:
    """V100 (compute capability 7.0) loads a bf16 checkpoint as fp16: no alternative may say
    "8× V100 (bf16)"."""
    result = plan(LLAMA_70B, "RTX 4090", p99_tokens=8192, concurrency=16, allow_hub=False)
    titles = [a.title for a in result.alternatives]
    assert titles, "70B bf16 does not fit one RTX 4090: alternatives are expected"
    for alt in result.alternatives:
        c = alt.candidate
        if c is None or c.weights_key != "native":
            continue
        if c.gpu.compute_capability and float(c.gpu.compute_capability) < 8.0:
            assert "bf16" not in alt.title.split("(", 1)[1].split(",")[0] or "no bf16" in alt.title
            assert "fp16" in alt.title
    assert not any("V100" in t and "(bf16" in t for t in titles)


def test_config_json_path_serves_the_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    entry = lookup_entry("Qwen/Qwen3-8B")
    assert entry is not None
    (model_dir / "config.json").write_text(json.dumps(entry.config))
    result = plan(str(model_dir / "config.json"), "L40S", allow_hub=False)
    assert result.command.split()[:3] == ["vllm", "serve", str(model_dir)]
    assert "config.json" not in result.command
    relative = _cli("plan", "my-model/config.json", "--gpu", "L40S", "--json", cwd=tmp_path)
    assert json.loads(relative.stdout)["command"].split()[:3] == ["vllm", "serve", "my-model"]


def test_models_listing_is_not_cut_when_piped() -> None:
    out = _cli("models")  # stdout is a pipe here, as in `oomguard models | cat`
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    assert lines[0].split("\t")[0] == "model"
    ids = {line.split("\t")[0] for line in lines[1:]}
    assert "meta-llama/Llama-3.1-70B-Instruct" in ids
    assert not any("…" in line for line in lines)
    gpus = _cli("gpus").stdout.splitlines()
    assert gpus[0].startswith("GPU\t") and not any("…" in line for line in gpus)


def test_unknown_model_hint_names_no_missing_flag() -> None:
    out = _cli("plan", "someone/not-a-model", "--gpu", "L4", "--offline")
    assert out.returncode == 2
    message = out.stderr.strip()
    assert "--model" not in message  # plan takes the model as its first argument
    assert "config.json" in message and "--offline" in message


PROBE = """
import sys
from oomguard.cli import main
main(sys.argv[1:])
print("LOADED=" + ",".join(m for m in ("aiohttp", "oomguard.logs", "oomguard.doctor") \
if m in sys.modules), file=sys.stderr)
"""


def test_plan_imports_only_what_planning_needs() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            "plan",
            LLAMA_70B,
            "--gpu",
            "RTX 4090",
            "--p99-tokens",
            "8192",
            "--concurrency",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = next(x for x in out.stderr.splitlines() if x.startswith("LOADED="))
    assert line == "LOADED="


def test_data_parallel_counts_every_gpu_and_sizes_each_rank() -> None:
    """TP 2 × DP 8 with expert parallelism is 16 GPUs; each DP rank is its own engine and
    holds 1/8 of the workload; experts are split over all 16 ranks."""
    result = plan(
        "deepseek-ai/DeepSeek-V3",
        "H200",
        p99_tokens=8192,
        concurrency=512,
        tensor_parallel_size=2,
        data_parallel_size=8,
        enable_expert_parallel=True,
        allow_hub=False,
    )
    c = result.plan
    assert c.gpus_used == 16 and c.parallel_label == "TP 2 × DP 8 (EP)"
    data = result.to_dict()
    assert data["gpu"]["count"] == 16
    assert c.settings.max_num_seqs == 64  # --max-num-seqs is per DP rank: 512 / 8
    assert c.serve is not None
    assert c.serve.required_concurrency == 64 * 1.1
    assert "--data-parallel-size 8" in result.command
    assert "--enable-expert-parallel" in result.command
    assert "--tensor-parallel-size 2" in result.command
    # experts over 16 ranks, attention over TP 2: far less than the whole checkpoint per GPU
    tp2_only = plan(
        "deepseek-ai/DeepSeek-V3", "H200", tensor_parallel_size=2, gpu_count=16, allow_hub=False
    ).plan.prediction.weights.value_bytes
    assert c.prediction.weights.value_bytes < tp2_only / 4


def test_data_parallel_header_and_alternatives_name_all_gpus() -> None:
    from io import StringIO

    from rich.console import Console

    from oomguard.plan.render import render

    result = plan(
        "deepseek-ai/DeepSeek-V3",
        "H100",
        p99_tokens=8192,
        concurrency=256,
        data_parallel_size=8,
        enable_expert_parallel=True,
        allow_hub=False,
    )
    out = StringIO()
    render(result, Console(file=out, width=100, highlight=False))
    text = out.getvalue()
    assert "on 8× H100" in text.splitlines()[0] and "DP 8" in text.splitlines()[0]
    assert "32 per data-parallel rank" in text
    labels = [a.title for a in result.alternatives if a.candidate is not None]
    for alt in result.alternatives:
        if alt.candidate is None or alt.kind not in ("more_gpus", "larger_gpu"):
            continue
        c = alt.candidate
        assert c.settings.data_parallel_size == 8
        assert alt.title.startswith(f"{c.gpus_used}× ")
        assert c.gpus_used == c.settings.tensor_parallel_size * 8
    assert any(t.startswith("16× H100") and "TP 2 × DP 8" in t for t in labels)


def test_pasted_data_parallel_command_is_read() -> None:
    result = plan(
        command="vllm serve deepseek-ai/DeepSeek-V3 --data-parallel-size 8 "
        "--enable-expert-parallel",
        gpu="H200",
        allow_hub=False,
    )
    assert result.plan.gpus_used == 8
    assert result.plan.settings.enable_expert_parallel
