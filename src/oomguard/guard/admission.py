"""Pure admission logic: KV reservations, watermarks with hysteresis, effective capacity.

No I/O and no clock: callers pass ``now_s`` in. One :class:`BackendAdmission` per backend holds
what the gateway has reserved there and what the backend last reported; :func:`pick_backend`
chooses where a request goes.

The rule (AI21's pause/resume fix, with the 90 %/80 % watermarks of the troubleshooting guide),
in two parts:

- **Requests of unknown progress** (not tracked, or tracked but not yet readable) count at their
  full final size until released: the plain reservation. Their sum, plus the KV the backend
  reports in use beyond what the gateway accounts for (``vllm:kv_cache_usage_perc``: traffic
  that bypasses it), must stay under ``high × effective capacity``. Once a request is refused
  with that sum in the high band, admission stops (the *pause latch*) until the projected peak
  falls below ``low × effective capacity``.
- **Tracked requests** are described by safe envelopes built from their observed progress
  (:mod:`oomguard.guard.projection`). The *projected peak* — the most KV blocks everything in
  flight plus the new request will hold together at any future engine step — must stay under
  ``projected_watermark × effective capacity`` (default 1.0: the envelopes already carry the
  lag allowances, so the projection is an upper bound and the whole pool may be planned for).
  A request refused on the projection alone waits without latching: the projection only falls
  as the requests in flight progress, so there is nothing to oscillate.

While nothing's progress is known, the projected peak is the sum of reservations and only the
first part binds. A preemption seen in ``vllm:num_preemptions_total``, or reported usage above
what admission allows (the high watermark, or the projected watermark while tracked
requests are in flight), tightens the effective capacity; sustained calm relaxes it again.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from oomguard.guard.output_lengths import LengthPlan
from oomguard.guard.projected_sum import overflow_probability
from oomguard.guard.projection import (
    DecodeRate,
    Footprint,
    LearnedSequence,
    ProgressSettings,
    RequestProgress,
    blocks_for_tokens,
    blocks_now,
    new_request_footprints,
    new_request_terms,
    projected_peak_blocks,
    unknown_blocks,
)

__all__ = [
    "AdmissionSettings",
    "BackendAdmission",
    "RequestCost",
    "blocks_for_tokens",
    "never_fit_reason",
    "pick_backend",
]

TrackMode = Literal["auto", "always", "off"]
# A poll may lag a release by this much: the released request's blocks still count as ours.
RELEASE_GRACE_S = 0.5


@dataclass(frozen=True)
class AdmissionSettings:
    """Watermarks and feedback tuning; fractions are of the backend's usable KV blocks."""

    high_watermark: float = 0.90
    low_watermark: float = 0.80
    # Ceiling of the projected peak (tracked requests: an upper bound from observed progress).
    projected_watermark: float = 1.0
    tighten_factor: float = 0.90
    min_capacity_fraction: float = 0.50
    relax_step: float = 0.02
    calm_period_s: float = 5.0
    tighten_cooldown_s: float = 1.0
    # Progress tracking: "always" reads every trackable request's progress, "off" none, "auto"
    # those admitted while full reservations (this one included) exceed track_above_fraction
    # of the effective capacity — below that the plain reservation fits anyway.
    track_mode: TrackMode = "auto"
    track_above_fraction: float = 0.25
    stagger: bool = True
    stagger_above_fraction: float = 0.5
    progress: ProgressSettings = field(default_factory=ProgressSettings)
    # Count the full prompt blocks of a request's n sequences once (vLLM's prefix cache).
    share_prefix_blocks: bool = True
    # Requests sent ahead of a slot freeing, to wait in vLLM's own queue (see
    # BackendAdmission._early_margin): at most this many not yet started per backend.
    engine_queue_requests: int = 2
    # The smallest first prefill chunk vLLM schedules for a waiting request (its token budget
    # per step is at least this): a request needs this much of its prompt in free blocks.
    first_chunk_tokens: int = 512
    # Ceiling of the projected peak while some tracked request is planned with a learned
    # output length below its max_tokens: the margin for the projection's error (a request
    # that outgrows its reservation is charged as it streams, one poll of usage late).
    learned_watermark: float = 0.90
    # Learned lengths as distributions: when the per-request plan refuses, admit on the risk
    # that the blocks in flight exceed the projected watermark (oomguard.guard.projected_sum).
    learned_sum: bool = True
    # The overflow risk one such decision may take, as a share of the quantile's tail (a burst
    # turns the pool over a few times, each turnover a fresh chance to overflow).
    learned_sum_risk: float = 0.1
    # The per-request plan (every learned sequence at its quantile, under learned_watermark)
    # admits only while that risk stays below this share of the tail: a sequence that outruns
    # its quantile while the pool is tight preempts, and the plan alone cannot see how likely
    # that is (None: no veto).
    learned_plan_veto: float | None = 1.0


