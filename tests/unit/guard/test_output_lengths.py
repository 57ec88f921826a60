"""Learned output lengths: the learner, charging as a request streams, and admission with both."""

from __future__ import annotations

import asyncio

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.backends import BackendPool
from oomguard.guard.config import GuardConfig
from oomguard.guard.gate import Gate
from oomguard.guard.output_lengths import (
    LengthPlan,
    OutputLengths,
    OutputLengthSettings,
    length_class,
    prompt_band,
)
from oomguard.guard.projection import (
    DecodeRate,
    ProgressSettings,
    RequestProgress,
    projected_peak_blocks,
)
from oomguard.guard.queue import AdmissionQueue, DrainRateMeter

CLS = length_class("m", "completions", None, 180)


def learner(**kw: float) -> OutputLengths:
    return OutputLengths(OutputLengthSettings(**kw))  # type: ignore[arg-type]


def test_max_tokens_until_enough_is_known_then_the_quantile() -> None:
    lengths = learner(quantile=0.9, min_samples=10)
    for g in range(9):
        lengths.observe(CLS, 20 + g, 500)
    assert lengths.reservation(CLS, 500) == 500  # 9 samples: not enough
    lengths.observe(CLS, 100, 500)
    # 10 samples: 20..28 and 100; the 0.9 quantile is the 9th of 10 in order.
    assert lengths.reservation(CLS, 500) == 28
    # Never above max_tokens; other classes know nothing yet.
    assert lengths.reservation(CLS, 25) == 25
    assert lengths.reservation(length_class("m", "chat", None, 180), 500) == 500
    assert lengths.reservation(None, 500) == 500


def test_a_sample_stopped_at_its_limit_claims_no_length_it_did_not_show() -> None:
    lengths = learner(quantile=0.5, min_samples=4)
    for _ in range(4):
        lengths.observe(CLS, 300, 300)  # every one stopped at max_tokens=300
    # A new request with the same or a lower limit will run to it as well.
    assert lengths.reservation(CLS, 300) == 300
    assert lengths.reservation(CLS, 200) == 200
    # One with a higher limit: the samples say "at least 300", not "300".
    assert lengths.reservation(CLS, 400) == 400


def test_preemption_tightens_at_once_and_calm_relaxes() -> None:
    lengths = learner(quantile=0.5, min_samples=4, max_tightenings=2, relax_after_s=10.0)
    for g in (10, 20, 30, 40):
        lengths.observe(CLS, g, 100)
    assert lengths.reservation(CLS, 100) == 20
    lengths.tighten(0.0)
    assert lengths.quantile == 0.75
    assert lengths.reservation(CLS, 100) == 30
    lengths.tighten(1.0)
    assert lengths.quantile == 1.0  # max_tightenings reached: max_tokens for all
    assert lengths.reservation(CLS, 100) == 100
    lengths.relax(5.0)
    assert lengths.tightenings == 2  # not calm long enough
    lengths.relax(11.0)
    assert lengths.tightenings == 1
    assert lengths.reservation(CLS, 100) == 30


def test_learning_off_and_classes() -> None:
    lengths = learner(quantile=0.0, min_samples=1)
    lengths.observe(CLS, 5, 100)
    assert lengths.reservation(CLS, 100) == 100
    assert prompt_band(10) == prompt_band(63) == 0
    assert prompt_band(64) != prompt_band(128) != prompt_band(256)
    assert length_class("m", "chat", "team-a", 100) != length_class("m", "chat", "team-b", 100)


def test_a_sequence_outgrowing_its_reservation_is_charged_as_it_streams() -> None:
    rate = DecodeRate(ProgressSettings(lag_s=0.0, lag_floor_tokens=0))
    for _ in range(8):
        rate.observe_rate(100.0)
    lengths = learner(quantile=0.5, min_samples=4)
    for g in (20, 40, 60, 200):
        lengths.observe(CLS, g, 400)
    plan = lengths.plan(CLS, 400)
    assert plan is not None
    p = RequestProgress(100, 400, 1, 0.0, tracked=True, plan=plan)
    p.observe(0, 1, False, 0.01, rate)
    assert p.reserved_new_tokens == 40  # the median of 20, 40, 60, 200
    (fp,) = p.footprints(rate, 0.01)
    assert fp.final_tokens == 140 and fp.remaining_steps == 39
    # Past 40 it is one of the longer ones: planned at the median of 60 and 200.
    p.observe(0, 44, False, 0.44, rate)
    p.observe(0, 45, False, 0.45, rate)  # (the envelope allows for its last step again)
    (fp,) = p.footprints(rate, 0.45)
    assert fp.final_tokens == 160
    # Past every length seen: planned at max_tokens, never beyond.
    p.observe(0, 250, False, 2.5, rate)
    (fp,) = p.footprints(rate, 2.5)
    assert fp.final_tokens == 500 and fp.remaining_steps == 150


