"""Pure admission logic: reservations, watermarks with hysteresis, capacity tightening."""

from __future__ import annotations

import pytest

from oomguard.guard.admission import (
    AdmissionSettings,
    BackendAdmission,
    RequestCost,
    blocks_for_tokens,
    never_fit_reason,
    pick_backend,
)


def backend(num_gpu_blocks: int = 101, block_size: int = 16, **settings: float) -> BackendAdmission:
    b = BackendAdmission(AdmissionSettings(**settings))  # type: ignore[arg-type]
    b.set_capacity(num_gpu_blocks, block_size)
    return b


def cost_blocks(blocks: int, block_size: int = 16) -> RequestCost:
    """A request that needs exactly ``blocks`` blocks."""
    return RequestCost(prompt_tokens=blocks * block_size - 1, max_new_tokens=1)


def test_blocks_round_up_per_sequence() -> None:
    assert blocks_for_tokens(0, 16) == 0
    assert blocks_for_tokens(1, 16) == 1
    assert blocks_for_tokens(16, 16) == 1
    assert blocks_for_tokens(17, 16) == 2
    c = RequestCost(prompt_tokens=100, max_new_tokens=29, num_sequences=3)
    assert c.sequence_tokens == 129
    assert c.total_tokens == 387
    assert c.blocks(16) == 3 * 9  # ceil(129/16) = 9 per sequence


def test_capacity_excludes_null_block() -> None:
    b = backend(num_gpu_blocks=101)
    assert b.capacity_blocks == 100
    assert b.effective_capacity_blocks == 100


def test_unknown_capacity_admits_nothing() -> None:
    b = BackendAdmission()
    assert not b.can_admit(cost_blocks(1))
    assert not b.fits_ever(cost_blocks(1))


def test_admits_up_to_high_watermark_then_latches_until_low() -> None:
    b = backend()  # 100 usable blocks, high 90, low 80
    held = []
    for blocks in (10,) * 8 + (5, 5):
        assert b.can_admit(cost_blocks(blocks))
        held.append(b.reserve(cost_blocks(blocks)))
    assert b.reserved_blocks == 90
    # 90 + 5 > 90: refused, and since usage is in the high band the latch closes.
    assert not b.can_admit(cost_blocks(5))
    assert b.paused and b.pause_count == 1
    # Releasing to 85 would leave room for 5 blocks, but the latch holds until below 80.
    b.release(held.pop())
    assert b.reserved_blocks == 85
    assert not b.can_admit(cost_blocks(5))
    assert b.paused
    b.release(held.pop())
    assert b.reserved_blocks == 80 and b.paused  # not below 80 yet
    b.release(held.pop())
    assert b.reserved_blocks == 70
    assert not b.paused
    assert b.can_admit(cost_blocks(5))
    assert b.pause_count == 1
    # Releasing twice is harmless.
    b.release(held[0])
    b.release(held[0])
    assert b.reserved_blocks == 60


def test_large_request_below_low_band_waits_without_latching() -> None:
    b = backend()
    b.reserve(cost_blocks(50))
    assert not b.can_admit(cost_blocks(45))  # 95 > 90
    assert not b.paused  # usage 50 % is below the low watermark: just no room yet
    assert b.can_admit(cost_blocks(40))


def test_idle_backend_takes_a_request_that_fits_the_whole_pool() -> None:
    b = backend()
    assert b.can_admit(cost_blocks(100))  # above the watermark, but alone it fits
    assert not b.can_admit(cost_blocks(101))  # never fits


def test_observed_usage_counts_traffic_that_bypasses_the_gateway() -> None:
    b = backend()
    b.observe(kv_usage=0.85, preemptions_total=0, now_s=0.0)
    assert b.used_blocks == 85
    assert not b.can_admit(cost_blocks(10))  # 85 + 10 > 90
    assert b.paused


