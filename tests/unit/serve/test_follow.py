"""The log follower reads a log line by line exactly as the whole-file parser does, and
reports a failure on the line that states it (not when the next line arrives)."""

from __future__ import annotations

import pytest

from oomguard.logs import Phase, parse_file
from oomguard.logs.follow import LogFollower

from .conftest import DATA_DIR, follow

FAILURES = {
    "kv_too_small_for_max_len": ("kv_too_small", "ValueError: To serve at least one request"),
    "no_cache_blocks": ("no_cache_blocks", "No available memory for the cache blocks"),
    "cpu_util_below_process_rss": ("cpu_kv_allocation_failed", "on kv cache allocation is less"),
    "cpu_startup_free_memory_check": ("startup_check_failed", "on startup is less than desired"),
}


@pytest.mark.parametrize("name", sorted(p.stem for p in DATA_DIR.glob("*.log")))
def test_follower_reads_what_the_file_parser_reads(name: str) -> None:
    assert follow(name).parsed().to_dict() == parse_file(DATA_DIR / f"{name}.log").to_dict()


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_failure_reported_on_its_own_line(name: str) -> None:
    signature, words = FAILURES[name]
    follower = LogFollower()
    lines = (DATA_DIR / f"{name}.log").read_text(errors="replace").splitlines()
    reported = [(n, follower.feed(line).failure) for n, line in enumerate(lines, start=1)]
    first = [(n, failure) for n, failure in reported if failure is not None]
    assert len(first) == 1, "a failure is reported once"
    number, failure = first[0]
    assert failure is not None and failure.signature == signature
    assert failure.evidence.line == number  # read on the line that states it
    assert words in lines[number - 1]


def test_healthy_start_reports_no_failure_and_its_numbers() -> None:
    follower = LogFollower()
    seen: dict[str, object] = {}
    phases: list[Phase] = []
    for line in (DATA_DIR / "guard_pool_2048_tokens.log").read_text().splitlines():
        news = follower.feed(line)
        assert news.failure is None
        seen.update({k: v.value for k, v in news.fields.items()})
        phases += [p for p, _ in news.phases]
    assert seen["kv_tokens"] == 2048 and seen["max_concurrency"] == 2.0
    assert Phase.WEIGHT_LOADING in phases and Phase.KV_ALLOCATION in phases
    assert phases.index(Phase.KV_ALLOCATION) < len(phases) - 1 - phases[::-1].index(Phase.SERVING)


def test_cpu_worker_memory_outside_the_kv_cache() -> None:
    started = follow("startup_auto_kv_util").parsed()
    assert started.get("cpu_non_kv_gib") == 0.62 and started.get("requested_gib") == 3.02
    failed = follow("cpu_util_below_process_rss").parsed()
    assert failed.get("cpu_kv_request_gib") == -0.37 and failed.get("requested_gib") == 0.25


def test_chunks_and_parsed_snapshots_while_feeding() -> None:
    text = (DATA_DIR / "no_cache_blocks.log").read_text()
    follower = LogFollower()
    half = len(text) // 2
    cut = text.rfind("\n", 0, half)
    follower.feed(text[:cut])
    early = follower.parsed()
    assert not early.shows_failure
    follower.feed(text[cut + 1 :])
    assert follower.parsed().has("no_cache_blocks")
    assert follower.lines == len(text.splitlines())
