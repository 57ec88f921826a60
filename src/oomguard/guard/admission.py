"""Pure admission logic: KV reservations, watermarks with hysteresis, effective capacity.

No I/O and no clock: callers pass ``now_s`` in. One :class:`BackendAdmission` per backend holds
what the gateway has reserved there and what the backend last reported; :func:`pick_backend`
chooses where a request goes.

The rule (AI21's pause/resume fix, with the 90 %/80 % watermarks of the troubleshooting guide):
admit while ``used + cost <= high × effective capacity``; once a request is refused because the
high watermark is reached, stop admitting (the *pause latch*) until ``used`` falls below
``low × effective capacity``. ``used`` is the larger of what is reserved and what the backend
reports in use (``vllm:kv_cache_usage_perc``), so traffic that bypasses the gateway counts too.
A preemption seen in ``vllm:num_preemptions_total``, or reported usage above the high watermark,
tightens the effective capacity; sustained calm relaxes it again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdmissionSettings:
    """Watermarks and feedback tuning; fractions are of the backend's usable KV blocks."""

    high_watermark: float = 0.90
    low_watermark: float = 0.80
    tighten_factor: float = 0.90
    min_capacity_fraction: float = 0.50
    relax_step: float = 0.02
    calm_period_s: float = 5.0
    tighten_cooldown_s: float = 1.0


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Number of KV blocks that ``tokens`` tokens occupy (rounded up to whole blocks)."""
    if tokens <= 0:
        return 0
    return -(-tokens // block_size)


@dataclass(frozen=True)
class RequestCost:
    """What one request may occupy in the KV cache at worst.

    ``sequence_tokens`` = prompt tokens + tokens it may generate; ``num_sequences`` is ``n``
    (or the number of prompts in a batch). ``prompt_exact`` is False when the prompt length is
    an estimate (no tokenizer reachable).
    """

    prompt_tokens: int
    max_new_tokens: int
    num_sequences: int = 1
    prompt_exact: bool = True

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def total_tokens(self) -> int:
        return self.sequence_tokens * self.num_sequences

    def blocks(self, block_size: int) -> int:
        """KV blocks this request needs on a backend with ``block_size`` tokens per block."""
        return blocks_for_tokens(self.sequence_tokens, block_size) * self.num_sequences


@dataclass
class BackendAdmission:
    """Admission state of one backend: capacity, reservations, latch, feedback.

    ``capacity_blocks`` is the usable pool (``num_gpu_blocks − 1``: vLLM keeps one null
    block); ``None`` until the backend's ``vllm:cache_config_info`` (or the config) told us.
    """

    settings: AdmissionSettings = field(default_factory=AdmissionSettings)
    capacity_blocks: int | None = None
    block_size: int | None = None
    effective_fraction: float = 1.0
    reserved_blocks: int = 0
    reserved_tokens: int = 0
    paused: bool = False
    observed_usage: float = 0.0
    pause_count: int = 0
    tighten_count: int = 0
    preemptions_seen: int = 0
    _last_preemptions: float | None = None
    _calm_since_s: float | None = None
    _last_tighten_s: float | None = None

    # -- capacity -------------------------------------------------------------------------
    def set_capacity(self, num_gpu_blocks: int, block_size: int) -> None:
        """Record the pool size as vLLM reports it (``num_gpu_blocks`` includes the null block)."""
        self.capacity_blocks = max(num_gpu_blocks - 1, 0)
        self.block_size = block_size

    @property
    def known(self) -> bool:
        return self.capacity_blocks is not None and self.block_size is not None

    @property
    def effective_capacity_blocks(self) -> int:
        if self.capacity_blocks is None:
            return 0
        return int(self.capacity_blocks * self.effective_fraction)

    @property
    def used_blocks(self) -> int:
        """Blocks in use as far as we know: reservations or the backend's report, the larger."""
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

    # -- admission ------------------------------------------------------------------------
    def fits_ever(self, cost: RequestCost) -> bool:
        """Whether the request could run here with the pool otherwise empty."""
        if not self.known:
            return False
        assert self.capacity_blocks is not None and self.block_size is not None
        return cost.blocks(self.block_size) <= self.capacity_blocks

    def _refresh_latch(self) -> None:
        if self.paused and self.used_blocks < self.settings.low_watermark * (
            self.effective_capacity_blocks
        ):
            self.paused = False

    def can_admit(self, cost: RequestCost) -> bool:
        """Whether ``cost`` may be reserved now; refusing at the high watermark sets the latch.

        A backend with nothing reserved takes any request that fits its whole pool, so a
        large request is never starved by its own size.
        """
        if not self.known:
            return False
        assert self.block_size is not None and self.capacity_blocks is not None
        need = cost.blocks(self.block_size)
        if need > self.capacity_blocks:
            return False
        self._refresh_latch()
        if self.paused:
            return False
        if self.reserved_blocks == 0 and self.observed_usage < self.settings.low_watermark:
            return True
        eff = self.effective_capacity_blocks
        used = self.used_blocks
        if used + need <= self.settings.high_watermark * eff:
            return True
        # The high watermark is reached. Latch only when we are in the high band; a large
        # request that does not fit while usage is low simply waits for room.
        if used >= self.settings.low_watermark * eff:
            self.paused = True
            self.pause_count += 1
        return False

    def reserve(self, cost: RequestCost) -> int:
        """Reserve the request's blocks; returns the number reserved (needed to release)."""
        assert self.block_size is not None
        blocks = cost.blocks(self.block_size)
        self.reserved_blocks += blocks
        self.reserved_tokens += cost.total_tokens
        return blocks

    def release(self, blocks: int, tokens: int) -> None:
        """Give back a reservation made by :meth:`reserve`."""
        self.reserved_blocks = max(self.reserved_blocks - blocks, 0)
        self.reserved_tokens = max(self.reserved_tokens - tokens, 0)
        self._refresh_latch()

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
        new_preemptions = 0.0
        if preemptions_total is not None:
            if self._last_preemptions is not None and preemptions_total >= self._last_preemptions:
                new_preemptions = preemptions_total - self._last_preemptions
            self._last_preemptions = preemptions_total
        over = kv_usage is not None and kv_usage > s.high_watermark
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
        self._refresh_latch()

    def forget_observations(self) -> None:
        """Drop what the backend reported (it went away); reservations stay until released."""
        self.observed_usage = 0.0
        self._last_preemptions = None
        self._calm_since_s = None


