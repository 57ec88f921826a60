"""Defects a new user hit in `oomguard plan`, each pinned by the behaviour that replaced it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from oomguard.api import plan
from oomguard.facts.catalogue import lookup_entry

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
print("LOADED=" + ",".join(m for m in ("aiohttp", "oomguard.logs", "oomguard.doctor") if m in sys.modules), file=sys.stderr)
"""


def test_plan_imports_only_what_planning_needs() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "plan", LLAMA_70B, "--gpu", "RTX 4090",
         "--p99-tokens", "8192", "--concurrency", "16"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    line = next(x for x in out.stderr.splitlines() if x.startswith("LOADED="))
    assert line == "LOADED="
