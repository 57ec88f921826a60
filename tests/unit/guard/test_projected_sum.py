"""The projected KV sum over time with learned output lengths (oomguard.guard.projected_sum)."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.output_lengths import LengthPlan, OutputLengths, length_class
from oomguard.guard.projected_sum import projected_sum_blocks
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
@given(footprints)
def test_without_learned_lengths_it_is_the_envelopes_peak(fps: list[Footprint]) -> None:
    assert projected_sum_blocks(fps, [], BS, 3.0) == projected_peak_blocks(fps, BS)


def _plan(lengths: list[float], max_new: int) -> LengthPlan:
    values = tuple(sorted(min(v, max_new) for v in lengths))
    return LengthPlan(values, 0.95, max_new, np.sort(np.asarray(lengths, dtype=float)))


def test_one_sequence_expected_blocks_by_hand() -> None:
    # lengths 16, 32, 48, 64 equally likely; a 16-token prompt; nothing generated yet
    plan = _plan([16, 32, 48, 64], 64)
    seq = LearnedSequence(16, 0, 80, 64, plan)
    # at z = 0 the largest expected size: at step 15 it holds 31 tokens (2 blocks) for sure;
    # at step 31, 47 tokens (3 blocks) with probability 3/4 = 2.25; at 47, 63 tokens (4 blocks)
    # × 1/2 = 2; at 63, 79 tokens (5 blocks) × 1/4 = 1.25: 2.25 blocks, 3 whole
    assert projected_sum_blocks([], [seq], BS, 0.0) == 3
    # a large margin is capped by the worst case: 5 blocks at its max_tokens
    assert projected_sum_blocks([], [seq], BS, 50.0) == 5


def test_a_sequence_longer_than_every_length_seen_runs_to_its_limit() -> None:
    plan = _plan([10, 12, 14], 200)
    seq = LearnedSequence(16 + 150, 150, 216, 200, plan)
    # nothing longer than 150 was seen: certain to run on to max_tokens (216 tokens, 14 blocks)
    assert projected_sum_blocks([], [seq], BS, 0.0) == 14


def test_never_below_one_in_n_plus_one_of_running_on() -> None:
    lengths = [20.0] * 9  # every one seen ended at 20
    plan = _plan(lengths, 400)
    seq = LearnedSequence(16, 0, 416, 400, plan)
    # past 20 tokens it still runs with probability 1/10 (not 0) until its max_tokens
    expected = projected_sum_blocks([], [seq], BS, 0.0)
    assert expected == 3  # 26 blocks at 416 tokens × 0.1 = 2.6


def test_many_independent_lengths_sum_far_below_their_quantiles() -> None:
    rng = random.Random(3)
    lengths = [rng.lognormvariate(4.8, 0.8) for _ in range(256)]
    plan = _plan(lengths, 768)
    seqs = [LearnedSequence(200, 0, 968, 768, plan) for _ in range(40)]
    q95 = plan.planned(0)
    per_request = projected_peak_blocks([Footprint(200, 200 + q95, q95) for _ in range(40)], BS)
    summed = projected_sum_blocks([], seqs, BS, 1.645)
    expected = projected_sum_blocks([], seqs, BS, 0.0)
    assert expected < summed < 0.8 * per_request


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