def _burst(expected: int | None, learned_watermark: float = 0.9) -> tuple[int, int]:
    """(requests admitted at once, projected peak) for identical tracked requests of 180 + 300
    planned at ``expected`` output tokens, on a pool of 15 blocks of 128."""
    adm = BackendAdmission(
        AdmissionSettings(track_mode="always", stagger=False, learned_watermark=learned_watermark)
    )
    adm.set_capacity(16, 128)
    for _ in range(8):
        adm.rate.observe_rate(50.0)
    # 64 answers of exactly ``expected`` tokens: each runs on with about 1 in 65 only, a risk
    # the sum's veto lets the per-request plan take
    plan = None if expected is None else LengthPlan((float(expected),) * 64, 0.95, 300)
    cost = RequestCost(180, 300, trackable=True, length_plan=plan)
    admitted = 0
    while adm.can_admit(cost, 0.0) and admitted < 40:
        adm.reserve(cost, 0.0)
        admitted += 1
    return admitted, adm.projected_blocks(0.0)


def test_learned_lengths_admit_more_within_the_learned_watermark() -> None:
    full, _ = _burst(None)
    learned, peak = _burst(60)
    assert learned > full
    assert peak <= 0.9 * 15
    # The watermark is what bounds it.
    wider, wide_peak = _burst(60, learned_watermark=1.0)
    assert wider >= learned and wide_peak <= 15


def test_gate_learns_from_completions_and_tightens_on_feedback() -> None:
    async def run() -> None:
        config = GuardConfig(backends=[{"url": "http://b"}], track_progress="always")
        settings = AdmissionSettings(track_mode="always")
        pool = BackendPool(config, settings, on_change=lambda: None)
        backend = pool.backends[0]
        backend.healthy = True
        backend.admission.set_capacity(64, 128)
        lengths = learner(quantile=0.9, min_samples=4)
        gate = Gate(
            pool,
            AdmissionQueue(16, 10**9),
            DrainRateMeter(),
            retry_fallback_s=1.0,
            max_retry_after_s=10,
            lengths=lengths,
        )
        cost = RequestCost(100, 400, trackable=True, length_class=CLS)
        for generated in (30, 35, 40, 45):
            ticket = await gate.acquire(cost, None, 0, 1.0)
            assert ticket.progress.reserved_new_tokens == 400  # nothing known yet
            gate.note_progress(ticket, 0, generated, True)
            gate.release(ticket)
        assert lengths.samples(CLS) == 4
        ticket = await gate.acquire(cost, None, 0, 1.0)
        assert ticket.progress.reserved_new_tokens == 45
        gate.release(ticket)
        # The backend tightens (a preemption): the learned lengths tighten at once.
        backend.admission.observe(0.1, 0.0, 0.0)
        backend.admission.observe(0.1, 3.0, 0.1)
        gate.pump()
        assert lengths.tightenings == 1

    asyncio.run(run())


def test_projection_with_learned_lengths_counts_what_remains() -> None:
    rate = DecodeRate()
    for _ in range(8):
        rate.observe_rate(50.0)
    p = RequestProgress(180, 300, 1, 0.0, tracked=True, plan=LengthPlan((60.0,), 0.95, 300))
    p.observe(0, 1, False, 0.0, rate)
    peak = projected_peak_blocks(p.footprints(rate, 0.0), 128)
    assert peak == 2  # 180 + 60 tokens: two blocks, not the four of 180 + 300


def test_a_new_prompt_band_borrows_its_routes_completions() -> None:
    lengths = learner(quantile=0.9, min_samples=4)
    for g in (10, 20, 30, 40):
        lengths.observe(length_class("m", "chat", None, 100), g, 500)
    other_band = length_class("m", "chat", None, 5000)
    assert lengths.samples(other_band) == 0
    assert lengths.reservation(other_band, 500) == 40
    assert lengths.reservation(length_class("m", "completions", None, 100), 500) == 500