@dataclass(frozen=True)
class RequestCost:
    """What one request may occupy in the KV cache at worst.

    ``sequence_tokens`` = prompt tokens + tokens it may generate; ``num_sequences`` is ``n``
    (or the number of prompts in a batch). ``prompt_exact`` is False when the prompt length is
    an estimate (no tokenizer reachable). ``trackable``: the gateway can read the request's
    progress (it streams, or its non-streamed answer can be assembled from a stream).
    """

    prompt_tokens: int
    max_new_tokens: int
    num_sequences: int = 1
    prompt_exact: bool = True
    trackable: bool = False
    # Prompts (or conversations) in the request; its n sequences each share one.
    inputs: int = 1
    # How the projection plans its output lengths when it is tracked (learned per class, see
    # oomguard.guard.output_lengths; None: max_new_tokens).
    length_plan: LengthPlan | None = None
    # The class its output length is learned in (None: not learned).
    length_class: tuple[object, ...] | None = None

    @property
    def planned_new_tokens(self) -> int:
        """Output tokens per sequence the projection plans for (at most ``max_new_tokens``)."""
        if self.length_plan is None:
            return self.max_new_tokens
        return min(self.length_plan.planned(0), self.max_new_tokens)

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def total_tokens(self) -> int:
        return self.sequence_tokens * self.num_sequences

    def shared_tokens(self, block_size: int, prefix_caching: bool) -> int:
        """Prompt tokens in full blocks that all sequences share (0 when they may not).

        vLLM caches a prompt's full blocks as it allocates them, so the ``n`` sequences of one
        prompt hold them once. Counted only for one exactly measured prompt: with an estimate,
        moving tokens from private to shared blocks could undercount.
        """
        if not prefix_caching or self.num_sequences < 2 or self.inputs != 1:
            return 0
        if not self.prompt_exact:
            return 0
        return (self.prompt_tokens // block_size) * block_size

    def blocks(self, block_size: int, prefix_caching: bool = False) -> int:
        """KV blocks this request needs on a backend with ``block_size`` tokens per block."""
        shared = self.shared_tokens(block_size, prefix_caching)
        private = blocks_for_tokens(self.sequence_tokens - shared, block_size)
        return shared // block_size + private * self.num_sequences


@dataclass
class BackendAdmission:
    """Admission state of one backend: capacity, reservations, latch, feedback.

    ``capacity_blocks`` is the usable pool (``num_gpu_blocks − 1``: vLLM keeps one null
    block); ``None`` until the backend's ``vllm:cache_config_info`` (or the config) told us.
    """

    settings: AdmissionSettings = field(default_factory=AdmissionSettings)
    capacity_blocks: int | None = None
    block_size: int | None = None
    # vLLM's enable_prefix_caching (cache_config_info); None while unknown (nothing shared).
    prefix_caching: bool | None = None
    effective_fraction: float = 1.0
    reserved_blocks: int = 0
    reserved_tokens: int = 0
    paused: bool = False
    observed_usage: float = 0.0
    pause_count: int = 0
    tighten_count: int = 0
    preemptions_seen: int = 0
    rate: DecodeRate = field(init=False)
    inflight: dict[int, RequestProgress] = field(default_factory=dict)
    external_blocks: int = 0
    last_projected_blocks: int = 0
    # With replicas sharing the backend (Redis): the blocks this replica keeps in the shared
    # ledger. Admission then counts only its own requests against them.
    static_share_blocks: int | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _last_preemptions: float | None = None
    _calm_since_s: float | None = None
    _last_tighten_s: float | None = None
    _last_pressed: RequestProgress | None = None
    _recent_releases: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=256))
    # Set by admit_margin when it admits ahead of a slot freeing; read by prepare().
    _early_start_s: float | None = None
    # Which rule admitted the last request admit_margin admitted (idle, plain, projected,
    # summed, early), for the admission log.
    admitted_by: str = ""

    def __post_init__(self) -> None:
        self.rate = DecodeRate(self.settings.progress)

    # -- capacity -------------------------------------------------------------------------
    def set_capacity(
        self, num_gpu_blocks: int, block_size: int, prefix_caching: bool | None = None
    ) -> None:
        """Record the pool size as vLLM reports it (``num_gpu_blocks`` includes the null block)."""
        self.capacity_blocks = max(num_gpu_blocks - 1, 0)
        self.block_size = block_size
        if prefix_caching is not None:
            self.prefix_caching = prefix_caching

    @property
    def sharing(self) -> bool:
        """Whether prompt blocks shared by a request's sequences are counted once."""
        return bool(self.prefix_caching) and self.settings.share_prefix_blocks

    def need_blocks(self, cost: RequestCost) -> int:
        """Blocks ``cost`` needs here at its largest (shared prompt blocks counted once)."""
        assert self.block_size is not None
        return cost.blocks(self.block_size, self.sharing)

    @property
    def usage_ceiling(self) -> float:
        """Reported usage above this fraction is unexpected: it tightens and latches.

        While tracked requests are in flight the projected peak may fill the pool up to the
        projected watermark, so usage up to there is what admission intends, not a warning.
        """
        s = self.settings
        if self.static_share_blocks is not None:
            # The report counts every replica's requests, some of them tracked.
            return max(s.high_watermark, s.projected_watermark)
        if s.track_mode == "off" or not any(p.tracked for p in self.inflight.values()):
            return s.high_watermark
        return max(s.high_watermark, s.projected_watermark)

    @property
    def known(self) -> bool:
        return self.capacity_blocks is not None and self.block_size is not None

    @property
    def effective_capacity_blocks(self) -> int:
        """The blocks admission plans with: the pool (or this replica's share of it) times the
        effective fraction."""
        if self.capacity_blocks is None:
            return 0
        base = self.capacity_blocks
        if self.static_share_blocks is not None:
            base = min(base, self.static_share_blocks)
        return int(base * self.effective_fraction)

    @property
    def _external(self) -> int:
        """KV of traffic not admitted here (under a static share, the others' share)."""
        return 0 if self.static_share_blocks is not None else self.external_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks in use as far as we know: reservations or the backend's report, the larger
        (only reservations under a static share: the report includes the other replicas)."""
        if self.static_share_blocks is not None:
            return self.reserved_blocks
        observed = 0
        if self.capacity_blocks:
            observed = math.ceil(self.observed_usage * self.capacity_blocks)
        return max(self.reserved_blocks, observed)

    @property
    def free_blocks(self) -> int:
        """Effective capacity minus what is used (reservations included); may be negative."""
        return self.effective_capacity_blocks - self.used_blocks

    def utilization(self) -> float:
        """Used blocks as a fraction of the effective capacity (0 when capacity is unknown)."""
        eff = self.effective_capacity_blocks
        return self.used_blocks / eff if eff > 0 else 0.0

    # -- projection -----------------------------------------------------------------------
    def footprints(self, now_s: float) -> list[Footprint]:
        """Envelopes of every request in flight here at ``now_s``."""
        out: list[Footprint] = []
        for p in self.inflight.values():
            out.extend(p.footprints(self.rate, now_s))
        return out

    def projected_blocks(self, now_s: float) -> int:
        """Projected peak of the requests in flight, plus KV used by traffic not seen here."""
        if self.block_size is None:
            return 0
        peak = projected_peak_blocks(self.footprints(now_s), self.block_size)
        self.last_projected_blocks = peak + self._external
        return self.last_projected_blocks

    @property
    def tracked_requests(self) -> int:
        """Requests in flight whose progress is being read."""
        return sum(1 for p in self.inflight.values() if p.tracked)

    def should_track(self, cost: RequestCost) -> bool:
        """Whether a request admitted here now should have its progress read."""
        mode = self.settings.track_mode
        if not cost.trackable or mode == "off" or not self.known:
            return False
        if mode == "always":
            return True
        eff = self.effective_capacity_blocks
        full = self.reserved_blocks + self.need_blocks(cost)
        return full > self.settings.track_above_fraction * eff

    # -- admission ------------------------------------------------------------------------
    def fits_ever(self, cost: RequestCost) -> bool:
        """Whether the request could run here with the pool otherwise empty."""
        if not self.known:
            return False
        assert self.capacity_blocks is not None and self.block_size is not None
        return self.need_blocks(cost) <= self.capacity_blocks

    def _refresh_latch(self, now_s: float) -> None:
        if not self.paused:
            return
        low = self.settings.low_watermark * self.effective_capacity_blocks
        if self.projected_blocks(now_s) < low:
            self.paused = False

    def admit_margin(self, cost: RequestCost, now_s: float = 0.0) -> int | None:
        """Blocks of effective capacity left at the peak if ``cost`` is admitted now, else None.

        None means: not now (refusing with the projected peak in the high band sets the
        latch). A backend with nothing in flight takes any request that fits its whole pool,
        so a large request is never starved by its own size. When the plain reservations
        already fit, the projection is not computed (the hot path stays O(1)).
        """
        self._early_start_s = None
        if not self.known:
            return None
        assert self.block_size is not None and self.capacity_blocks is not None
        need = self.need_blocks(cost)
        if need > self.capacity_blocks:
            return None
        self._refresh_latch(now_s)
        if self.paused:
            return None
        eff = self.effective_capacity_blocks
        limit = self.settings.high_watermark * eff
        if self.static_share_blocks is not None and need > limit:
            return None  # under a static share even an idle replica keeps to its share
        if self.reserved_blocks == 0 and self.observed_usage < self.settings.low_watermark:
            self.admitted_by = "idle"
            return eff - need
        simple = self.used_blocks + need
        if simple <= limit:
            self.admitted_by = "plain"
            return eff - simple
        # Beyond the plain reservations: admission rests on the projection of tracked requests.
        track = self.should_track(cost)
        proj_limit = self._projected_limit(cost if track else None) * eff
        if track and not self._stagger_ok(cost, proj_limit, now_s):
            return None
        current = self.footprints(now_s)
        extra = self._new_footprints(cost, track)
        fps = [*current, *extra]
        bs = self.block_size
        unknown = unknown_blocks(fps, bs) + self._external
        if unknown <= limit:
            peak = projected_peak_blocks(fps, bs) + self._external
            if peak <= proj_limit and self._plan_not_vetoed(cost, track, now_s):
                self.admitted_by = "projected"
                return eff - peak
            summed = self._summed_margin(cost, track, now_s, self.settings.learned_sum_risk)
            if summed is not None:
                self.admitted_by = "summed"
                return summed
            if track:
                early = self._early_margin(cost, extra, proj_limit, now_s)
                if early is not None:
                    self.admitted_by = "early"
                    return early
            # Only the projection is over: it falls as the tracked requests progress, which
            # re-runs admission; no latch needed (the projection does not flap).
            self.last_projected_blocks = projected_peak_blocks(current, bs) + self._external
            return None
        # The requests of unknown progress reach the high watermark. Latch only when they are
        # in the high band; a large request that does not fit while usage is low just waits.
        base = unknown_blocks(current, bs) + self._external
        self.last_projected_blocks = projected_peak_blocks(current, bs) + self._external
        if base >= self.settings.low_watermark * eff:
            self.paused = True
            self.pause_count += 1
        return None

    def _learned_sum(self, cost: RequestCost | None) -> bool:
        """Whether the learned sum applies: some learned length, of ``cost`` or of a tracked
        request in flight, is shorter than its request's limit (else every sequence runs to its
        ``max_tokens`` and the envelopes already say all there is)."""
        if not self.settings.learned_sum:
            return False
        if cost is not None and _may_end_early(cost.length_plan):
            return True
        return any(p.tracked and _may_end_early(p.plan) for p in self.inflight.values())

    def _plan_not_vetoed(self, cost: RequestCost, track: bool, now_s: float) -> bool:
        """Whether the sum's overflow risk lets the per-request plan admit ``cost``."""
        veto = self.settings.learned_plan_veto
        if veto is None or not self._learned_sum(cost if track else None):
            return True
        return self._summed_margin(cost, track, now_s, veto) is not None

    def _summed_margin(
        self, cost: RequestCost, track: bool, now_s: float, share: float
    ) -> int | None:
        """Blocks left at the projected sum over time with ``cost`` admitted, while learned
        lengths are in play and it stays under the projected watermark; else None."""
        if not self._learned_sum(cost if track else None):
            return None
        assert self.block_size is not None
        bs = self.block_size
        envelopes: list[Footprint] = []
        learned: list[LearnedSequence] = []
        quantile = 0.0
        for p in self.inflight.values():
            e, seqs = p.terms(self.rate, now_s)
            envelopes.extend(e)
            learned.extend(seqs)
            if p.plan is not None and p.tracked:
                quantile = max(quantile, p.plan.quantile)
        plan = cost.length_plan if track else None
        if plan is not None:
            e, seqs = new_request_terms(
                cost.prompt_tokens,
                cost.max_new_tokens,
                cost.num_sequences,
                self.rate,
                cost.shared_tokens(bs, self.sharing),
                plan,
            )
            quantile = max(quantile, plan.quantile)
        else:
            e, seqs = self._new_footprints(cost, track), []
        envelopes.extend(e)
        learned.extend(seqs)
        eff = self.effective_capacity_blocks
        limit = self.settings.projected_watermark * eff - self._external
        risk, expected = overflow_probability(envelopes, learned, bs, limit)
        if risk > (1.0 - quantile) * share:
            return None
        return eff - expected - self._external

    def _projected_limit(self, cost: RequestCost | None) -> float:
        """The projected watermark: ``learned_watermark`` (the lower) while any tracked request
        in flight, or ``cost`` itself, is planned below its max_tokens."""
        s = self.settings
        learned = cost is not None and cost.planned_new_tokens < cost.max_new_tokens
        learned = learned or any(
            p.tracked and p.reserved_new_tokens < p.max_new_tokens for p in self.inflight.values()
        )
        if learned:
            return min(s.projected_watermark, s.learned_watermark)
        return s.projected_watermark

    def _new_footprints(self, cost: RequestCost, track: bool) -> list[Footprint]:
        """Envelopes of ``cost`` if admitted here now (``track``: its progress will be read)."""
        assert self.block_size is not None
        return new_request_footprints(
            cost.prompt_tokens,
            cost.max_new_tokens,
            cost.num_sequences,
            self.rate,
            track,
            cost.shared_tokens(self.block_size, self.sharing),
            cost.length_plan,
        )

    def _early_margin(
        self, cost: RequestCost, extra: list[Footprint], proj_limit: float, now_s: float
    ) -> int | None:
        """Admit ``cost`` ahead of a slot freeing, to wait in vLLM's own queue, when safe.

        vLLM starts a waiting request only when its first prefill chunk fits the free blocks.
        If the started requests of a set S certainly hold so much that it cannot fit while all
        of S live, it starts only after some A in S has ended; so it is safe when, for every A
        in S, the projection without A and with the new request starting now fits. Its start
        may then come as late as the longest-lived member of S ends, which its deadline allows.
        At most ``engine_queue_requests`` such requests wait unstarted at a time.
        """
        s = self.settings
        assert self.block_size is not None and self.capacity_blocks is not None
        waiting = sum(1 for p in self.inflight.values() if p.extra_start_s > 0 and not p.started)
        if waiting >= s.engine_queue_requests or self.static_share_blocks is not None:
            return None
        rate_low = self.rate.low_tokens_per_s
        if not rate_low:
            return None
        bs = self.block_size
        first = blocks_for_tokens(min(cost.prompt_tokens, s.first_chunk_tokens), bs)
        holders = sorted(
            (
                (p.blocks_held_at_least(bs), p)
                for p in self.inflight.values()
                if p.tracked and p.started
            ),
            key=lambda x: x[0],
            reverse=True,
        )
        chosen: list[RequestProgress] = []
        held = 0
        for blocks, p in holders:
            if self.capacity_blocks - held < first:
                break
            chosen.append(p)
            held += blocks
        if not chosen or self.capacity_blocks - held >= first:
            return None
        worst = 0
        for a in chosen:
            others = [
                f
                for p in self.inflight.values()
                if p is not a
                for f in p.footprints(self.rate, now_s)
            ]
            peak = projected_peak_blocks([*others, *extra], bs) + self._external
            if peak > proj_limit:
                return None
            worst = max(worst, peak)
        longest_steps = max(
            (f.remaining_steps or 0 for a in chosen for f in a.footprints(self.rate, now_s)),
            default=0,
        )
        self._early_start_s = longest_steps / rate_low
        return int(self.effective_capacity_blocks - worst)

    def _share_for(self, blocks: int, watermark: float) -> int:
        """The least share whose effective capacity × ``watermark`` holds ``blocks``."""
        fraction = self.effective_fraction
        share = math.ceil(blocks / (watermark * fraction))
        while watermark * int(share * fraction) < blocks:
            share += 1
        return share

    def share_held(self, now_s: float) -> int:
        """The least share that keeps what is in flight here within the watermarks (what a
        replica may not give away)."""
        if self.block_size is None:
            return 0
        return self._share_holding(self.footprints(now_s), self._projected_limit(None))

    def _share_holding(self, fps: list[Footprint], projected_limit: float) -> int:
        """The least share that keeps ``fps`` within the watermarks: their unknown-progress
        blocks within the high one, their projected peak within ``projected_limit``."""
        assert self.block_size is not None
        s, bs = self.settings, self.block_size
        return max(
            self._share_for(unknown_blocks(fps, bs), s.high_watermark),
            self._share_for(projected_peak_blocks(fps, bs), projected_limit),
        )

    def share_needed(self, cost: RequestCost, now_s: float) -> int:
        """The least share (blocks kept by this replica) at which ``cost`` would be admitted
        now, the latch and the stagger aside: what a replica asks the shared ledger for."""
        assert self.block_size is not None
        s = self.settings
        need = self.need_blocks(cost)
        share_for = self._share_for
        idle = share_for(need, s.high_watermark)
        if self.reserved_blocks == 0:
            return idle
        plain = share_for(self.reserved_blocks + need, s.high_watermark)
        track = cost.trackable and s.track_mode != "off"
        fps = [*self.footprints(now_s), *self._new_footprints(cost, track)]
        return max(idle, min(plain, self._share_holding(fps, self._projected_limit(cost))))

    def recent_release_blocks(self, now_s: float) -> int:
        """Blocks that requests released within ``RELEASE_GRACE_S`` held (a poll may still
        show them)."""
        return sum(b for t, b in self._recent_releases if now_s - t <= RELEASE_GRACE_S)

    def stagger_tokens(self, cost: RequestCost, limit_blocks: float) -> int:
        """Engine steps between admissions that let requests like ``cost`` finish staggered.

        Requests admitted together finish together, and a pool full of requests at their
        final size has no room for a newcomer until they all end, so the same cohort forms
        again and again. Spread over their lifetime, ``limit / mean size`` such requests fit
        at once; admitting one every ``lifetime / that many`` steps keeps them spread. Counted
        in tokens the previous admission has generated (engine steps), not in seconds: the
        step rate changes with the batch.
        """
        if not self.settings.stagger or self.block_size is None:
            return 0
        new = cost.planned_new_tokens
        if new <= 0 or limit_blocks <= 0:
            return 0
        mean_blocks = cost.num_sequences * _mean_blocks(cost.prompt_tokens, new, self.block_size)
        return int(new * mean_blocks / limit_blocks)

    def _stagger_ok(self, cost: RequestCost, limit_blocks: float, now_s: float) -> bool:
        """Whether ``cost`` would not end in the same cohort as the last pressed admission.

        Only a request that would finish within ``stagger_tokens`` steps of the last request
        admitted under pressure waits (identical requests admitted together end together);
        requests of other lengths end apart anyway and pass at once.
        """
        last = self._last_pressed
        if last is None or last.handle not in self.inflight or not last.tracked:
            return True
        done = max(
            (g for g, f in zip(last.generated, last.finished, strict=True) if not f), default=None
        )
        if done is None and last.started:
            return True
        # Progress counts from the last one's first token, not from when it was sent: vLLM can
        # take two waiting requests into the same step, so time spent waiting to start does
        # not set their ends apart (counting it let a three-replica burst preempt once).
        remaining = last.reserved_new_tokens - (done or 0)
        gap = abs(remaining - cost.planned_new_tokens)
        return gap >= self.stagger_tokens(cost, limit_blocks)

    def can_admit(self, cost: RequestCost, now_s: float = 0.0) -> bool:
        """Whether ``cost`` may be admitted now (see :meth:`admit_margin`)."""
        return self.admit_margin(cost, now_s) is not None

    def reserve(self, cost: RequestCost, now_s: float = 0.0) -> RequestProgress:
        """Admit the request: record it in flight; returns the handle to report progress on."""
        progress = self.prepare(cost, now_s)
        self.register(progress)
        return progress

    def prepare(
        self, cost: RequestCost, now_s: float = 0.0, track: bool | None = None
    ) -> RequestProgress:
        """The in-flight record ``cost`` would get here (not yet registered; ``track``
        overrides :meth:`should_track`)."""
        assert self.block_size is not None
        tracked = self.should_track(cost) if track is None else track and cost.trackable
        progress = RequestProgress(
            cost.prompt_tokens,
            cost.max_new_tokens,
            cost.num_sequences,
            now_s,
            tracked=tracked,
            prompt_exact=cost.prompt_exact,
            shared_tokens=cost.shared_tokens(self.block_size, self.sharing),
        )
        if tracked and self._early_start_s is not None:
            progress.extra_start_s = self._early_start_s
        if tracked:
            progress.plan = cost.length_plan
        self._early_start_s = None
        progress.handle = next(self._ids)
        progress.reserved_blocks = self.need_blocks(cost)
        progress.reserved_tokens = cost.total_tokens
        return progress

    def register(self, progress: RequestProgress) -> None:
        """Record a prepared request as in flight here."""
        self.inflight[progress.handle] = progress
        limit = self.settings.high_watermark * self.effective_capacity_blocks
        pressed = self.used_blocks + progress.reserved_blocks > (
            self.settings.stagger_above_fraction * limit
        )
        if pressed and progress.tracked:
            self._last_pressed = progress  # admitted under pressure: the next waits for it
        self.reserved_blocks += progress.reserved_blocks
        self.reserved_tokens += progress.reserved_tokens

    def release(self, progress: RequestProgress, now_s: float = 0.0) -> None:
        """The request ended (any way): forget it and give its reservation back."""
        if self.inflight.pop(progress.handle, None) is None:
            return
        if self.block_size is not None:
            held = blocks_now(progress.footprints(self.rate, now_s), self.block_size)
            self._recent_releases.append((now_s, held))
        self.reserved_blocks = max(self.reserved_blocks - progress.reserved_blocks, 0)
        self.reserved_tokens = max(self.reserved_tokens - progress.reserved_tokens, 0)
        self._refresh_latch(now_s)

    def note_progress(
        self,
        progress: RequestProgress,
        index: int,
        generated: int | None,
        finished: bool,
        now_s: float,
        prompt_tokens: int | None = None,
    ) -> None:
        """Sequence ``index`` of an in-flight request reached ``generated`` tokens.

        ``prompt_tokens`` (the backend's exact count) trues up the reservation when the
        prompt was estimated: the request is re-costed with the largest prompt seen so far.
        """
        if progress.handle not in self.inflight:
            return
        if generated is None:
            # The backend does not count tokens per chunk: progress cannot be read exactly,
            # so the request holds its full size again.
            progress.tracked = False
            return
        progress.observe(index, generated, finished, now_s, self.rate, prompt_tokens)
        if prompt_tokens is not None and not progress.prompt_exact:
            self._true_up(progress)

    def _true_up(self, progress: RequestProgress) -> None:
        seen = [p for p in progress.prompt_of if p is not None]
        if len(seen) < progress.num_sequences or self.block_size is None:
            return
        progress.prompt_exact = True
        progress.prompt_tokens = max(seen)
        blocks = blocks_for_tokens(progress.final_tokens, self.block_size) * progress.num_sequences
        tokens = progress.final_tokens * progress.num_sequences
        self.reserved_blocks += blocks - progress.reserved_blocks
        self.reserved_tokens += tokens - progress.reserved_tokens
        progress.reserved_blocks, progress.reserved_tokens = blocks, tokens

    # -- feedback -------------------------------------------------------------------------
    def observe(
        self, kv_usage: float | None, preemptions_total: float | None, now_s: float
    ) -> None:
        """Take one poll of the backend's metrics: usage (0–1) and the preemption counter.

        New preemptions, or usage above the high watermark, tighten the effective capacity
        (at most once per ``tighten_cooldown_s``); a ``calm_period_s`` without either relaxes
        it by ``relax_step``. A counter that went backwards means the backend restarted.
        """
        s = self.settings
        if kv_usage is not None:
            self.observed_usage = min(max(kv_usage, 0.0), 1.0)
            self._note_external(now_s)
        new_preemptions = 0.0
        if preemptions_total is not None:
            if self._last_preemptions is not None and preemptions_total >= self._last_preemptions:
                new_preemptions = preemptions_total - self._last_preemptions
            self._last_preemptions = preemptions_total
        over = kv_usage is not None and kv_usage > self.usage_ceiling
        if new_preemptions > 0:
            self.preemptions_seen += int(new_preemptions)
        if new_preemptions > 0 or over:
            cooled = (
                self._last_tighten_s is None or now_s - self._last_tighten_s >= s.tighten_cooldown_s
            )
            if cooled:
                self.effective_fraction = max(
                    s.min_capacity_fraction, self.effective_fraction * s.tighten_factor
                )
                self.tighten_count += 1
                self._last_tighten_s = now_s
            self._calm_since_s = now_s
            if over and not self.paused:
                self.paused = True
                self.pause_count += 1
        else:
            if self._calm_since_s is None:
                self._calm_since_s = now_s
            elif now_s - self._calm_since_s >= s.calm_period_s:
                if self.effective_fraction < 1.0:
                    self.effective_fraction = min(1.0, self.effective_fraction + s.relax_step)
                self._calm_since_s = now_s
        self._refresh_latch(now_s)

    def _note_external(self, now_s: float) -> None:
        """KV in use beyond the gateway's own upper bound (traffic that bypasses it).

        A poll may still show the blocks of a request that ended here a moment ago, so what
        requests released within ``RELEASE_GRACE_S`` held counts as the gateway's own too.
        """
        if not self.capacity_blocks or self.block_size is None:
            return
        recent = self._recent_releases
        while recent and now_s - recent[0][0] > RELEASE_GRACE_S:
            recent.popleft()
        ours = blocks_now(self.footprints(now_s), self.block_size) + sum(b for _, b in recent)
        observed = math.ceil(self.observed_usage * self.capacity_blocks)
        self.external_blocks = max(observed - ours, 0)

    def forget_observations(self) -> None:
        """Drop what the backend reported (it went away); reservations stay until released."""
        self.observed_usage = 0.0
        self.external_blocks = 0
        self._last_preemptions = None
        self._calm_since_s = None