def test_preemption_tightens_and_calm_relaxes() -> None:
    b = backend(tighten_factor=0.9, relax_step=0.05, calm_period_s=5.0, tighten_cooldown_s=1.0)
    b.observe(0.5, 0, now_s=0.0)
    assert b.effective_fraction == 1.0
    b.observe(0.5, 3, now_s=0.25)
    assert b.effective_fraction == pytest.approx(0.9)
    assert b.preemptions_seen == 3
    assert b.effective_capacity_blocks == 90
    # More preemptions inside the cooldown are counted but do not tighten again.
    b.observe(0.5, 4, now_s=0.5)
    assert b.effective_fraction == pytest.approx(0.9)
    assert b.preemptions_seen == 4
    b.observe(0.5, 5, now_s=1.6)
    assert b.effective_fraction == pytest.approx(0.81)
    # Calm: no new preemptions. Relax only after a whole calm period.
    b.observe(0.5, 5, now_s=4.0)
    assert b.effective_fraction == pytest.approx(0.81)
    b.observe(0.5, 5, now_s=6.7)
    assert b.effective_fraction == pytest.approx(0.86)
    for t in range(7, 60):
        b.observe(0.5, 5, now_s=float(t))
    assert b.effective_fraction == 1.0


def test_tightening_has_a_floor() -> None:
    b = backend(min_capacity_fraction=0.5, tighten_cooldown_s=0.0)
    for i in range(1, 40):
        b.observe(0.5, float(i), now_s=float(i))
    assert b.effective_fraction == 0.5


def test_usage_above_high_watermark_tightens_and_latches() -> None:
    b = backend()
    b.observe(0.95, 0, now_s=0.0)
    assert b.effective_fraction == pytest.approx(0.9)
    assert b.paused
    b.observe(0.3, 0, now_s=0.5)
    assert not b.paused


def test_preemption_counter_reset_is_a_restart_not_a_storm() -> None:
    b = backend()
    b.observe(0.1, 100, now_s=0.0)
    b.observe(0.1, 0, now_s=1.0)  # restarted server
    assert b.effective_fraction == 1.0
    assert b.preemptions_seen == 0


def test_tightened_capacity_lowers_the_watermark() -> None:
    b = backend(tighten_cooldown_s=0.0)
    b.observe(0.0, 0, now_s=0.0)
    b.observe(0.0, 1, now_s=1.0)  # 0.9 → 90 effective blocks → high watermark at 81
    b.reserve(cost_blocks(75))
    assert b.can_admit(cost_blocks(6))
    assert not b.can_admit(cost_blocks(7))


def test_pick_backend_prefers_most_free_kv_including_reservations() -> None:
    a, b = backend(), backend(num_gpu_blocks=201)
    b.reserve(cost_blocks(150))  # 200 usable, 50 free
    assert pick_backend([a, b], cost_blocks(10)) == 0  # a has 100 free
    a.reserve(cost_blocks(60))  # a: 40 free
    assert pick_backend([a, b], cost_blocks(10)) == 1
    assert pick_backend([a, b], cost_blocks(150)) is None


def test_pick_backend_skips_unknown_capacity() -> None:
    assert pick_backend([BackendAdmission(), backend()], cost_blocks(1)) == 1


def test_never_fit_reasons_state_the_limit() -> None:
    b = backend()
    ok = RequestCost(prompt_tokens=100, max_new_tokens=100)
    assert never_fit_reason([b], ok, max_model_len=1024) is None
    too_long = RequestCost(prompt_tokens=1000, max_new_tokens=100)
    msg = never_fit_reason([b], too_long, max_model_len=1024)
    assert msg is not None and "1100 tokens" in msg and "1024" in msg
    too_big = RequestCost(prompt_tokens=1000, max_new_tokens=1000)
    msg = never_fit_reason([b], too_big, max_model_len=None)
    assert msg is not None and "1600 tokens" in msg and "100 blocks" in msg
    many = RequestCost(prompt_tokens=100, max_new_tokens=100, num_sequences=16)
    assert never_fit_reason([b], many, max_model_len=1024) is not None
    # Nothing known yet: no verdict.
    assert never_fit_reason([BackendAdmission()], too_big, max_model_len=None) is None
