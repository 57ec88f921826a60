"""The projected KV sum over time with learned output lengths (oomguard.guard.projected_sum)."""

from __future__ import annotations

import itertools
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.output_lengths import LengthPlan, OutputLengths, length_class
from oomguard.guard.projected_sum import overflow_probability
from oomguard.guard.projection import Footprint, LearnedSequence, projected_peak_blocks

BS = 16

footprints = st.lists(
    st.builds(
        Footprint,
        hi_tokens=st.integers(1, 400),
        final_tokens=st.integers(1, 600),
        remaining_steps=st.one_of(st.none(), st.integers(1, 500)),
        sequences=st.integers(1, 3),
        start_step=st.integers(0, 40),
    ).filter(lambda f: f.hi_tokens <= f.final_tokens),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(footprints, st.integers(0, 120))
def test_without_learned_lengths_it_is_the_envelopes_peak(fps: list[Footprint], limit: int) -> None:
    risk, expected = overflow_probability(fps, [], BS, limit)
    peak = projected_peak_blocks(fps, BS)
    assert expected == peak
    assert risk == (1.0 if peak > limit else 0.0)


def _plan(lengths: list[float], max_new: int) -> LengthPlan:
    values = tuple(sorted(min(v, max_new) for v in lengths))
    return LengthPlan(values, 0.95, max_new, np.sort(np.asarray(lengths, dtype=float)))


def test_one_sequence_by_hand() -> None:
    # lengths 16, 32, 48, 64 equally likely; a 16-token prompt; nothing generated yet
    seq = LearnedSequence(16, 0, 80, 64, _plan([16, 32, 48, 64], 64))
    # from step 17 it holds 3 blocks (33+ tokens) while it runs: 3 of the 4 lengths run on
    risk, expected = overflow_probability([], [seq], BS, 2)
    assert risk == 0.75
    # 5 blocks (65+ tokens) only at the longest length, 1 in 4
    assert overflow_probability([], [seq], BS, 4)[0] == 0.25
    assert overflow_probability([], [seq], BS, 5)[0] == 0.0
    # expected blocks: at most 2.25 (3 blocks × 3/4 at step 31), 3 whole
    assert expected == 3


def test_the_risk_is_exact_or_above_against_every_outcome() -> None:
    rng = random.Random(1)
    for _ in range(25):
        lengths = sorted(rng.lognormvariate(3, 0.7) for _ in range(20))
        plan = _plan(lengths, 150)
        seqs = [
            LearnedSequence(rng.randint(20, 80), rng.randint(0, 30), 230, 150, plan)
            for _ in range(rng.randint(1, 7))
        ]
        env = [Footprint(50, 120, rng.randint(1, 100))]
        limit = rng.randint(8, 30)
        risk, _ = overflow_probability(env, seqs, BS, limit)
        exact = _brute_force(env, seqs, limit)
        # every step evaluated where the horizon is short; an upper bound where it is not
        assert risk >= exact - 1e-9
        if max(s.last_step for s in seqs) < 95:
            assert abs(risk - exact) < 1e-9


def _brute_force(env: list[Footprint], seqs: list[LearnedSequence], limit: int) -> float:
    """The same probability from every combination of running and ended sequences, at every
    step up to the last one any of them may run."""
    last = max([*(s.last_step for s in seqs), *(f.remaining_steps or 0 for f in env)])
    worst = 0.0
    for k in range(last + 2):
        fixed = sum(f.blocks_at(k, BS) for f in env)
        terms = []
        for s in seqs:
            reached = s.generated + max(k - s.start_steps, 0)
            longer = [v for v in s.plan.values if v > s.generated]
            still = [v for v in longer if v > reached]
            p = len(still) / len(longer) if longer else 1.0
            p = max(p, 1 / (len(longer) + 1)) if longer else p
            p = p if reached < s.max_new_tokens else 0.0
            held = -(-min(s.hi_tokens + k, s.final_tokens) // BS) * s.sequences
            terms.append((p, held))
        total = 0.0
        for alive in itertools.product((False, True), repeat=len(terms)):
            prob, blocks = 1.0, fixed
            for (p, held), on in zip(terms, alive, strict=True):
                prob *= p if on else 1 - p
                blocks += held if on else 0
            if blocks > limit:
                total += prob
        worst = max(worst, total)
    return worst


def test_a_sequence_longer_than_every_length_seen_runs_to_its_limit() -> None:
    seq = LearnedSequence(16 + 150, 150, 216, 200, _plan([10, 12, 14], 200))
    # nothing longer than 150 was seen: it runs on to max_tokens (216 tokens, 14 blocks)
    assert overflow_probability([], [seq], BS, 13)[0] == 1.0
    assert overflow_probability([], [seq], BS, 14)[0] == 0.0


def test_never_below_one_in_n_plus_one_of_running_on() -> None:
    seq = LearnedSequence(16, 0, 416, 400, _plan([20.0] * 9, 400))
    # past 20 tokens it still runs with probability 1/10 (not 0) until its max_tokens
    assert abs(overflow_probability([], [seq], BS, 25)[0] - 0.1) < 1e-12


def _admitted(projection: str) -> int:
    """Requests of a learned class admitted at once on a pool of 60 blocks of 16."""
    lengths = OutputLengths()
    rng = random.Random(5)
    cls = length_class("m", "completions", None, 100)
    for _ in range(64):
        lengths.observe(cls, int(rng.lognormvariate(3.0, 0.5)), 200)
    adm = BackendAdmission(
        AdmissionSettings(track_mode="always", stagger=False, learned_sum=projection == "sum")
    )
    adm.set_capacity(61, BS)
    for _ in range(8):
        adm.rate.observe_rate(50.0)
        adm.rate.observe_start(0.02)
    count = 0
    while count < 100:
        cost = RequestCost(
            100, 200, trackable=True, length_plan=lengths.plan(cls, 200), length_class=cls
        )
        if not adm.can_admit(cost, 0.0):
            break
        adm.reserve(cost, 0.0)
        count += 1
    return count


def test_admission_on_the_sum_takes_more_than_per_request_quantiles() -> None:
    per_request = _admitted("per-request")
    summed = _admitted("sum")
    assert summed > per_request >= 1


def _admits_beside_a_long_runner(veto: float | None) -> bool:
    """A pool of 15 blocks of 128; a class whose last ten answers ran 50–336 tokens; in flight,
    one of its requests (400-token prompt, max_tokens 768) that has generated 145 tokens, so
    3 of the 10 lengths are still ahead of it. A new request (269 + up to 755) asks to join."""
    lengths = OutputLengths()
    cls = length_class("m", "completions", None, 200)
    for v in (50, 53, 71, 78, 87, 106, 118, 219, 231, 336):
        lengths.observe(cls, v, 768)
    adm = BackendAdmission(
        AdmissionSettings(learned_plan_veto=veto, stagger=False, track_mode="always")
    )
    adm.set_capacity(16, 128, prefix_caching=True)
    for _ in range(8):
        adm.rate.observe_rate(190.0)
        adm.rate.observe_start(0.1)
    cost = RequestCost(400, 768, trackable=True, length_plan=lengths.plan(cls, 768))
    running = adm.reserve(cost, 0.0)
    now = 145 / 190.0 + 0.1
    adm.note_progress(running, 0, 145, False, now, 400)
    new = RequestCost(269, 755, trackable=True, length_plan=lengths.plan(cls, 755))
    return adm.can_admit(new, now)


def test_the_sum_vetoes_a_per_request_plan_that_risks_overflow() -> None:
    """Planned at their quantiles the two fit: the running one ends by 336 tokens, the new one
    too. But the running one has outlived 7 of the 10 lengths, so it runs on to its 768 with a
    chance of at least 1 in 4, and then the two overflow the pool if the new one also runs
    long: the per-request plan admits, the sum's risk vetoes it."""
    assert _admits_beside_a_long_runner(None) is True
    assert _admits_beside_a_long_runner(1.0) is False
