"""Lockstep simulator: replay a burst through the guard's own admission code, against a model
of vLLM's scheduler, and print the throughput ceiling of each admission policy per mix.

The engine model is vLLM V1's on one pool: every running sequence gains one token per step;
waiting requests are scheduled first come first served when the free blocks hold their
prompt (or the recompute of a preempted one); a running sequence that needs a block when none
is free preempts the most recently scheduled one, which is recomputed later. A step lasts
``step_s(b) = decode_base_s + decode_per_seq_s × b`` plus ``prefill_s_per_token`` per prefill
token (defaults measured on the integration scenario's ``medium-llama`` with vLLM on CPU,
tests/integration/README.md).

Three ways to run the same burst:

* **direct**: every request reaches vLLM ``preprocess_s + intake_s`` after the burst starts;
* **guard**: the real :class:`~oomguard.guard.admission.BackendAdmission`, queue and
  :func:`~oomguard.guard.queue.admit_waiting` decide; an admitted request reaches vLLM after
  ``forward_s + preprocess_s + intake_s``; the guard sees every step's progress ``observe_s`` late
  and polls vLLM's metrics every ``poll_s``;
* **oracle**: a zero-preemption scheduler with perfect knowledge of every request's remaining
  length admits (in any order) what keeps the exact future peak inside the pool.

Printed per mix: steps, makespan, throughput, preemptions, and the ratios guard/direct (the
simulated ceiling of the guard's admission) and oracle/direct. ``--compare`` also runs the
guard with variants of its settings, to show what each change does.

Run: ``.venv/bin/python bench/guard_sim.py [--mix NAME] [--compare] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import json
import sys
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))
sys.path.insert(0, str(ROOT / "src"))

from burst import MIXES, RequestShape  # noqa: E402

from oomguard.guard.admission import (  # noqa: E402
    AdmissionSettings,
    BackendAdmission,
    RequestCost,
)
from oomguard.guard.output_lengths import OutputLengths, length_class  # noqa: E402
from oomguard.guard.projection import (  # noqa: E402
    Footprint,
    RequestProgress,
    blocks_for_tokens,
    projected_peak_blocks,
)
from oomguard.guard.queue import AdmissionQueue, Waiter, admit_waiting, run_now  # noqa: E402
from oomguard.guard.shared import SharedAdmission, wants_for  # noqa: E402


@dataclass(frozen=True)
class EngineModel:
    """The pool and the step costs (seconds) of the simulated vLLM."""

    capacity_blocks: int = 15  # 16 blocks, one of them vLLM's null block
    block_size: int = 128
    decode_base_s: float = 4.5e-3
    decode_per_seq_s: float = 0.2e-3
    prefill_s_per_token: float = 0.19e-3
    token_budget: int = 2048
    preprocess_s: float = 0.004
    # Added time from a request's send to its arrival in the engine's queue: the API server's
    # intake when it is busy streaming (0 on an idle server; seconds on a loaded CPU server).
    intake_s: float = 0.0
    forward_s: float = 0.003  # the guard's own work per request (incl. /tokenize)
    observe_s: float = 0.006  # output processing, network: how late the guard sees a step
    poll_s: float = 0.25


@dataclass
class _Seq:
    index: int
    shape: RequestShape
    arrive_s: float
    generated: int = 0
    tokens_held: int = 0  # tokens whose KV is allocated
    scheduled: bool = False
    preemptions: int = 0
    done_s: float | None = None

    @property
    def blocks(self) -> int:
        return 0

    def need_tokens(self) -> int:
        return self.shape.prompt_tokens + self.generated


@dataclass
class RunResult:
    """One simulated burst."""

    label: str
    steps: int
    makespan_s: float
    tokens: int
    preemptions: int
    peak_blocks: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s else 0.0


Admit = Callable[[list[_Seq], list[_Seq], int, int], list[_Seq]]


class Engine:
    """vLLM's scheduler on one pool, stepped in lockstep (see the module docstring)."""

    def __init__(self, model: EngineModel) -> None:
        self.m = model
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.used_blocks = 0
        self.preemptions = 0
        self.peak_blocks = 0
        self.steps = 0

    def _blocks(self, tokens: int) -> int:
        return blocks_for_tokens(tokens, self.m.block_size)

    def _free(self, seq: _Seq) -> None:
        self.used_blocks -= self._blocks(seq.tokens_held)
        seq.tokens_held = 0

    def _grow(self) -> None:
        """Allocate the next token's slot for every running sequence, preempting the most
        recently scheduled one when the pool is full (vLLM's FCFS recompute)."""
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            extra = self._blocks(seq.tokens_held + 1) - self._blocks(seq.tokens_held)
            while extra and self.used_blocks + extra > self.m.capacity_blocks:
                victim = self.running.pop()
                self._free(victim)
                victim.scheduled = False
                victim.preemptions += 1
                self.preemptions += 1
                self.waiting.appendleft(victim)
                if victim is seq:
                    break
            else:
                self.used_blocks += extra
                seq.tokens_held += 1
                i += 1

    def step(self, now_s: float, admit: Admit | None = None) -> tuple[float, list[_Seq]]:
        """One engine step at ``now_s``: returns its duration and the sequences it finished."""
        self._grow()
        prefill = 0
        budget = self.m.token_budget
        candidates = list(self.waiting)
        chosen = admit(candidates, self.running, self.used_blocks, budget) if admit else candidates
        for seq in chosen:
            need = self._blocks(seq.need_tokens() + 1)
            tokens = seq.need_tokens()
            if self.used_blocks + need > self.m.capacity_blocks or tokens > budget:
                if admit is None:
                    break  # FCFS: the head waits, and so does everything behind it
                continue
            self.waiting.remove(seq)
            self.used_blocks += need
            seq.tokens_held = tokens + 1
            seq.scheduled = True
            self.running.append(seq)
            prefill += tokens
            budget -= tokens
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        m = self.m
        duration = (
            m.decode_base_s
            + m.decode_per_seq_s * len(self.running)
            + m.prefill_s_per_token * prefill
        )
        finished = []
        for seq in list(self.running):
            seq.generated += 1
            if seq.generated >= seq.shape.output_tokens:
                self.running.remove(seq)
                self._free(seq)
                seq.done_s = now_s + duration
                finished.append(seq)
        self.steps += 1
        return duration, finished


