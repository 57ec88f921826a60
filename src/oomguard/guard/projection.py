"""Projected KV peak of the requests in flight on one backend (pure: no I/O, no clock).

vLLM decodes every running sequence one token per engine step, in lockstep, and frees a
sequence's blocks when it finishes. So the KV the in-flight set will need is predictable: a
sequence with ``c`` tokens now and a final size of ``f`` tokens (prompt + ``max_tokens``) holds
``blocks(min(c + k, f))`` blocks ``k`` steps from now, until it finishes at ``k = f − c`` and
holds nothing. Admission compares the *peak over future steps* of the sum against the
watermark, instead of the sum of final sizes: requests at different stages of their lives
need far less than all of them at full size.

What the gateway sees lags the engine (the API server coalesces outputs; the network and the
gateway add delay), so each sequence is described by a safe envelope (:class:`Footprint`):
``hi_tokens`` is an upper bound on its tokens now (the observed count plus a lag allowance),
``remaining_steps`` an upper bound on the steps it still lives (from the observed count, a lower
bound on its progress). A sequence whose progress is unknown holds its whole final size with no
end in sight (``remaining_steps=None``), which is the plain reservation.

:class:`RequestProgress` turns observations (tokens generated per sequence, with their times)
into footprints, given the backend's decode rate (tokens per second per sequence) and the
allowances of :class:`ProgressSettings`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from oomguard.guard.output_lengths import LengthPlan


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Number of KV blocks that ``tokens`` tokens occupy (rounded up to whole blocks)."""
    if tokens <= 0:
        return 0
    return -(-tokens // block_size)


@dataclass(frozen=True)
class Footprint:
    """Envelope of the future KV use of ``sequences`` identical sequences.

    At step ``k`` from now they hold ``sequences × blocks(min(hi_tokens + k, final_tokens))``
    blocks while ``k < remaining_steps``, then none. ``remaining_steps=None``: no known end
    (the sequences hold their final size until the request is released).
    """

    hi_tokens: int
    final_tokens: int
    remaining_steps: int | None
    sequences: int = 1
    # Tokens added per step (0: a constant term, e.g. prompt blocks shared by n sequences).
    growth: int = 1
    # Steps that certainly pass before the sequences start (a request still on its way to the
    # engine holds nothing until then); they then grow from ``hi_tokens``.
    start_step: int = 0

    def blocks_at(self, step: int, block_size: int) -> int:
        """Blocks held ``step`` engine steps from now."""
        if self.remaining_steps is not None and step >= self.remaining_steps:
            return 0
        if step < self.start_step:
            return 0
        grown = self.growth * (step - self.start_step)
        tokens = min(self.hi_tokens + grown, self.final_tokens)
        return self.sequences * blocks_for_tokens(tokens, block_size)


@dataclass(frozen=True)
class LearnedSequence:
    """One sequence planned from its class's learned lengths.

    ``hi_tokens``: an upper bound on its tokens now (prompt, generated, lag); ``generated``: a
    lower bound on what it has generated; ``start_steps``: steps within which it starts at the
    latest (0 once it has shown progress); ``final_tokens``: its size at ``max_tokens``.
    """

    hi_tokens: int
    generated: int
    final_tokens: int
    max_new_tokens: int
    plan: LengthPlan
    start_steps: int = 0
    sequences: int = 1

    @property
    def last_step(self) -> int:
        """The last step it may still be running (at ``max_tokens``)."""
        return self.start_steps + max(self.max_new_tokens - self.generated, 0)


def full_footprint(final_tokens: int, sequences: int) -> Footprint:
    """The plain reservation: the final size, held until the request is released."""
    return Footprint(final_tokens, final_tokens, None, sequences)


def projected_peak_blocks(footprints: Iterable[Footprint], block_size: int) -> int:
    """The most blocks the footprints hold together at any future step (0 for none).

    Every footprint's use is non-decreasing until it drops to zero (a delayed start only
    raises it from zero), so the sum can only reach a new maximum just before some footprint
    ends (step
    ``remaining_steps − 1``) or after all bounded ones ended; only those steps are evaluated
    (O(n·m) for n footprints, m distinct ends).
    """
    fps = [f for f in footprints if f.remaining_steps is None or f.remaining_steps > 0]
    if not fps:
        return 0
    steps = sorted({f.remaining_steps - 1 for f in fps if f.remaining_steps is not None})
    # After every bounded footprint has ended only the unbounded ones remain, at full size.
    peak = sum(
        f.sequences * blocks_for_tokens(f.final_tokens, block_size)
        for f in fps
        if f.remaining_steps is None
    )
    for k in steps:
        total = 0
        for f in fps:
            total += f.blocks_at(k, block_size)
        if total > peak:
            peak = total
    return peak


def unknown_blocks(footprints: Iterable[Footprint], block_size: int) -> int:
    """Blocks of the footprints whose end is unknown (requests held at their final size)."""
    return sum(
        f.sequences * blocks_for_tokens(f.final_tokens, block_size)
        for f in footprints
        if f.remaining_steps is None
    )


def blocks_now(footprints: Iterable[Footprint], block_size: int) -> int:
    """Blocks the footprints hold at step 0 (upper bound on what is in use now)."""
    return sum(f.blocks_at(0, block_size) for f in footprints)


@dataclass(frozen=True)
class ProgressSettings:
    """Allowances that make the envelopes safe when observations lag the engine.

    ``lag_s``: how far behind the engine an observation may be when it arrives (API-server
    output coalescing, network, the gateway's own event loop); ``lag_floor_tokens``: tokens
    added on top (the engine schedules a step ahead, the last sampled token).

    Rates and start latencies are taken from recent samples (``window`` of each), not from the
    worst ever seen: the decode rate at its ``rate_quantile``, the start latency at its
    ``start_quantile`` times ``start_margin``. Until ``min_samples`` starts were seen, a request
    is assumed to show progress within ``start_allowance_s``; one that shows none by its
    deadline is treated as unknown again and holds its full size (so a late start costs
    capacity, never safety).
    """

    lag_s: float = 0.02
    lag_floor_tokens: int = 2
    start_allowance_s: float = 1.0
    rate_quantile: float = 0.9
    start_quantile: float = 0.95
    start_margin: float = 1.5
    min_start_s: float = 0.05
    window: int = 64
    min_samples: int = 8
    # The earliest a request admitted now can start in the engine: this share of the low
    # (1 − start_quantile) quantile of recent start latencies (0, the default: it may start
    # at once). Not a guarantee: vLLM starts a request as soon as its prompt fits, and an
    # intake that turns faster than it was lets it start, and grow, before this.
    earliest_start_share: float = 0.0


def _quantile(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


@dataclass
class DecodeRate:
    """Per-sequence decode speed (tokens/s) and start latency of one backend, from recent
    samples: ``tokens_per_s`` is a high quantile (the envelope needs how far a sequence may
    have got since it was last seen), ``low_tokens_per_s`` a low one (how few steps pass in a
    given time)."""

    settings: ProgressSettings = field(default_factory=ProgressSettings)
    tokens_per_s: float | None = None
    low_tokens_per_s: float | None = None
    start_latency_s: float = 0.0
    _rates: deque[float] = field(default_factory=deque)
    _starts: deque[float] = field(default_factory=deque)

    def observe_rate(self, tokens_per_s: float, now_s: float = 0.0) -> None:
        """One sample of a sequence's decode speed."""
        if not tokens_per_s > 0 or not math.isfinite(tokens_per_s):
            return
        self._rates.append(tokens_per_s)
        while len(self._rates) > self.settings.window:
            self._rates.popleft()
        self.tokens_per_s = _quantile(self._rates, self.settings.rate_quantile)
        self.low_tokens_per_s = _quantile(self._rates, 1.0 - self.settings.rate_quantile)

    def observe_start(self, latency_s: float, now_s: float = 0.0) -> None:
        """One request's time from being sent to its first observed progress."""
        self._starts.append(max(latency_s, 0.0))
        while len(self._starts) > self.settings.window:
            self._starts.popleft()
        self.start_latency_s = _quantile(self._starts, self.settings.start_quantile)

    @property
    def start_samples(self) -> int:
        """Start latencies remembered."""
        return len(self._starts)

    def earliest_start_s(self) -> float:
        """Seconds after sending before which a request certainly has not started (the
        gateway's and the engine's intake: a low quantile of recent start latencies, halved;
        0 until ``EARLIEST_START_SAMPLES`` starts were seen)."""
        s = self.settings
        if len(self._starts) < min(s.min_samples, EARLIEST_START_SAMPLES):
            return 0.0
        if s.earliest_start_share <= 0:
            return 0.0
        return s.earliest_start_share * _quantile(self._starts, 1.0 - s.start_quantile)

    def start_deadline_s(self) -> float:
        """Seconds after sending within which a request is assumed to show progress."""
        s = self.settings
        if len(self._starts) < s.min_samples:
            return max(s.start_allowance_s, s.start_margin * self.start_latency_s)
        return max(s.min_start_s, s.start_margin * self.start_latency_s)


# Starts seen before the earliest start is trusted (it is half the lowest seen, or less).
EARLIEST_START_SAMPLES = 3

# A rate sample needs this much time and this many tokens behind it: the API server coalesces
# outputs when it falls behind, so short spans see bursts, not the engine's pace.
_MIN_RATE_SPAN_S = 0.2
_MIN_RATE_TOKENS = 2


@dataclass
class RequestProgress:
    """What the gateway has seen of one admitted request's generation.

    ``tracked`` is False when no progress will ever be reported (the response is relayed
    without being read): the request then holds its full size until released. Sequence ``i``
    is choice index ``i`` of the response (``n`` choices per prompt, prompts in order).
    ``handle``, ``reserved_blocks`` and ``reserved_tokens`` are the admission's bookkeeping.
    """

    prompt_tokens: int
    max_new_tokens: int
    num_sequences: int
    sent_at_s: float
    tracked: bool = False
    prompt_exact: bool = True
    handle: int = -1
    reserved_blocks: int = 0
    reserved_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    prompt_of: list[int | None] = field(default_factory=list)
    started: bool = False
    last_seen_s: float = 0.0
    last_step_tokens: int = 0
    # Prompt tokens in full blocks that the sequences share (n > 1, vLLM's prefix cache).
    shared_tokens: int = 0
    # Sent ahead of a slot freeing (it waits in vLLM's queue): its start may come this much
    # later than the usual deadline.
    extra_start_s: float = 0.0
    # How the sequences' output lengths are planned (learned per class; None: max_new_tokens).
    # A sequence is planned from what it has generated: charged as it streams.
    plan: LengthPlan | None = None
    _first_seen: list[tuple[float, int] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.num_sequences
        self.generated = [0] * n
        self.finished = [False] * n
        self.prompt_of = [None] * n
        self._first_seen = [None] * n

    @property
    def final_tokens(self) -> int:
        """Tokens of one sequence at its largest (prompt + ``max_new_tokens``)."""
        return self.prompt_tokens + self.max_new_tokens

    @property
    def reserved_new_tokens(self) -> int:
        """Output tokens the projection plans an unstarted sequence for (learned, or
        ``max_new_tokens``)."""
        return self.planned_new_tokens(0)

    def planned_new_tokens(self, generated: int) -> int:
        """Output tokens a sequence that has ``generated`` tokens is planned for."""
        if self.plan is None:
            return self.max_new_tokens
        return min(self.plan.planned(generated), self.max_new_tokens)

    def observe(
        self,
        index: int,
        generated: int,
        finished: bool,
        now_s: float,
        rate: DecodeRate,
        prompt_tokens: int | None = None,
    ) -> None:
        """Sequence ``index`` has generated ``generated`` tokens (and maybe finished).

        Feeds ``rate`` with the sequence's speed and, on the first progress, the start latency.
        ``prompt_tokens`` (exact, from the backend's usage) refines this sequence's prompt.
        """
        if not 0 <= index < self.num_sequences:
            return
        if not self.started:
            self.started = True
            rate.observe_start(now_s - self.sent_at_s, now_s)
        before = self.generated[index]
        if generated > before:
            self.last_step_tokens = generated - before
            self.generated[index] = generated
        if finished:
            self.finished[index] = True
        if prompt_tokens is not None and prompt_tokens >= 0:
            self.prompt_of[index] = prompt_tokens
        self.last_seen_s = now_s
        first = self._first_seen[index]
        if first is None:
            self._first_seen[index] = (now_s, generated)
        else:
            span_s = now_s - first[0]
            made = generated - first[1]
            if span_s >= _MIN_RATE_SPAN_S and made >= _MIN_RATE_TOKENS:
                rate.observe_rate(made / span_s, now_s)

    def footprints(self, rate: DecodeRate, now_s: float) -> list[Footprint]:
        """The envelope of this request's unfinished sequences at ``now_s``.

        Untracked requests, and any request while the backend's decode rate is unknown, hold
        their full size with no end; so does a sequence overdue to show its first progress.
        Shared prompt blocks are one constant footprint that lasts as long as the longest
        sequence; every sequence's own footprint counts only its private tokens.
        """
        tps = rate.tokens_per_s
        shared = self.shared_tokens
        if not self.tracked or tps is None:
            return self._with_shared(
                [full_footprint(self.final_tokens - shared, self.num_sequences)], None
            )
        s = rate.settings
        waited_s = max(now_s - self.sent_at_s, 0.0)
        deadline_s = rate.start_deadline_s() + self.extra_start_s
        unseen = 0
        out: list[Footprint] = []
        lag = self._lag_tokens(tps, s, now_s)
        for i in range(self.num_sequences):
            if self.finished[i]:
                continue
            if self._first_seen[i] is None:
                unseen += 1
                continue
            prompt = self.prompt_of[i]
            if prompt is None:
                prompt = self.prompt_tokens
            lo = prompt + self.generated[i] - shared
            # Planned from what it may have generated by now (the lag included).
            final = prompt + self.planned_new_tokens(self.generated[i] + lag) - shared
            out.append(Footprint(min(lo + lag, final), final, max(final - lo, 0)))
        if unseen:
            if waited_s > deadline_s:
                out.append(full_footprint(self.final_tokens - shared, unseen))
            else:
                out.append(self._unseen_footprint(rate, unseen, waited_s, deadline_s))
        ends = [f.remaining_steps for f in out]
        longest = None if not out or None in ends else max(e or 0 for e in ends)
        return self._with_shared(out, longest) if out else out

    def terms(
        self, rate: DecodeRate, now_s: float
    ) -> tuple[list[Footprint], list[LearnedSequence]]:
        """Like :meth:`footprints`, but a tracked sequence planned from learned lengths is a
        :class:`LearnedSequence` (a distribution of ends) instead of an envelope."""
        tps = rate.tokens_per_s
        if self.plan is None or not self.tracked or tps is None:
            return self.footprints(rate, now_s), []
        s = rate.settings
        shared = self.shared_tokens
        final = self.final_tokens - shared
        waited_s = max(now_s - self.sent_at_s, 0.0)
        deadline_s = rate.start_deadline_s() + self.extra_start_s
        lag = self._lag_tokens(tps, s, now_s)
        learned: list[LearnedSequence] = []
        envelopes: list[Footprint] = []
        unseen = 0
        for i in range(self.num_sequences):
            if self.finished[i]:
                continue
            if self._first_seen[i] is None:
                unseen += 1
                continue
            prompt = self.prompt_of[i]
            prompt = self.prompt_tokens if prompt is None else prompt
            lo = prompt + self.generated[i] - shared
            own_final = prompt + self.max_new_tokens - shared
            learned.append(
                LearnedSequence(
                    min(lo + lag, own_final),
                    self.generated[i],
                    own_final,
                    self.max_new_tokens,
                    self.plan,
                )
            )
        if unseen and waited_s > deadline_s:
            envelopes.append(full_footprint(final, unseen))
        elif unseen:
            hi = (
                self.prompt_tokens
                - shared
                + s.lag_floor_tokens
                + math.ceil(tps * (waited_s + s.lag_s))
            )
            latest = math.ceil(tps * (deadline_s - waited_s)) + 1
            learned.append(
                LearnedSequence(
                    min(hi, final), 0, final, self.max_new_tokens, self.plan, latest, unseen
                )
            )
        if shared > 0:
            longest = None if envelopes else max(x.last_step for x in learned) + 1
            envelopes.append(Footprint(shared, shared, longest, 1, growth=0))
        return envelopes, learned

    def _lag_tokens(self, tps: float, s: ProgressSettings, now_s: float) -> int:
        """Tokens a seen sequence may have generated beyond what was last observed of it."""
        return (
            s.lag_floor_tokens
            + self.last_step_tokens
            + math.ceil(tps * (max(now_s - self.last_seen_s, 0.0) + s.lag_s))
        )

    def blocks_held_at_least(self, block_size: int) -> int:
        """Blocks the request certainly holds for as long as it lives: its seen, unfinished
        sequences at their observed length (a sequence only grows until it ends)."""
        if not self.tracked:
            return 0
        held = 0
        for i in range(self.num_sequences):
            if self.finished[i] or self._first_seen[i] is None:
                continue
            seen_prompt = self.prompt_of[i]
            prompt = self.prompt_tokens if seen_prompt is None else seen_prompt
            held += blocks_for_tokens(prompt + self.generated[i] - self.shared_tokens, block_size)
        if held and self.shared_tokens:
            held += self.shared_tokens // block_size
        return held

    def _unseen_footprint(
        self, rate: DecodeRate, unseen: int, waited_s: float, deadline_s: float
    ) -> Footprint:
        """Sequences not seen yet: they may have started unseen (``hi``), and start by the
        deadline at the latest (the end)."""
        s = rate.settings
        tps = rate.tokens_per_s or 0.0
        final = self.prompt_tokens + self.reserved_new_tokens - self.shared_tokens
        hi = (
            self.prompt_tokens
            - self.shared_tokens
            + s.lag_floor_tokens
            + math.ceil(tps * (waited_s + s.lag_s))
        )
        latest_start_steps = math.ceil(tps * (deadline_s - waited_s)) + 1
        steps = self.reserved_new_tokens + latest_start_steps
        # Steps that pass, at the least, before it can have reached the engine.
        not_before_s = rate.earliest_start_s() - waited_s - s.lag_s
        low = rate.low_tokens_per_s or 0.0
        if not_before_s > 0 and low > 0:
            start = min(math.floor(low * not_before_s), latest_start_steps)
            first = self.prompt_tokens - self.shared_tokens + s.lag_floor_tokens
            return Footprint(min(first, final), final, steps, unseen, start_step=start)
        return Footprint(min(hi, final), final, steps, unseen)

    def _with_shared(self, fps: list[Footprint], longest: int | None) -> list[Footprint]:
        if self.shared_tokens <= 0:
            return fps
        shared = Footprint(self.shared_tokens, self.shared_tokens, longest, 1, growth=0)
        return [*fps, shared]


def new_request_footprints(
    prompt_tokens: int,
    max_new_tokens: int,
    num_sequences: int,
    rate: DecodeRate,
    track: bool,
    shared_tokens: int = 0,
    plan: LengthPlan | None = None,
) -> list[Footprint]:
    """The envelope of a request about to be sent (``track``: its progress will be read;
    ``plan``: how its output lengths are planned)."""
    probe = RequestProgress(
        prompt_tokens,
        max_new_tokens,
        num_sequences,
        0.0,
        tracked=track,
        shared_tokens=shared_tokens,
        plan=plan if track else None,
    )
    return probe.footprints(rate, 0.0)


def new_request_terms(
    prompt_tokens: int,
    max_new_tokens: int,
    num_sequences: int,
    rate: DecodeRate,
    shared_tokens: int,
    plan: LengthPlan,
) -> tuple[list[Footprint], list[LearnedSequence]]:
    """:meth:`RequestProgress.terms` of a tracked request about to be sent."""
    probe = RequestProgress(
        prompt_tokens,
        max_new_tokens,
        num_sequences,
        0.0,
        tracked=True,
        shared_tokens=shared_tokens,
        plan=plan,
    )
    return probe.terms(rate, 0.0)


def peak_with(current: Sequence[Footprint], extra: Sequence[Footprint], block_size: int) -> int:
    """Projected peak of ``current`` and ``extra`` together."""
    return projected_peak_blocks([*current, *extra], block_size)
