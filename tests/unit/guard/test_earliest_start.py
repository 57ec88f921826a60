"""A request on its way to the engine holds nothing until its earliest start."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.projection import (
    DecodeRate,
    Footprint,
    ProgressSettings,
    new_request_footprints,
    projected_peak_blocks,
)

delayed_st = st.builds(
    lambda hi, extra, rem, seqs, start: Footprint(hi, hi + extra, rem, seqs, start_step=start),
    st.integers(1, 600),
    st.integers(0, 600),
    st.integers(0, 700),
    st.integers(1, 3),
    st.integers(0, 400),
)


@settings(deadline=None)
@given(st.lists(delayed_st, max_size=8), st.sampled_from([16, 128]))
def test_peak_with_delayed_starts_equals_brute_force(fps: list[Footprint], bs: int) -> None:
    brute = max(sum(f.blocks_at(k, bs) for f in fps) for k in range(1400))
    assert projected_peak_blocks(fps, bs) == brute


def test_delayed_footprint_holds_nothing_before_its_start() -> None:
    fp = Footprint(180, 480, 400, start_step=100)
    assert fp.blocks_at(0, 128) == 0 and fp.blocks_at(99, 128) == 0
    assert fp.blocks_at(100, 128) == 2  # 180 tokens
    assert fp.blocks_at(100 + 205, 128) == 4  # 385 tokens
    assert fp.blocks_at(400, 128) == 0  # ended


def _rate(starts: list[float], share: float = 0.5) -> DecodeRate:
    rate = DecodeRate(ProgressSettings(earliest_start_share=share))
    for _ in range(8):
        rate.observe_rate(10.0)
    for s in starts:
        rate.observe_start(s)
    return rate


def test_earliest_start_is_a_share_of_the_low_start_latencies() -> None:
    assert _rate([4.0] * 2).earliest_start_s() == 0.0  # too few starts seen
    rate = _rate([4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0])
    assert rate.earliest_start_s() == 2.0  # half of the lowest
    assert _rate([4.0] * 8, share=0.0).earliest_start_s() == 0.0
    assert ProgressSettings().earliest_start_share == 0.0  # off unless asked for
    (fp,) = new_request_footprints(180, 300, 1, rate, True)
    # 10 tokens/s, starting no sooner than 2 s (less the lag allowance): ~19 steps of nothing.
    assert 15 <= fp.start_step <= 20
    assert fp.blocks_at(fp.start_step - 1, 128) == 0


def test_a_request_is_admitted_while_the_one_ending_makes_room() -> None:
    """A pool of 5 blocks holds one 180 + 300 request 290 tokens in (4 blocks, 10 steps
    left). A second request of the same size does not fit beside it; admitted now, it reaches
    the engine no sooner than the slow intake allows, after the first has ended."""

    def admission(starts: list[float]) -> tuple[BackendAdmission, object]:
        adm = BackendAdmission(
            AdmissionSettings(
                track_mode="always",
                stagger=False,
                engine_queue_requests=0,
                progress=ProgressSettings(earliest_start_share=0.5),
            )
        )
        adm.set_capacity(6, 128)
        for _ in range(8):
            adm.rate.observe_rate(10.0)
        for s in starts:
            adm.rate.observe_start(s)
        cost = RequestCost(180, 300, trackable=True)
        first = adm.reserve(cost, 0.0)
        adm.note_progress(first, 0, 1, False, starts[0])
        adm.note_progress(first, 0, 290, False, starts[0] + 28.9)
        return adm, cost

    quick, cost = admission([0.1] * 8)
    assert not quick.can_admit(cost, 29.1)  # could start at once: it would not fit
    slow, cost = admission([5.0] * 8)
    assert slow.can_admit(cost, 34.0)  # 2.5 s at least: the first has ended by then
