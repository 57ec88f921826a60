"""Projected-peak admission: the pure math, and a lockstep engine that must never overflow.

The simulator below plays vLLM's part the way the projection assumes it behaves: every running
sequence gains one token per step and frees its blocks when it stops; the gateway sees each
request's progress late (a lag of a few steps, observations coalesced), requests start a few
steps after being admitted, some stop early (EOS). Hypothesis draws arrival patterns, prompt
lengths, ``max_tokens`` and early stops; at every step the blocks really in use must stay
within the pool, and every request must finish.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.projection import (
    DecodeRate,
    Footprint,
    ProgressSettings,
    RequestProgress,
    blocks_for_tokens,
    full_footprint,
    projected_peak_blocks,
)

# -- the peak itself ----------------------------------------------------------------------


def brute_peak(fps: list[Footprint], block_size: int, horizon: int) -> int:
    return max(sum(f.blocks_at(k, block_size) for f in fps) for k in range(horizon))


footprint_st = st.builds(
    lambda hi, extra, rem, seqs, bounded: Footprint(hi, hi + extra, rem if bounded else None, seqs),
    st.integers(1, 600),
    st.integers(0, 600),
    st.integers(0, 700),
    st.integers(1, 3),
    st.booleans(),
)


@settings(deadline=None)  # the brute force is slow on a loaded machine; correctness is the point
@given(st.lists(footprint_st, max_size=8), st.sampled_from([16, 128]))
def test_peak_equals_brute_force_over_every_step(fps: list[Footprint], block_size: int) -> None:
    assert projected_peak_blocks(fps, block_size) == brute_peak(fps, block_size, 1400)


def test_staggered_requests_need_less_than_their_final_sizes() -> None:
    # The issue-4 shape: 180-token prompts, 300 new tokens, blocks of 128 → 4 blocks at the end.
    assert blocks_for_tokens(480, 128) == 4
    fresh = Footprint(180, 480, 300)  # just started: 2 blocks, 3 from token 257, 4 from 385
    mid = Footprint(330, 480, 150)  # 3 blocks now, 4 from step 55, gone at step 150
    late = Footprint(450, 480, 30)  # 4 blocks for 30 more steps
    # Step 29 (just before `late` ends): 2 + 3 + 4; plain reservations would hold 3 × 4 = 12.
    assert projected_peak_blocks([fresh, mid, late], 128) == 9
    # Unknown progress: the full size, with no end in sight.
    assert projected_peak_blocks([full_footprint(480, 2), late], 128) == 12


def test_no_footprints_no_peak() -> None:
    assert projected_peak_blocks([], 16) == 0
    assert projected_peak_blocks([Footprint(10, 20, 0)], 16) == 0  # already ended


# -- envelopes ----------------------------------------------------------------------------


def rate(tokens_per_s: float | None = 100.0, **kw: float) -> DecodeRate:
    r = DecodeRate(ProgressSettings(**kw))  # type: ignore[arg-type]
    if tokens_per_s is not None:
        r.observe_rate(tokens_per_s, 0.0)
    return r


def test_untracked_or_rate_unknown_holds_the_full_reservation() -> None:
    p = RequestProgress(100, 200, 2, sent_at_s=0.0, tracked=False)
    assert p.footprints(rate(), 1.0) == [full_footprint(300, 2)]
    t = RequestProgress(100, 200, 1, sent_at_s=0.0, tracked=True)
    assert t.footprints(rate(None), 1.0) == [full_footprint(300, 1)]


def test_started_sequence_envelope_covers_the_lag() -> None:
    r = rate(100.0, lag_s=0.05, lag_floor_tokens=2)
    p = RequestProgress(100, 200, 1, sent_at_s=0.0, tracked=True)
    p.observe(0, 10, False, now_s=0.1, rate=r)
    p.observe(0, 14, False, now_s=0.14, rate=r)
    (fp,) = p.footprints(r, now_s=0.16)
    # seen 14 tokens, 4 in the last chunk; 0.02 s stale + 0.05 s lag at 100 tok/s = 7 tokens.
    assert fp.hi_tokens == 100 + 14 + 2 + 4 + 7
    assert fp.remaining_steps == 200 - 14
    assert fp.final_tokens == 300


def test_finished_sequences_hold_nothing_and_unseen_ones_are_bounded() -> None:
    r = rate(100.0, start_allowance_s=0.5)
    p = RequestProgress(50, 100, 3, sent_at_s=0.0, tracked=True)
    p.observe(0, 5, True, now_s=0.1, rate=r)  # EOS early
    p.observe(1, 5, False, now_s=0.1, rate=r)
    fps = p.footprints(r, now_s=0.1)
    assert len(fps) == 2
    unseen = fps[1]
    assert unseen.sequences == 1
    # May start as late as the deadline (0.5 s after sending): 40 more steps at 100 tok/s.
    assert unseen.remaining_steps == 100 + 40 + 1
    # Overdue: the unseen sequence is unknown again and holds its full size.
    fps = p.footprints(r, now_s=0.7)
    assert fps[1] == full_footprint(150, 1)


def test_decode_rate_and_start_latency_come_from_recent_quantiles() -> None:
    r = DecodeRate(ProgressSettings(window=10, rate_quantile=0.9, start_allowance_s=0.2))
    for v in (100.0,) * 9 + (1000.0,):
        r.observe_rate(v)
    # One outlier in ten: the 0.9 quantile is it; after ten more ordinary samples it is gone.
    assert r.tokens_per_s == 1000.0 and r.low_tokens_per_s == 100.0
    for _ in range(10):
        r.observe_rate(120.0)
    assert r.tokens_per_s == 120.0
    # Until min_samples starts were seen the allowance holds; then margin × quantile.
    r.observe_start(0.3)
    assert r.start_deadline_s() == pytest.approx(1.5 * 0.3)
    for v in (0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1):
        r.observe_start(v)
    assert r.start_deadline_s() == pytest.approx(1.5 * 0.3)  # 0.95 quantile of 10 = 0.3


def test_shared_prompt_blocks_count_once_for_n_sequences() -> None:
    r = rate(100.0)
    # 300-token prompt, n = 4, 100 new tokens, blocks of 128: 2 full prompt blocks shared.
    p = RequestProgress(300, 100, 4, 0.0, tracked=False, shared_tokens=256)
    fps = p.footprints(r, 0.0)
    # Private: 44 + 100 = 144 tokens = 2 blocks each; shared: 2 blocks once.
    assert projected_peak_blocks(fps, 128) == 4 * 2 + 2
    assert RequestCost(300, 100, 4, inputs=1).blocks(128, prefix_caching=True) == 10
    assert RequestCost(300, 100, 4, inputs=1).blocks(128, prefix_caching=False) == 4 * 4
    # Estimated prompts, or several prompts, share nothing.
    assert RequestCost(300, 100, 4, prompt_exact=False).blocks(128, True) == 16
    assert RequestCost(300, 100, 4, inputs=2).blocks(128, True) == 16


# -- the lockstep engine ------------------------------------------------------------------

STEP_S = 0.01  # one engine step: 100 tokens/s per sequence


@dataclass
class Arrival:
    at_step: int
    prompt: int
    max_new: int
    stop_after: int  # tokens generated before EOS (== max_new: runs to the end)
    start_delay: int  # steps between admission and the first engine step
    lag: int  # steps the gateway's view lags the engine
    every: int  # the gateway sees progress every this many steps (coalescing)


@dataclass
class _Live:
    arrival: Arrival
    handle: RequestProgress
    admitted_step: int
    generated: int = 0
    started: bool = False
    history: list[int] = field(default_factory=list)  # generated after each step
    engine_done_step: int | None = None


def simulate(
    arrivals: list[Arrival],
    capacity_blocks: int,
    block_size: int,
    track: bool = True,
    max_steps: int = 6000,
    high_watermark: float = 0.9,
    low_watermark: float = 0.8,
    projected_watermark: float = AdmissionSettings().projected_watermark,
) -> tuple[int, float, int]:
    """Run to completion; returns (peak blocks in use, mean running sequences, steps)."""
    adm = BackendAdmission(
        AdmissionSettings(
            high_watermark=high_watermark,
            low_watermark=low_watermark,
            projected_watermark=projected_watermark,
            track_mode="always" if track else "off",
            progress=ProgressSettings(lag_s=0.05, lag_floor_tokens=2, start_allowance_s=0.5),
        )
    )
    adm.set_capacity(capacity_blocks + 1, block_size)
    pending = deque(sorted(arrivals, key=lambda a: a.at_step))
    queue: deque[Arrival] = deque()
    live: list[_Live] = []
    finished = 0
    peak_used = 0
    running_sum = 0
    for step in range(max_steps):
        now = step * STEP_S
        while pending and pending[0].at_step <= step:
            queue.append(pending.popleft())
        # Engine: like vLLM, a request starts (after its delay) only when its prompt fits the
        # free blocks; every started, unfinished sequence gains one token in this step.
        held = sum(
            blocks_for_tokens(lv.arrival.prompt + lv.generated, block_size)
            for lv in live
            if lv.started and lv.engine_done_step is None
        )
        for lv in live:
            ready = step >= lv.admitted_step + lv.arrival.start_delay
            if ready and not lv.started:
                need = blocks_for_tokens(lv.arrival.prompt + 1, block_size)
                if held + need <= capacity_blocks:
                    lv.started = True
                    held += need
        used = 0
        running = 0
        for lv in live:
            if lv.engine_done_step is None and lv.started:
                lv.generated += 1
                if lv.generated >= lv.arrival.stop_after:
                    lv.engine_done_step = step
                else:
                    used += blocks_for_tokens(lv.arrival.prompt + lv.generated, block_size)
                    running += 1
            lv.history.append(lv.generated)
        peak_used = max(peak_used, used)
        running_sum += running
        assert used <= capacity_blocks, f"step {step}: {used} blocks of {capacity_blocks}"
        # Gateway: sees each request's progress `lag` steps late, every `every` steps.
        for lv in list(live):
            a = lv.arrival
            if (step - lv.admitted_step) % a.every:
                continue
            seen_step = step - lv.admitted_step - a.lag
            if seen_step < 0:
                continue
            seen = lv.history[seen_step]
            if seen == 0:
                continue
            done = seen >= a.stop_after
            adm.note_progress(lv.handle, 0, seen, done, now, a.prompt)
            if done:
                adm.release(lv.handle, now)
                live.remove(lv)
                finished += 1
        while queue:
            a = queue[0]
            cost = RequestCost(a.prompt, a.max_new, trackable=True)
            if not adm.can_admit(cost, now):
                break
            queue.popleft()
            live.append(_Live(a, adm.reserve(cost, now), admitted_step=step + 1))
        if finished == len(arrivals):
            return peak_used, running_sum / (step + 1), step + 1
    raise AssertionError(f"not all requests finished in {max_steps} steps")


arrival_st = st.builds(
    lambda at, prompt, max_new, stop_frac, delay, lag, every: Arrival(
        at, prompt, max_new, max(1, round(max_new * stop_frac)), delay, lag, every
    ),
    st.integers(0, 300),
    st.integers(1, 400),
    st.integers(1, 400),
    st.sampled_from([1.0, 1.0, 1.0, 0.5, 0.1]),
    st.integers(0, 40),  # up to 0.4 s to start (the allowance is 0.5 s)
    st.integers(0, 4),  # up to 0.04 s late (the lag allowance is 0.05 s)
    st.integers(1, 3),
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(
    st.lists(arrival_st, min_size=1, max_size=24),
    st.integers(8, 40),
    st.sampled_from([16, 64, 128]),
)
def test_lockstep_engine_never_exceeds_the_pool(
    arrivals: list[Arrival], capacity_blocks: int, block_size: int
) -> None:
    fits = [
        a
        for a in arrivals
        if blocks_for_tokens(a.prompt + a.max_new, block_size) <= capacity_blocks
    ]
    if not fits:
        return
    peak, _, _ = simulate(fits, capacity_blocks, block_size)
    assert peak <= capacity_blocks


def issue4_burst(track: bool, projected_watermark: float = 1.0) -> tuple[int, float, int]:
    burst = [Arrival(0, 180, 300, 300, start_delay=3, lag=2, every=1) for _ in range(32)]
    return simulate(
        burst,
        capacity_blocks=15,
        block_size=128,
        track=track,
        projected_watermark=projected_watermark,
    )


def test_issue4_burst_runs_more_at_once_than_plain_reservations() -> None:
    peak_plain, mean_plain, steps_plain = issue4_burst(track=False)
    peak, mean, steps = issue4_burst(track=True)
    assert peak_plain <= 12 and mean_plain <= 3.0  # 3 × 4 blocks under the 13.5 watermark
    assert peak <= 15  # the projected peak may fill the pool (projected_watermark 1.0)
    # Measured: 3.63 running on average instead of 2.85, the burst done in 2,639 steps
    # instead of 3,356.
    assert mean >= 1.2 * mean_plain, (mean, mean_plain)
    assert steps <= 0.82 * steps_plain, (steps, steps_plain)
    # With the projection held under the 0.9 watermark too: 13 blocks, which the fourth
    # request reaches while the first three are at 4 blocks, so cohorts of 3 as above.
    peak_09, _, steps_09 = issue4_burst(track=True, projected_watermark=0.9)
    assert peak_09 <= 13
    assert steps < steps_09 <= steps_plain, (steps, steps_09, steps_plain)
