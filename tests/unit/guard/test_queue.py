"""Queue bounds, FIFO within priority classes, removal, drain rate and Retry-After."""

from __future__ import annotations

from oomguard.guard.queue import AdmissionQueue, DrainRateMeter, Waiter, admit_waiting, run_now


def w(priority: int = 0, tokens: int = 10, name: str = "") -> Waiter:
    return Waiter(priority=priority, cost_tokens=tokens, enqueued_at_s=0.0, data=name)


def test_fifo_within_class_and_lower_priority_number_first() -> None:
    q = AdmissionQueue(max_requests=10, max_tokens=1000)
    for name, prio in [("a", 0), ("b", 5), ("c", 0), ("d", -1), ("e", 5)]:
        assert q.push(w(prio, name=name))
    order = []
    while (x := q.pop()) is not None:
        order.append(x.data)
    assert order == ["d", "a", "c", "b", "e"]
    assert q.depth == 0 and q.tokens == 0


def test_bounds_on_requests_and_tokens() -> None:
    q = AdmissionQueue(max_requests=2, max_tokens=25)
    assert q.push(w(tokens=10))
    assert q.push(w(tokens=10))
    assert not q.push(w(tokens=1))  # request bound
    q2 = AdmissionQueue(max_requests=10, max_tokens=25)
    assert q2.push(w(tokens=20))
    assert not q2.push(w(tokens=6))  # token bound
    assert q2.push(w(tokens=5))
    assert q2.depth == 2 and q2.tokens == 25


def test_push_front_ignores_bounds_and_goes_first_in_its_class() -> None:
    q = AdmissionQueue(max_requests=1, max_tokens=10)
    assert q.push(w(name="first"))
    q.push_front(w(tokens=100, name="retry"))
    assert q.depth == 2
    assert q.pop().data == "retry"  # type: ignore[union-attr]


def test_remove_is_counted_once_and_skipped() -> None:
    q = AdmissionQueue(max_requests=10, max_tokens=1000)
    a, b, c = w(name="a"), w(name="b"), w(name="c")
    for x in (a, b, c):
        q.push(x)
    assert q.remove(b)
    assert not q.remove(b)
    assert q.depth == 2 and q.tokens == 20
    assert q.depth_ahead(0) == 2
    assert [q.pop().data, q.pop().data] == ["a", "c"]  # type: ignore[union-attr]
    assert q.pop() is None


def test_depth_ahead_counts_same_and_better_classes() -> None:
    q = AdmissionQueue(max_requests=10, max_tokens=1000)
    for prio in (0, 0, 1, -1, 2):
        q.push(w(prio))
    assert q.depth_ahead(-1) == 1
    assert q.depth_ahead(0) == 3
    assert q.depth_ahead(1) == 4


def test_drain_rate_over_window() -> None:
    m = DrainRateMeter(window_s=10.0)
    assert m.rate_per_s(0.0) == 0.0
    for i in range(20):
        m.record(i * 0.5)  # 2 per second for 10 s
    assert abs(m.rate_per_s(9.5) - 20 / 9.5) < 1e-9
    # Old events fall out of the window.
    assert m.rate_per_s(100.0) == 0.0


def test_retry_after_from_drain_rate() -> None:
    m = DrainRateMeter(window_s=10.0)
    for i in range(50):
        m.record(i * 0.2)  # 5 per second
    rate = m.rate_per_s(9.8)
    assert 5.0 <= rate <= 5.2
    # 49 ahead + this one at ~5/s → 10 s.
    assert m.retry_after_s(49, 9.8, fallback_s=30, max_s=300) == 10
    assert m.retry_after_s(0, 9.8, fallback_s=30, max_s=300) == 1
    assert m.retry_after_s(10_000, 9.8, fallback_s=30, max_s=300) == 300
    # Nothing drained: the fallback.
    assert DrainRateMeter().retry_after_s(5, 0.0, fallback_s=30, max_s=300) == 30


def _line(*sizes: int) -> tuple[AdmissionQueue, list[Waiter]]:
    q = AdmissionQueue(100, 10**9)
    ws = [Waiter(0, s, float(i), data=s) for i, s in enumerate(sizes)]
    for w in ws:
        assert q.push(w)
    return q, ws


def test_a_request_that_fits_passes_a_blocked_head_a_bounded_number_of_times() -> None:
    q, ws = _line(100, 5, 5, 5, 5)
    free = [12]

    async def place(w: Waiter) -> bool:
        if w.data <= free[0]:
            free[0] -= w.data
            return True
        return False

    assert run_now(admit_waiting(q, place, max_head_bypass=2)) == 2
    assert ws[0].bypassed == 2 and q.depth == 3  # the head and two small ones still wait
    free[0] = 100
    # The head has been passed twice: the line now waits for it first.
    assert run_now(admit_waiting(q, place, max_head_bypass=2)) == 1
    assert q.depth == 2 and ws[0].removed
    free[0] = 10
    assert run_now(admit_waiting(q, place, max_head_bypass=2)) == 2 and q.depth == 0


def test_no_bypass_across_priority_classes() -> None:
    q = AdmissionQueue(100, 10**9)
    head = Waiter(0, 100, 0.0, data=100)
    low = Waiter(5, 1, 1.0, data=1)
    q.push(head)
    q.push(low)

    async def place(w: Waiter) -> bool:
        return bool(w.data <= 10)

    assert run_now(admit_waiting(q, place, max_head_bypass=8)) == 0
