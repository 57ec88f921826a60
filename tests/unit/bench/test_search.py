"""The concurrency search: from the pool's guess to neighbours (safe, safe + 1 unsafe)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from oomguard.bench.search import ConcurrencySearch, first_guess


def run(search: ConcurrencySearch, limit: int) -> list[int]:
    """Drive the search against a server whose highest safe concurrency is ``limit``."""
    tested = []
    while (c := search.next()) is not None:
        assert c not in tested, f"tested {c} twice: {tested}"
        tested.append(c)
        search.record(c, c <= limit)
    return tested


def test_a_right_guess_takes_two_stages() -> None:
    search = ConcurrencySearch(first_guess=7, max_concurrency=256)
    assert run(search, limit=7) == [7, 8]
    assert search.best == 7 and search.exact


def test_a_low_guess_grows_geometrically_then_bisects() -> None:
    search = ConcurrencySearch(first_guess=1, max_concurrency=256)
    assert run(search, limit=11) == [1, 2, 4, 8, 16, 12, 10, 11]
    assert search.best == 11 and search.exact


def test_a_high_guess_halves_then_bisects() -> None:
    search = ConcurrencySearch(first_guess=40, max_concurrency=256)
    tested = run(search, limit=9)
    assert tested[:3] == [40, 39, 19]
    assert search.best == 9 and search.exact


def test_nothing_safe() -> None:
    search = ConcurrencySearch(first_guess=4, max_concurrency=64)
    assert run(search, limit=0) == [4, 3, 1]
    assert search.best is None


def test_the_cap_ends_growth() -> None:
    search = ConcurrencySearch(first_guess=3, max_concurrency=10)
    assert run(search, limit=1000) == [3, 4, 8, 10]
    assert search.best == 10 and search.exact


def test_an_inconclusive_stage_ends_the_search_with_what_was_proven() -> None:
    search = ConcurrencySearch(first_guess=5, max_concurrency=64)
    search.record(5, True)
    search.record(6, None)
    assert search.next() is None and search.stopped_by == "inconclusive"
    assert search.best == 5 and not search.exact


def test_without_a_kv_signal_growth_stops_where_throughput_stops_rising() -> None:
    search = ConcurrencySearch(first_guess=1, max_concurrency=256, watch_saturation=True)
    throughput = {1: 100.0, 2: 190.0, 4: 350.0, 8: 360.0}
    tested = []
    while (c := search.next()) is not None:
        tested.append(c)
        search.record(c, True, throughput[c])
    assert tested == [1, 2, 4, 8] and search.stopped_by == "saturated" and search.best == 8


@given(st.integers(1, 300), st.integers(0, 300), st.integers(1, 300))
def test_always_finds_the_limit(guess: int, limit: int, cap: int) -> None:
    search = ConcurrencySearch(first_guess=guess, max_concurrency=cap)
    tested = run(search, limit)
    expected = min(limit, cap)
    assert search.best == (expected or None)
    assert len(tested) <= 2 * 9 + 3  # logarithmic: growth or halving, then bisection


def test_first_guess_from_the_pool() -> None:
    # 15 usable blocks of 128; 256-token requests hold 2 blocks; 95 % of 15 = 14.25 → 7
    assert first_guess(15, 128, 256, 0.95) == 7
    # a 0.9 watermark leaves 13.5 blocks → 6 requests
    assert first_guess(15, 128, 256, 0.90) == 6
    assert first_guess(15, 128, 257, 0.95) == 4  # 3 blocks each
    assert first_guess(None, 128, 256, 0.95) is None
    assert first_guess(1, 128, 4096, 0.95) == 1  # never below one