def run_direct(shapes: Sequence[RequestShape], m: EngineModel) -> RunResult:
    """Every request straight into vLLM."""
    engine = Engine(m)
    seqs = [_Seq(i, s, m.preprocess_s + m.intake_s) for i, s in enumerate(shapes)]
    return _drive(engine, seqs, m, "direct")


def run_oracle(shapes: Sequence[RequestShape], m: EngineModel) -> RunResult:
    """A zero-preemption scheduler that knows every request's exact remaining length."""
    bs = m.block_size

    def admit(waiting: list[_Seq], running: list[_Seq], _used: int, budget: int) -> list[_Seq]:
        fps = [
            Footprint(s.tokens_held, s.shape.prompt_tokens + s.shape.output_tokens, _left(s))
            for s in running
        ]
        chosen = []
        for seq in waiting:
            fp = Footprint(
                seq.shape.prompt_tokens + 1,
                seq.shape.prompt_tokens + seq.shape.output_tokens,
                seq.shape.output_tokens,
            )
            if projected_peak_blocks([*fps, fp], bs) <= m.capacity_blocks:
                fps.append(fp)
                chosen.append(seq)
        return chosen

    engine = Engine(m)
    seqs = [_Seq(i, s, m.preprocess_s + m.intake_s) for i, s in enumerate(shapes)]
    return _drive(engine, seqs, m, "oracle", admit)


def _left(seq: _Seq) -> int:
    return seq.shape.output_tokens - seq.generated


def _drive(
    engine: Engine, seqs: list[_Seq], m: EngineModel, label: str, admit: Admit | None = None
) -> RunResult:
    pending = sorted(seqs, key=lambda s: s.arrive_s)
    now = 0.0
    done = 0
    while done < len(seqs):
        while pending and pending[0].arrive_s <= now:
            engine.waiting.append(pending.pop(0))
        if not engine.running and not engine.waiting:
            now = pending[0].arrive_s
            continue
        duration, finished = engine.step(now, admit)
        now += duration
        done += len(finished)
        if engine.steps > 1_000_000:
            raise RuntimeError("simulation does not finish")
    return _result(label, engine, seqs, m)


