"""The search for the highest safe concurrency: a pure state machine, no I/O.

Safety is assumed to fall with concurrency (more requests of the same shape never need less
KV). The search starts from a first guess (the pool the server states ÷ the blocks one request
holds), probes one above it, grows geometrically while stages stay safe, shrinks by halves
while they do not, then bisects the bracket down to neighbours: the highest safe concurrency
``lo`` with ``lo + 1`` unsafe.

The capacity arithmetic is usually right, so a run normally takes two stages (the guess, safe;
one more, unsafe); when it is wrong (prefix sharing, a server cap on running requests, a
gateway in front) the geometric phase finds the bracket in a logarithmic number of stages.

Without a KV signal (a server that does not expose vLLM's metrics), nothing preempts as far as
the client can see; growth then also stops where throughput stops rising (less than
``saturation_gain`` from one stage to the next), since more concurrency only adds queueing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class ConcurrencySearch:
    """Which concurrency to test next, given what the tested ones showed."""

    first_guess: int
    max_concurrency: int
    grow_factor: float = 2.0
    watch_saturation: bool = False
    saturation_gain: float = 0.05
    tested: dict[int, bool] = field(default_factory=dict)  # concurrency → safe
    throughput: dict[int, float] = field(default_factory=dict)  # concurrency → tokens/s
    stopped_by: str | None = None  # why the search ended early ("saturated", "inconclusive")

    def __post_init__(self) -> None:
        self.max_concurrency = max(1, self.max_concurrency)
        self.first_guess = min(max(1, self.first_guess), self.max_concurrency)

    # -- what was learned ----------------------------------------------------------------
    @property
    def lo(self) -> int:
        """The highest safe concurrency below every unsafe one (0: none safe yet)."""
        hi = self.hi
        safe = [c for c, ok in self.tested.items() if ok and (hi is None or c < hi)]
        return max(safe, default=0)

    @property
    def hi(self) -> int | None:
        """The lowest unsafe concurrency (None: none unsafe yet)."""
        return min((c for c, ok in self.tested.items() if not ok), default=None)

    @property
    def best(self) -> int | None:
        """The answer: the highest safe concurrency found (None when even 1 is unsafe)."""
        return self.lo or None

    @property
    def exact(self) -> bool:
        """Whether ``best + 1`` was tested and found unsafe (or best is the search's cap)."""
        hi = self.hi
        if hi is None:
            return self.lo == self.max_concurrency
        return hi - self.lo == 1

    # -- the next step -------------------------------------------------------------------
    def record(
        self, concurrency: int, safe: bool | None, tokens_per_s: float | None = None
    ) -> None:
        """What the stage at ``concurrency`` showed; None (inconclusive) ends the search."""
        if safe is None:
            self.stopped_by = "inconclusive"
            return
        self.tested[concurrency] = safe
        if tokens_per_s is not None:
            self.throughput[concurrency] = tokens_per_s

    def next(self) -> int | None:
        """The next concurrency to test, or None when the search is done."""
        if self.stopped_by is not None:
            return None
        if not self.tested:
            return self.first_guess
        lo, hi = self.lo, self.hi
        if hi is None:
            return self._grow(lo)
        if lo == 0:
            return self._shrink(hi)
        if hi - lo <= 1:
            return None
        return (lo + hi) // 2

    def _grow(self, lo: int) -> int | None:
        if lo >= self.max_concurrency:
            return None
        if self.watch_saturation and self._saturated(lo):
            self.stopped_by = "saturated"
            return None
        if lo == self.first_guess and lo + 1 not in self.tested:
            return lo + 1  # the capacity arithmetic says one more should not fit
        return min(self.max_concurrency, max(lo + 1, math.ceil(lo * self.grow_factor)))

    def _shrink(self, hi: int) -> int | None:
        if hi <= 1:
            return None
        if hi == self.first_guess and hi - 1 not in self.tested:
            return hi - 1
        return max(1, hi // 2)

    def _saturated(self, lo: int) -> bool:
        """Throughput at ``lo`` rose less than ``saturation_gain`` over the stage below it."""
        below = [c for c in self.throughput if c < lo]
        if not below or lo not in self.throughput:
            return False
        previous = self.throughput[max(below)]
        return previous > 0 and self.throughput[lo] < previous * (1 + self.saturation_gain)


def first_guess(
    usable_blocks: int | None,
    block_size: int | None,
    sequence_tokens: float,
    kv_limit: float,
) -> int | None:
    """Requests of ``sequence_tokens`` the pool holds at once under ``kv_limit``.

    ``usable_blocks`` is the pool less vLLM's null block; a request holds
    ``ceil(tokens / block_size)`` blocks at its end (prefix sharing aside). None when the
    server does not state its pool.
    """
    if not usable_blocks or not block_size or sequence_tokens <= 0:
        return None
    per_request = math.ceil(sequence_tokens / block_size)
    return max(1, int(kv_limit * usable_blocks + 1e-9) // per_request)
