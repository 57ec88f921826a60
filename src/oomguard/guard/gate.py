"""The admission gate: queue + backend pool + reservations, on the event loop.

``acquire`` returns a :class:`Ticket` (a reservation on one backend) at once when its model's
line of the queue is empty and a backend admits the request; otherwise the request waits in the
bounded queue until ``pump`` places it, it times out, or its client goes away. ``pump`` runs
whenever a request ends, a poll changes the picture, or (throttled) progress of a tracked
request moves the projected peak. Each model has its own line, so a head that does not fit
holds back only requests for the same model, and those that fit may pass it a bounded number
of times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from oomguard.guard.admission import RequestCost, never_fit_reason, pick_backend
from oomguard.guard.backends import Backend, BackendPool
from oomguard.guard.output_lengths import OutputLengths
from oomguard.guard.projection import RequestProgress
from oomguard.guard.queue import AdmissionQueue, DrainRateMeter, Waiter, admit_waiting, run_now
from oomguard.guard.shared import SharedAdmission, wants_for

log = logging.getLogger("oomguard.guard")

# Progress of tracked requests re-runs admission at most once per engine step (a sequence
# gains one token per step, so the projection cannot change faster), and never more often
# than this (seconds).
PROGRESS_PUMP_INTERVAL_S = 0.005
# While requests wait, admission is re-run once per engine step too (the projected peak falls
# and admissions are spaced out, staggered, without any event to announce it), at least this
# often and at most this rarely (seconds): every retry of a queue costs the guard's CPU, which
# an engine on the same host (vLLM on CPU) needs.
WAITING_PUMP_INTERVAL_S = 0.01
MAX_PUMP_INTERVAL_S = 0.05


@dataclass(eq=False)
class Ticket:
    """An admitted request on ``backend``; ``progress`` is where its progress is reported."""

    backend: Backend
    progress: RequestProgress
    released: bool = False
    # The class its output length is learned in (None: not learned).
    length_class: tuple[object, ...] | None = None

    @property
    def tracked(self) -> bool:
        """Whether the request's progress is to be read and reported."""
        return self.progress.tracked

    @property
    def blocks(self) -> int:
        """KV blocks of its full reservation."""
        return self.progress.reserved_blocks