def _result(label: str, engine: Engine, seqs: list[_Seq], m: EngineModel) -> RunResult:
    makespan = max(s.done_s or 0.0 for s in seqs) + m.observe_s
    tokens = sum(s.shape.output_tokens for s in seqs)
    return RunResult(label, engine.steps, makespan, tokens, engine.preemptions, engine.peak_blocks)


def _step_observed(
    engine: Engine, now_s: float, m: EngineModel, push: Callable[[float, str, _Seq, int], None]
) -> float:
    """One engine step; the guards see its progress and finishes ``observe_s`` later. Returns
    the time after the step."""
    duration, finished_seqs = engine.step(now_s)
    now_s += duration
    for seq in engine.running:
        push(now_s + m.observe_s, "progress", seq, seq.generated)
    for seq in finished_seqs:
        push(now_s + m.observe_s, "finish", seq, seq.generated)
    if engine.steps > 1_000_000:
        raise RuntimeError("simulation does not finish")
    return now_s


@dataclass(order=True)
class _Event:
    at_s: float
    order: int
    kind: str = field(compare=False)
    seq: _Seq = field(compare=False)
    generated: int = field(default=0, compare=False)


def _cost(shape: RequestShape, lengths: OutputLengths | None) -> RequestCost:
    """The request's cost as the gateway builds it (its class's learned length planned)."""
    route = "chat" if shape.chat else "completions"
    cls = length_class("sim", route, None, shape.prompt_tokens)
    cost = RequestCost(shape.prompt_tokens, shape.max_tokens, trackable=True, length_class=cls)
    if lengths is None:
        return cost
    return replace(cost, length_plan=lengths.plan(cls, shape.max_tokens))


def run_guard(
    shapes: Sequence[RequestShape],
    m: EngineModel,
    settings: AdmissionSettings,
    max_head_bypass: int = 8,
    label: str = "guard",
    lengths: OutputLengths | None = None,
) -> RunResult:
    """The burst through the guard's real admission code (see the module docstring);
    ``lengths``: learn output lengths as the gateway does (None: plan every request at its
    max_tokens)."""
    adm = BackendAdmission(settings)
    tightens = [0]
    adm.set_capacity(m.capacity_blocks + 1, m.block_size, prefix_caching=True)
    queue = AdmissionQueue(10_000, 10**12)
    engine = Engine(m)
    seqs = [_Seq(i, s, 0.0) for i, s in enumerate(shapes)]
    handles: dict[int, RequestProgress] = {}
    events: list[_Event] = []
    counter = itertools.count()
    now = 0.0

    def push(at_s: float, kind: str, seq: _Seq, generated: int = 0) -> None:
        heapq.heappush(events, _Event(at_s, next(counter), kind, seq, generated))

    async def place(waiter: Waiter) -> bool:
        seq: _Seq = waiter.data
        cost = _cost(seq.shape, lengths)
        if not adm.can_admit(cost, now):
            return False
        handles[seq.index] = adm.reserve(cost, now)
        push(now + m.forward_s + m.preprocess_s + m.intake_s, "arrive", seq)
        return True

    def feedback() -> None:
        if lengths is None:
            return
        if adm.tighten_count > tightens[0]:
            lengths.tighten(now)
        else:
            lengths.relax(now)
        tightens[0] = adm.tighten_count

    for seq in seqs:
        queue.push(Waiter(0, seq.shape.prompt_tokens + seq.shape.max_tokens, 0.0, seq))
    run_now(admit_waiting(queue, place, max_head_bypass))
    done = 0
    next_poll = 0.0
    engine_now = 0.0
    while done < len(seqs):
        # Deliver what happened up to the engine's clock, then run one engine step.
        while events and events[0].at_s <= engine_now:
            ev = heapq.heappop(events)
            now = ev.at_s
            if ev.kind == "arrive":
                engine.waiting.append(ev.seq)
                continue
            handle = handles[ev.seq.index]
            finished = ev.kind == "finish"
            adm.note_progress(handle, 0, ev.generated, finished, now, ev.seq.shape.prompt_tokens)
            if finished:
                if lengths is not None:
                    lengths.observe(
                        _cost(ev.seq.shape, None).length_class or (),
                        ev.generated,
                        ev.seq.shape.max_tokens,
                    )
                adm.release(handle, now)
                done += 1
            run_now(admit_waiting(queue, place, max_head_bypass))
        now = engine_now
        if now >= next_poll:
            usage = engine.used_blocks / m.capacity_blocks
            adm.observe(usage, float(engine.preemptions), now)
            feedback()
            next_poll = now + m.poll_s
            run_now(admit_waiting(queue, place, max_head_bypass))
        if not engine.running and not engine.waiting:
            if not events:
                if done < len(seqs) and queue.depth:
                    engine_now += 0.01  # the guard's periodic pump
                    now = engine_now
                    run_now(admit_waiting(queue, place, max_head_bypass))
                    continue
                break
            engine_now = max(engine_now, events[0].at_s)
            continue
        engine_now = _step_observed(engine, engine_now, m, push)
    return _result(label, engine, seqs, m)