@functools.lru_cache(maxsize=4096)
def _mean_blocks(prompt_tokens: int, new_tokens: int, block_size: int) -> float:
    """Blocks one sequence holds on average over its life (sampled at 64 points at most)."""
    step = max(new_tokens // 64, 1)
    sizes = [
        blocks_for_tokens(prompt_tokens + k, block_size) for k in range(1, new_tokens + 1, step)
    ]
    return sum(sizes) / len(sizes)


def _may_end_early(plan: LengthPlan | None) -> bool:
    """Whether a request planned with ``plan`` may end before its ``max_tokens``."""
    return plan is not None and bool(plan.values) and plan.values[0] < plan.max_new_tokens


def pick_backend(
    candidates: Sequence[BackendAdmission], cost: RequestCost, now_s: float = 0.0
) -> int | None:
    """Index of the candidate that admits ``cost`` now with the most KV to spare, else None.

    Every candidate is asked (so each one's latch reflects this request); ties go to the
    earlier candidate.
    """
    best: int | None = None
    best_free = 0
    for i, cand in enumerate(candidates):
        margin = cand.admit_margin(cost, now_s)
        if margin is None:
            continue
        if best is None or margin > best_free:
            best, best_free = i, margin
    return best


def never_fit_reason(
    candidates: Sequence[BackendAdmission],
    cost: RequestCost,
    max_model_len: int | None,
    prompt_is_lower_bound: bool = False,
) -> str | None:
    """Why the request can never run on any known backend, or None if it may.

    Returns None while no backend's capacity is known (nothing can be said yet).
    ``prompt_is_lower_bound``: the cost's prompt is the fewest tokens it can have (the cheap
    check made before tokenizing); the message then says "at least".
    """
    least = "at least " if prompt_is_lower_bound else ""
    if max_model_len is not None and cost.sequence_tokens > max_model_len:
        return (
            f"This request needs {least}{cost.sequence_tokens} tokens of context "
            f"({least}{cost.prompt_tokens} prompt + {cost.max_new_tokens} max_tokens) but the "
            f"model's maximum context length is {max_model_len} tokens; "
            "shorten the prompt or lower max_tokens."
        )
    known = [c for c in candidates if c.known]
    if not known:
        return None
    if any(c.fits_ever(cost) for c in known):
        return None
    largest = max(known, key=lambda c: (c.capacity_blocks or 0) * (c.block_size or 0))
    assert largest.capacity_blocks is not None and largest.block_size is not None
    capacity_tokens = largest.capacity_blocks * largest.block_size
    return (
        f"This request needs {least}{cost.total_tokens} tokens of KV cache "
        f"({cost.num_sequences} × ({least}{cost.prompt_tokens} prompt + {cost.max_new_tokens} "
        f"max_tokens), {largest.need_blocks(cost)} blocks of {largest.block_size}) but "
        f"the largest backend holds {capacity_tokens} tokens ({largest.capacity_blocks} blocks); "
        "lower max_tokens or n, or shorten the prompt."
    )
