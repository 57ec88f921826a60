"""Bounded admission queue (FIFO within priority classes) and the drain-rate meter.

Pure data structures: no event loop, no clock of their own (callers pass ``now_s``).
Priorities follow vLLM's convention: a lower number is served earlier; 0 is the default.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

T = TypeVar("T")


@dataclass(eq=False)
class Waiter:
    """One queued request: its priority class, its cost in tokens, and caller data.

    ``key`` names the line it waits in (the model it asks for): each key is served FIFO within
    priority classes on its own, so a head that cannot be placed blocks only its own line.
    """

    priority: int
    cost_tokens: int
    enqueued_at_s: float
    data: Any = None
    removed: bool = False
    key: Any = None
    # Times a later request of its line was admitted while it waited at the head.
    bypassed: int = 0


@dataclass
class _Line:
    classes: dict[int, deque[Waiter]] = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    depth: int = 0

    def cls(self, priority: int) -> deque[Waiter]:
        q = self.classes.get(priority)
        if q is None:
            q = self.classes[priority] = deque()
            self.order = sorted(self.classes)
        return q

    def waiting(self) -> Iterator[Waiter]:
        """The line's waiters in the order they are served."""
        for prio in self.order:
            for w in self.classes[prio]:
                if not w.removed:
                    yield w

    def head(self) -> Waiter | None:
        for prio in self.order:
            q = self.classes[prio]
            while q and q[0].removed:
                q.popleft()
            if q:
                return q[0]
        return None


@dataclass
class AdmissionQueue:
    """Lines of waiting requests (one per key), FIFO per priority class, bounded overall.

    The bounds (request count, total cost tokens) hold for all lines together. ``push``
    refuses (returns False) when either bound would be exceeded; ``push_front`` (used for
    retries of already-accepted requests) ignores the bounds so an accepted request is never
    shed. Removal is O(1) (the entry is marked and skipped later).
    """

    max_requests: int
    max_tokens: int
    depth: int = 0
    tokens: int = 0
    _lines: dict[Any, _Line] = field(default_factory=dict)

    def _line(self, key: Any) -> _Line:
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = _Line()
        return line

    def would_accept(self, cost_tokens: int) -> bool:
        """Whether a request of ``cost_tokens`` fits under both bounds now."""
        return self.depth < self.max_requests and self.tokens + cost_tokens <= self.max_tokens

    def push(self, waiter: Waiter) -> bool:
        """Append at the back of its class; False (and nothing queued) when the queue is full."""
        if not self.would_accept(waiter.cost_tokens):
            return False
        line = self._line(waiter.key)
        line.cls(waiter.priority).append(waiter)
        self._account_added(line, waiter)
        return True

    def push_front(self, waiter: Waiter) -> None:
        """Put an already-accepted request at the head of its class, bounds notwithstanding."""
        line = self._line(waiter.key)
        line.cls(waiter.priority).appendleft(waiter)
        self._account_added(line, waiter)

    def _account_added(self, line: _Line, waiter: Waiter) -> None:
        line.depth += 1
        self.depth += 1
        self.tokens += waiter.cost_tokens

    def heads(self) -> list[Waiter]:
        """The head of every non-empty line, best first (priority, then time queued)."""
        out = []
        for line in self._lines.values():
            if line.depth:
                h = line.head()
                if h is not None:
                    out.append(h)
        out.sort(key=lambda w: (w.priority, w.enqueued_at_s))
        return out

    def peek(self) -> Waiter | None:
        """The next request to serve over all lines, or None."""
        heads = self.heads()
        return heads[0] if heads else None

    def pop(self) -> Waiter | None:
        """Remove and return the next request to serve."""
        w = self.peek()
        if w is not None:
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
        line = self._lines.get(waiter.key)
        if line is not None:
            line.depth -= 1
            if line.depth == 0:
                del self._lines[waiter.key]

    def lines(self) -> list[list[Waiter]]:
        """Each non-empty line's waiters in serving order, the lines ordered by their heads."""
        out = [list(line.waiting()) for line in self._lines.values() if line.depth]
        out = [w for w in out if w]
        out.sort(key=lambda ws: (ws[0].priority, ws[0].enqueued_at_s))
        return out

    def depth_of(self, key: Any) -> int:
        """Requests waiting in the line of ``key``."""
        line = self._lines.get(key)
        return line.depth if line is not None else 0

    def depth_ahead(self, priority: int, key: Any = None) -> int:
        """Queued requests of ``key``'s line served before a new one of ``priority``."""
        line = self._lines.get(key)
        if line is None:
            return 0
        n = 0
        for prio in line.order:
            if prio > priority:
                break
            n += sum(1 for w in line.classes[prio] if not w.removed)
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


async def admit_waiting(
    queue: AdmissionQueue,
    place: Callable[[Waiter], Awaitable[bool]],
    max_head_bypass: int,
    scan_limit: int = 32,
) -> int:
    """Admit queued requests in order; returns how many left the queue.

    ``place(waiter)`` admits the waiter (True) or says it does not fit now (False); it removes
    nothing from the queue itself. In each line the head goes first; a head that does not fit
    lets later requests of its line that do fit pass it, at most ``max_head_bypass`` times (then
    the line waits for its head, so nothing starves), looking at most ``scan_limit`` deep.
    """
    admitted = 0
    progressed = True
    while progressed and queue.depth:
        progressed = False
        for line in queue.lines():
            head = line[0]
            if head.removed:
                continue
            if await place(head):
                queue.remove(head)
                admitted += 1
                progressed = True
                continue
            for later in line[1 : scan_limit + 1]:
                if head.bypassed >= max_head_bypass:
                    break
                if later.priority != head.priority:
                    break  # a lower class never passes a higher one
                if later.removed:
                    continue
                if await place(later):
                    queue.remove(later)
                    head.bypassed += 1
                    admitted += 1
                    progressed = True
    return admitted


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (the in-process admission) to its end, here."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return cast(T, stop.value)
    coro.close()
    raise RuntimeError("run_now: the coroutine suspended")