_BACKEND = "http://simulated-vllm"


@dataclass
class _Replica:
    """One guard replica of the simulated burst: its admission, queue and ledger client."""

    adm: BackendAdmission
    queue: AdmissionQueue
    shared: SharedAdmission
    next_sync_s: float = 0.0
    next_poll_s: float = 0.0
    refused: Waiter | None = None


def run_replicas(
    shapes: Sequence[RequestShape],
    m: EngineModel,
    settings: AdmissionSettings,
    redis_url: str,
    replicas: int = 3,
    max_head_bypass: int = 8,
    label: str = "guard x3 on Redis",
) -> RunResult:
    """The burst spread round-robin over ``replicas`` guards that share the real capacity
    ledger on a real Redis (each admits locally within what it keeps; capacity moves at their
    synchronisations, every 0.1 s or 0.02 s while someone waits, and on demand)."""
    loop = asyncio.new_event_loop()
    prefix = f"sim{uuid.uuid4().hex}"
    reps: list[_Replica] = []
    for i in range(replicas):
        adm = BackendAdmission(settings)
        adm.set_capacity(m.capacity_blocks + 1, m.block_size, prefix_caching=True)
        shared = SharedAdmission(
            redis_url,
            prefix,
            lease_s=1e6,
            snapshot_max_age_s=1e6,
            timeout_s=5.0,
            replicas=replicas,
            max_head_bypass=max_head_bypass,
            settle_s=0.0,
        )
        shared.backends = lambda adm=adm: [(_BACKEND, adm)]
        reps.append(_Replica(adm, AdmissionQueue(10_000, 10**12), shared, 0.0, i * m.poll_s / 3))
    try:
        for r in reps:
            loop.run_until_complete(r.shared.snapshot(_BACKEND, r.adm, 0))
        for _ in range(3):  # every replica starts with its fair share
            for r in reps:
                loop.run_until_complete(r.shared.sync_backend(_BACKEND, r.adm))
        return _drive_replicas(shapes, m, reps, loop, max_head_bypass, label)
    finally:
        for r in reps:
            loop.run_until_complete(r.shared.stop())
        loop.close()


