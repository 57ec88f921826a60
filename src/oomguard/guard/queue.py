"""Bounded admission queue (FIFO within priority classes) and the drain-rate meter.

Pure data structures: no event loop, no clock of their own (callers pass ``now_s``).
Priorities follow vLLM's convention: a lower number is served earlier; 0 is the default.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Waiter:
    """One queued request: its priority class, its cost in tokens, and caller data."""

    priority: int
    cost_tokens: int
    enqueued_at_s: float
    data: Any = None
    removed: bool = False


@dataclass
class AdmissionQueue:
    """FIFO per priority class, bounded by request count and by total cost tokens.

    ``push`` refuses (returns False) when either bound would be exceeded; ``push_front``
    (used for retries of already-accepted requests) ignores the bounds so an accepted request
    is never shed. Removal is O(1) (the entry is marked and skipped later).
    """

    max_requests: int
    max_tokens: int
    depth: int = 0
    tokens: int = 0
    _classes: dict[int, deque[Waiter]] = field(default_factory=dict)
    _order: list[int] = field(default_factory=list)

    def _class(self, priority: int) -> deque[Waiter]:
        q = self._classes.get(priority)
        if q is None:
            q = self._classes[priority] = deque()
            self._order = sorted(self._classes)
        return q

    def would_accept(self, cost_tokens: int) -> bool:
        """Whether a request of ``cost_tokens`` fits under both bounds now."""
        return self.depth < self.max_requests and self.tokens + cost_tokens <= self.max_tokens

    def push(self, waiter: Waiter) -> bool:
        """Append at the back of its class; False (and nothing queued) when the queue is full."""
        if not self.would_accept(waiter.cost_tokens):
            return False
        self._class(waiter.priority).append(waiter)
        self.depth += 1
        self.tokens += waiter.cost_tokens
        return True

    def push_front(self, waiter: Waiter) -> None:
        """Put an already-accepted request at the head of its class, bounds notwithstanding."""
        self._class(waiter.priority).appendleft(waiter)
        self.depth += 1
        self.tokens += waiter.cost_tokens

    def peek(self) -> Waiter | None:
        """The next request to serve (lowest priority number, oldest first), or None."""
        for prio in self._order:
            q = self._classes[prio]
            while q and q[0].removed:
                q.popleft()
            if q:
                return q[0]
        return None

    def pop(self) -> Waiter | None:
        """Remove and return the next request to serve."""
        w = self.peek()
        if w is not None:
            self._classes[w.priority].popleft()
            self._account_removed(w)
        return w

    def remove(self, waiter: Waiter) -> bool:
        """Take a waiter out (timeout, disconnect); False if it was no longer queued."""
        if waiter.removed:
            return False
        self._account_removed(waiter)
        return True

    def _account_removed(self, waiter: Waiter) -> None:
        waiter.removed = True
        self.depth -= 1
        self.tokens -= waiter.cost_tokens

    def depth_ahead(self, priority: int) -> int:
        """Queued requests served before a new one of ``priority`` (same or better class)."""
        n = 0
        for prio in self._order:
            if prio > priority:
                break
            n += sum(1 for w in self._classes[prio] if not w.removed)
        return n

    def __len__(self) -> int:
        return self.depth


@dataclass
class DrainRateMeter:
    """Requests leaving the queue per second over a sliding window of recent events."""

    window_s: float = 10.0
    _events: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def record(self, now_s: float) -> None:
        """Count one request that left the queue (admitted to a backend) at ``now_s``."""
        self._events.append(now_s)

    def rate_per_s(self, now_s: float) -> float:
        """Observed drain rate; 0.0 when nothing drained within the window."""
        ev = self._events
        while ev and now_s - ev[0] > self.window_s:
            ev.popleft()
        if not ev:
            return 0.0
        span = max(now_s - ev[0], 1.0)
        return len(ev) / span

    def retry_after_s(
        self, requests_ahead: int, now_s: float, fallback_s: float, max_s: float
    ) -> int:
        """Seconds until ``requests_ahead`` + 1 would have drained at the observed rate.

        Whole seconds, at least 1 and at most ``max_s``; ``fallback_s`` when no drain was
        observed (nothing is moving, so the wait cannot be predicted from the rate).
        """
        rate = self.rate_per_s(now_s)
        seconds = fallback_s if rate <= 0.0 else (requests_ahead + 1) / rate
        return int(min(max(math.ceil(seconds), 1), max_s))