def pick_backend(candidates: Sequence[BackendAdmission], cost: RequestCost) -> int | None:
    """Index of the candidate with the most free KV that admits ``cost`` now, else None.

    Every candidate is asked (so each one's latch reflects this request); ties go to the
    earlier candidate.
    """
    best: int | None = None
    best_free = 0
    for i, cand in enumerate(candidates):
        if not cand.can_admit(cost):
            continue
        free = cand.free_blocks
        if best is None or free > best_free:
            best, best_free = i, free
    return best


def never_fit_reason(
    candidates: Sequence[BackendAdmission], cost: RequestCost, max_model_len: int | None
) -> str | None:
    """Why the request can never run on any known backend, or None if it may.

    Returns None while no backend's capacity is known (nothing can be said yet).
    """
    if max_model_len is not None and cost.sequence_tokens > max_model_len:
        return (
            f"This request needs {cost.sequence_tokens} tokens of context "
            f"({cost.prompt_tokens} prompt + {cost.max_new_tokens} max_tokens) but the "
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
        f"This request needs {cost.total_tokens} tokens of KV cache "
        f"({cost.num_sequences} × ({cost.prompt_tokens} prompt + {cost.max_new_tokens} "
        f"max_tokens), {cost.blocks(largest.block_size)} blocks of {largest.block_size}) but "
        f"the largest backend holds {capacity_tokens} tokens ({largest.capacity_blocks} blocks); "
        "lower max_tokens or n, or shorten the prompt."
    )