def _drive_replicas(
    shapes: Sequence[RequestShape],
    m: EngineModel,
    reps: list[_Replica],
    loop: asyncio.AbstractEventLoop,
    max_head_bypass: int,
    label: str,
) -> RunResult:
    engine = Engine(m)
    seqs = [_Seq(i, s, 0.0) for i, s in enumerate(shapes)]
    owner = {seq.index: reps[seq.index % len(reps)] for seq in seqs}
    handles: dict[int, RequestProgress] = {}
    events: list[_Event] = []
    counter = itertools.count()
    clock = [0.0]

    def push(at_s: float, kind: str, seq: _Seq, generated: int = 0) -> None:
        heapq.heappush(events, _Event(at_s, next(counter), kind, seq, generated))

    def pump(r: _Replica) -> None:
        r.refused = None

        async def place(waiter: Waiter) -> bool:
            seq: _Seq = waiter.data
            cost = RequestCost(seq.shape.prompt_tokens, seq.shape.max_tokens, trackable=True)
            r.adm.static_share_blocks = r.shared.admission_share(_BACKEND)
            if not r.adm.can_admit(cost, clock[0]):
                if r.refused is None:
                    r.refused = waiter
                return False
            handles[seq.index] = r.adm.reserve(cost, clock[0])
            r.shared.note_admitted(_BACKEND)
            push(clock[0] + m.forward_s + m.preprocess_s + m.intake_s, "arrive", seq)
            return True

        run_now(admit_waiting(r.queue, place, max_head_bypass))
        wants: dict[str, int] = {}
        if r.refused is not None and r.queue.depth:
            seq = r.refused.data
            cost = RequestCost(seq.shape.prompt_tokens, seq.shape.max_tokens, trackable=True)
            wants = wants_for(r.shared, [(_BACKEND, r.adm)], cost, clock[0])
        r.shared.set_wants(wants)

    def background(r: _Replica) -> None:
        now = clock[0]
        if now >= r.next_poll_s:
            r.adm.observe(engine.used_blocks / m.capacity_blocks, float(engine.preemptions), now)
            loop.run_until_complete(r.shared.snapshot(_BACKEND, r.adm, engine.used_blocks))
            r.next_poll_s = now + m.poll_s
        if r.shared._wake.is_set() or now >= r.next_sync_s:
            r.shared._wake.clear()
            loop.run_until_complete(r.shared.sync_backend(_BACKEND, r.adm))
            r.next_sync_s = now + r.shared._interval_s()
            pump(r)

    for seq in seqs:
        owner[seq.index].queue.push(
            Waiter(0, seq.shape.prompt_tokens + seq.shape.max_tokens, 0.0, seq)
        )
    for r in reps:
        pump(r)
    done = 0
    engine_now = 0.0
    while done < len(seqs):
        while events and events[0].at_s <= engine_now:
            ev = heapq.heappop(events)
            clock[0] = ev.at_s
            if ev.kind == "arrive":
                engine.waiting.append(ev.seq)
                continue
            r = owner[ev.seq.index]
            handle = handles[ev.seq.index]
            finished = ev.kind == "finish"
            r.adm.note_progress(
                handle, 0, ev.generated, finished, clock[0], ev.seq.shape.prompt_tokens
            )
            if finished:
                r.adm.release(handle, clock[0])
                r.shared.note_released(_BACKEND)
                done += 1
            pump(r)
        clock[0] = engine_now
        for r in reps:
            background(r)
        if not engine.running and not engine.waiting:
            if not events:
                if done < len(seqs):
                    engine_now += 0.01  # the guards' periodic pumps and synchronisations
                    continue
                break
            engine_now = max(engine_now, events[0].at_s)
            continue
        engine_now = _step_observed(engine, engine_now, m, push)
    return _result(label, engine, seqs, m)


def default_settings() -> AdmissionSettings:
    """The guard's defaults, as ``oomguard guard`` runs them (progress tracked under pressure)."""
    return AdmissionSettings()


VARIANTS: dict[str, Callable[[AdmissionSettings], AdmissionSettings]] = {
    "defaults": lambda s: s,
    "no cohort stagger": lambda s: replace(s, stagger=False),
    "worst-case margins (0.99 quantiles, 2x start)": lambda s: replace(
        s,
        progress=replace(s.progress, rate_quantile=0.99, start_quantile=0.99, start_margin=2.0),
    ),
    "no queue kept inside vLLM": lambda s: replace(s, engine_queue_requests=0),
    "n sequences not sharing prompt blocks": lambda s: replace(s, share_prefix_blocks=False),
    "no progress tracking": lambda s: replace(s, track_mode="off"),
    "earliest start at half the low start latency": lambda s: replace(
        s, progress=replace(s.progress, earliest_start_share=0.5)
    ),
}


