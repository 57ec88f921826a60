"""The projected watermark: tracked requests may plan the whole pool; the others keep 0.9.

Pool of 15 usable blocks of 128 tokens; requests of 180 prompt + 300 new tokens (4 blocks at
their end), as in the issue-4 burst.
"""

from __future__ import annotations

import pytest

from oomguard.errors import BadInput
from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.config import build_config
from oomguard.guard.projection import ProgressSettings

BURST = RequestCost(prompt_tokens=180, max_new_tokens=300, trackable=True)
UNTRACKABLE = RequestCost(prompt_tokens=180, max_new_tokens=300, trackable=False)
RATE_TOKENS_PER_S = 100.0


def _backend(projected_watermark: float = 1.0) -> BackendAdmission:
    b = BackendAdmission(
        AdmissionSettings(
            track_mode="always",
            projected_watermark=projected_watermark,
            progress=ProgressSettings(lag_s=0.0, lag_floor_tokens=0, start_allowance_s=0.5),
        )
    )
    b.set_capacity(16, 128)  # 15 usable blocks
    return b


def _cohort_at(b: BackendAdmission, generated: int, now_s: float) -> None:
    """Admit three burst requests at t=0 and report them at ``generated`` tokens at ``now_s``."""
    handles = [b.reserve(BURST, 0.0) for _ in range(3)]
    for p in handles:
        # Two observations far enough apart to teach the decode rate.
        b.note_progress(p, 0, 1, False, 0.01)
        b.note_progress(p, 0, generated, False, now_s)
    assert b.rate.tokens_per_s is not None


def test_fourth_request_fits_under_the_whole_pool_once_the_cohort_is_under_way() -> None:
    # Three at 4 blocks = 12 ≤ 13.5 go in on plain reservations; a fourth needs the projection:
    # started when the cohort has 200 steps left, it holds 180 + 200 = 380 tokens (3 blocks)
    # when they end, so the peak is 12 + 3 = 15 blocks: under 1.0 × 15, not under 0.9 × 15.
    now_s = 1.0
    whole = _backend(1.0)
    _cohort_at(whole, generated=100, now_s=now_s)
    assert whole.can_admit(BURST, now_s)
    margin = whole.admit_margin(BURST, now_s)
    assert margin is not None and margin >= 0

    held = _backend(0.9)
    _cohort_at(held, generated=100, now_s=now_s)
    assert not held.can_admit(BURST, now_s)
    assert not held.paused  # refused on the projection alone: no latch, it waits for progress


def test_requests_of_unknown_progress_still_stop_at_the_high_watermark() -> None:
    b = _backend(1.0)
    for _ in range(3):
        b.reserve(UNTRACKABLE, 0.0)  # 12 blocks held at full size, nothing to project
    assert not b.can_admit(BURST, 1.0)  # 12 + 4 > 0.9 × 15, whatever the projection says
    assert b.paused  # refused with the full-size reservations in the high band: latched


def test_usage_up_to_the_projected_watermark_does_not_tighten_while_tracking() -> None:
    b = _backend(1.0)
    _cohort_at(b, generated=100, now_s=1.0)
    b.observe(kv_usage=0.95, preemptions_total=0.0, now_s=1.0)
    assert b.effective_fraction == 1.0 and not b.paused
    b.observe(kv_usage=0.95, preemptions_total=1.0, now_s=2.5)  # a preemption still tightens
    assert b.effective_fraction == pytest.approx(0.9)

    untracked = _backend(1.0)
    untracked.reserve(UNTRACKABLE, 0.0)
    untracked.observe(kv_usage=0.95, preemptions_total=0.0, now_s=1.0)
    assert untracked.effective_fraction == pytest.approx(0.9)  # nothing tracked: 0.9 applies


def test_projected_watermark_may_not_undercut_the_high_watermark() -> None:
    cfg = build_config({"backends": ["http://x:1"]})
    assert (cfg.projected_watermark, cfg.track_progress) == (1.0, "auto")
    with pytest.raises(BadInput, match="projected_watermark"):
        build_config({"backends": ["http://x:1"], "projected_watermark": 0.85})
    cfg = build_config({"backends": ["http://x:1"], "projected_watermark": 0.9})
    assert cfg.projected_watermark == 0.9