class QueueFull(Exception):
    """The queue holds its maximum of requests or tokens."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__("queue full")
        self.retry_after_s = retry_after_s


class QueueTimeout(Exception):
    """The request waited its whole queue timeout without being admitted."""

    def __init__(self, waited_s: float, retry_after_s: int) -> None:
        super().__init__("queue timeout")
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s


class NeverFits(Exception):
    """No backend could ever hold the request (found once capacities became known)."""


@dataclass(eq=False)
class _Pending:
    cost: RequestCost
    model: str | None
    future: asyncio.Future[Ticket]


class Gate:
    """Admission for the whole gateway. Single event loop; no locks needed."""

    def __init__(
        self,
        pool: BackendPool,
        queue: AdmissionQueue,
        drain: DrainRateMeter,
        *,
        retry_fallback_s: float,
        max_retry_after_s: int,
        on_queue_wait: Callable[[float], None] = lambda _s: None,
        max_head_bypass: int = 8,
        shared: SharedAdmission | None = None,
        lengths: OutputLengths | None = None,
        log_admissions: bool = False,
    ) -> None:
        self.pool = pool
        self.log_admissions = log_admissions
        self.queue = queue
        self.drain = drain
        self.retry_fallback_s = retry_fallback_s
        self.max_retry_after_s = max_retry_after_s
        self.on_queue_wait = on_queue_wait
        self.max_head_bypass = max_head_bypass
        self.shared = shared
        self.lengths = lengths
        self._tightens_seen: dict[str, int] = {}
        self._pumping = False
        self._first_refused: _Pending | None = None
        self._last_progress_pump_s = 0.0
        self._tick: asyncio.TimerHandle | None = None
        self._soon: asyncio.Handle | None = None

    def retry_after_s(self, requests_ahead: int | None = None) -> int:
        """Retry-After for a request behind ``requests_ahead`` others (default: the queue)."""
        ahead = self.queue.depth if requests_ahead is None else requests_ahead
        return self.drain.retry_after_s(
            ahead, time.monotonic(), self.retry_fallback_s, self.max_retry_after_s
        )

    def never_fit_reason(
        self, cost: RequestCost, model: str | None, prompt_is_lower_bound: bool = False
    ) -> str | None:
        """Why ``cost`` can never run on the backends serving ``model``, or None."""
        serving = [b.admission for b in self.pool.backends if b.serves(model)]
        return never_fit_reason(
            serving, cost, self.pool.max_model_len(model), prompt_is_lower_bound
        )

    def _place(self, cost: RequestCost, model: str | None) -> Ticket | None:
        """Reserve ``cost`` on the backend that admits it now, or None.

        With replicas on Redis each backend admits against the blocks this replica keeps in
        the shared ledger (no Redis call here: capacity moves between replicas in the
        background, see :mod:`oomguard.guard.shared`).
        """
        cands = self.pool.candidates(model)
        if not cands:
            return None
        now = time.monotonic()
        shared = self.shared
        if shared is not None:
            for b in cands:
                b.admission.static_share_blocks = shared.admission_share(b.url)
        cost = self._planned(cost)
        i = pick_backend([b.admission for b in cands], cost, now)
        if i is None:
            return None
        backend = cands[i]
        progress = backend.admission.reserve(cost, now)
        if self.log_admissions:
            _log_admission(backend, progress, cost, now)
        backend.in_flight += 1
        self.drain.record(now)
        if shared is not None:
            shared.note_admitted(backend.url)
        return Ticket(backend, progress, length_class=cost.length_class)

    def _planned(self, cost: RequestCost) -> RequestCost:
        """``cost`` with the output length learned for its class (what a tracked request is
        planned for; its max_tokens until the class is known)."""
        lengths = self.lengths
        if lengths is None or cost.length_class is None:
            return cost
        return replace(cost, length_plan=lengths.plan(cost.length_class, cost.max_new_tokens))

    def _learn(self, ticket: Ticket) -> None:
        """Record the output lengths of a tracked request's finished sequences."""
        lengths = self.lengths
        p = ticket.progress
        if lengths is None or ticket.length_class is None or not p.tracked:
            return
        for generated, finished in zip(p.generated, p.finished, strict=True):
            if finished:
                lengths.observe(ticket.length_class, generated, p.max_new_tokens)

    def _follow_feedback(self, now_s: float) -> None:
        """A backend that tightened (a preemption, usage above what admission allows) tightens
        the learned output lengths at once; calm relaxes them."""
        lengths = self.lengths
        if lengths is None:
            return
        tightened = False
        for b in self.pool.backends:
            count = b.admission.tighten_count
            if count > self._tightens_seen.get(b.url, count):
                tightened = True
            self._tightens_seen[b.url] = count
        if tightened:
            lengths.tighten(now_s)
        else:
            lengths.relax(now_s)

    def _publish_wants(self) -> None:
        """Tell the shared ledger what the first request that did not fit lacks (or nothing)."""
        shared = self.shared
        if shared is None:
            return
        refused = self._first_refused
        if refused is None or not self.queue.depth:
            shared.set_wants({})
            return
        cands = [(b.url, b.admission) for b in self.pool.candidates(refused.model)]
        shared.set_wants(wants_for(shared, cands, refused.cost, time.monotonic()))

    async def acquire(
        self,
        cost: RequestCost,
        model: str | None,
        priority: int,
        timeout_s: float,
        *,
        front: bool = False,
    ) -> Ticket:
        """Reserve KV for a request, waiting in the queue if needed.

        Raises QueueFull (not queued), QueueTimeout (removed from the queue) or NeverFits.
        ``front`` puts an already-accepted request (a retry) at the head of its class,
        exempt from the queue bounds. Cancellation removes the request or frees its ticket.
        """
        if self.queue.depth_of(model) == 0:
            ticket = self._place(cost, model)
            if ticket is not None:
                return ticket
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Ticket] = loop.create_future()
        start = time.monotonic()
        waiter = Waiter(priority, cost.total_tokens, start, _Pending(cost, model, fut), key=model)
        if front:
            self.queue.push_front(waiter)
        elif not self.queue.push(waiter):
            raise QueueFull(self.retry_after_s())
        self._pump_soon()
        try:
            await self._wait(fut, model, start, timeout_s)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                return fut.result()
            self.queue.remove(waiter)
            fut.cancel()
            waited = time.monotonic() - start
            raise QueueTimeout(waited, self.retry_after_s()) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())
            else:
                self.queue.remove(waiter)
                fut.cancel()
            self.pump()
            raise
        return fut.result()

    async def _wait(
        self, fut: asyncio.Future[Ticket], model: str | None, start_s: float, timeout_s: float
    ) -> None:
        """Wait for ``fut`` up to ``timeout_s``; time during which no backend serving ``model``
        is healthy does not count (an accepted request outlives a restart), up to the restart
        wait in all."""
        deadline = start_s + timeout_s
        hard = start_s + max(timeout_s, self.pool.restart_wait_s())
        last = start_s
        while not fut.done():
            now = time.monotonic()
            if not self.pool.candidates(model):
                deadline += now - last
            last = now
            left = min(deadline, hard) - now
            if left <= 0:
                raise asyncio.TimeoutError
            try:
                await asyncio.wait_for(asyncio.shield(fut), min(left, 1.0))
            except asyncio.TimeoutError:
                continue

    def release(self, ticket: Ticket) -> None:
        """The request ended: give its reservation back (idempotent) and admit who now fits."""
        if ticket.released:
            return
        ticket.released = True
        self._learn(ticket)
        b = ticket.backend
        b.admission.release(ticket.progress, time.monotonic())
        b.in_flight -= 1
        if self.shared is not None:
            self.shared.note_released(b.url)
        self.pump()

    def note_progress(
        self,
        ticket: Ticket,
        index: int,
        generated: int | None,
        finished: bool,
        prompt_tokens: int | None = None,
    ) -> None:
        """Report a tracked request's progress (choice ``index`` at ``generated`` tokens).

        Progress moves the projected peak down, so queued requests are retried — at most
        every ``PROGRESS_PUMP_INTERVAL_S``, and at once when a sequence finished.
        """
        if ticket.released:
            return
        now = time.monotonic()
        ticket.backend.admission.note_progress(
            ticket.progress, index, generated, finished, now, prompt_tokens
        )
        if self.queue.depth and (
            finished or now - self._last_progress_pump_s >= self._step_s(PROGRESS_PUMP_INTERVAL_S)
        ):
            self._last_progress_pump_s = now
            self.pump()

    def pump(self) -> None:
        """Admit queued requests: each line's head first, best line first; a request that fits
        may pass a head that does not, ``max_head_bypass`` times per head (see
        :func:`admit_waiting`). With replicas, the first request that did not fit is what this
        replica asks the shared ledger for."""
        if self._pumping:
            return
        self._follow_feedback(time.monotonic())
        self._pumping = True
        self._first_refused = None
        try:
            run_now(admit_waiting(self.queue, self._place_waiter, self.max_head_bypass))
        finally:
            self._pumping = False
        self._publish_wants()
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        if self.queue.depth and self._tick is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._tick = loop.call_later(self._step_s(WAITING_PUMP_INTERVAL_S), self._on_tick)

    def _step_s(self, least_s: float) -> float:
        """One engine step as the fastest backend's recent decode rate puts it (the time in
        which no sequence gains more than a token), between ``least_s`` and
        ``MAX_PUMP_INTERVAL_S``; ``least_s`` while no rate is known."""
        rates = [b.admission.rate.tokens_per_s for b in self.pool.backends]
        fastest = max((r for r in rates if r), default=None)
        if not fastest:
            return least_s
        return min(max(1.0 / fastest, least_s), MAX_PUMP_INTERVAL_S)

    async def _place_waiter(self, waiter: Waiter) -> bool:
        """Admit one queued request if it fits now; True when it leaves the queue."""
        pending: _Pending = waiter.data
        if pending.future.done():
            return True  # its client went away or it timed out
        ticket = self._place(pending.cost, pending.model)
        if ticket is None:
            reason = self.never_fit_reason(pending.cost, pending.model)
            if reason is None:
                if self._first_refused is None:
                    self._first_refused = pending
                return False
            pending.future.set_exception(NeverFits(reason))
            return True
        self.on_queue_wait(time.monotonic() - waiter.enqueued_at_s)
        pending.future.set_result(ticket)
        return True

    def _pump_soon(self) -> None:
        """Pump once the requests that arrived together are all queued (a burst of n arrivals
        retries the queue once, not n times)."""
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._on_soon)

    def _on_soon(self) -> None:
        self._soon = None
        self.pump()

    def _on_tick(self) -> None:
        self._tick = None
        self.pump()


def _log_admission(
    backend: Backend, progress: RequestProgress, cost: RequestCost, now_s: float
) -> None:
    """One line per admission: the rule that admitted it and the pool as admission saw it."""
    a = backend.admission
    log.info(
        "admitted %d prompt + %d planned of %d max_tokens × %d on %s by %s: "
        "%d blocks reserved, projected peak %d of %s, in flight %d, KV usage %.0f %%",
        cost.prompt_tokens,
        progress.reserved_new_tokens,
        cost.max_new_tokens,
        cost.num_sequences,
        backend.url,
        a.admitted_by,
        a.used_blocks,
        a.projected_blocks(now_s),
        a.capacity_blocks,
        len(a.inflight),
        100 * a.observed_usage,
    )