def simulate_mix(
    name: str, m: EngineModel, compare: bool, redis_url: str | None = None, replicas: int = 3
) -> dict[str, object]:
    """Direct, oracle and guard runs of one mix (and the variants with ``compare``; with
    ``redis_url``, the burst spread over ``replicas`` guards sharing the ledger there)."""
    shapes = MIXES[name]()
    direct = run_direct(shapes, m)
    oracle = run_oracle(shapes, m)
    runs = [direct, oracle]
    variants = VARIANTS if compare else {"defaults": VARIANTS["defaults"]}
    for label, change in variants.items():
        runs.append(run_guard(shapes, m, change(default_settings()), label=f"guard: {label}"))
    runs.append(
        run_guard(
            shapes,
            m,
            default_settings(),
            label="guard: learned output lengths (their sum)",
            lengths=OutputLengths(),
        )
    )
    runs.append(
        run_guard(
            shapes,
            m,
            replace(default_settings(), learned_sum=False),
            label="guard: learned output lengths (per-request quantile)",
            lengths=OutputLengths(),
        )
    )
    if compare:
        runs.append(
            run_guard(
                shapes, m, default_settings(), max_head_bypass=0, label="guard: no head bypass"
            )
        )
    if redis_url is not None:
        runs.append(
            run_replicas(
                shapes,
                m,
                default_settings(),
                redis_url,
                replicas,
                label=f"guard: {replicas} replicas sharing the Redis ledger",
            )
        )
    return {
        "mix": name,
        "requests": len(shapes),
        "runs": [
            {
                "label": r.label,
                "steps": r.steps,
                "makespan_s": round(r.makespan_s, 3),
                "tokens_per_s": round(r.tokens_per_s, 1),
                "preemptions": r.preemptions,
                "peak_blocks": r.peak_blocks,
                "ratio_to_direct": round(r.tokens_per_s / direct.tokens_per_s, 4),
            }
            for r in runs
        ],
    }


@dataclass(frozen=True)
class Ceiling:
    """Simulated throughput of one burst, as ratios to direct vLLM's."""

    guard_max_tokens: float  # every request planned at its max_tokens (the old admission)
    guard_learned: float  # output lengths learned per class (the guard's default now)
    oracle: float  # a zero-preemption scheduler knowing every exact length


def simulated_ceiling(shapes: Sequence[RequestShape], m: EngineModel | None = None) -> Ceiling:
    """The simulated ceilings of a burst of ``shapes``."""
    m = m or EngineModel()
    direct = run_direct(shapes, m).tokens_per_s
    old = run_guard(shapes, m, default_settings())
    new = run_guard(shapes, m, default_settings(), lengths=OutputLengths())
    oracle = run_oracle(shapes, m)
    return Ceiling(
        old.tokens_per_s / direct, new.tokens_per_s / direct, oracle.tokens_per_s / direct
    )


@contextlib.contextmanager
def _redis_server() -> Iterator[str]:
    import tempfile

    from redis_server import RedisServer

    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            yield server.url
        finally:
            server.stop()


def main() -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mix", choices=sorted(MIXES), action="append", help="default: all")
    ap.add_argument("--compare", action="store_true", help="also run the admission variants")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--intake-s",
        type=float,
        default=0.0,
        help="time from send to the engine's queue (a busy API server's intake; default 0)",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="also spread the burst over this many guards sharing the capacity ledger on a "
        "redis-server started here (`redis-server` must be installed)",
    )
    args = ap.parse_args()
    m = replace(EngineModel(), intake_s=args.intake_s)
    names = args.mix or list(MIXES)
    if args.replicas > 0:
        with _redis_server() as url:
            out = [simulate_mix(n, m, args.compare, url, args.replicas) for n in names]
    else:
        out = [simulate_mix(name, m, args.compare) for name in names]
    if args.json:
        print(json.dumps({"engine": m.__dict__, "mixes": out}, indent=2))
        return 0
    print(
        f"engine model: {m.capacity_blocks} usable blocks of {m.block_size}, step "
        f"{m.decode_base_s * 1e3:.1f} ms + {m.decode_per_seq_s * 1e3:.2f} ms/seq, prefill "
        f"{m.prefill_s_per_token * 1e3:.2f} ms/token; guard forward {m.forward_s * 1e3:.0f} ms, "
        f"progress seen {m.observe_s * 1e3:.0f} ms late"
    )
    for mix in out:
        print(f"\nmix {mix['mix']} ({mix['requests']} requests)")
        print(f"  {'run':52} {'steps':>6} {'time s':>7} {'tok/s':>7} {'preempt':>7} {'ratio':>6}")
        for r in mix["runs"]:  # type: ignore[attr-defined]
            print(
                f"  {r['label']:52} {r['steps']:6d} {r['makespan_s']:7.2f} "
                f"{r['tokens_per_s']:7.1f} {r['preemptions']:7d} {r['ratio_to_direct']:6.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
