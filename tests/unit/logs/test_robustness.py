"""The parser never raises on hostile input and stays within bounded memory on huge logs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomguard.doctor.diagnose import diagnose
from oomguard.logs import parse_stream
from oomguard.logs.lines import read_binary_lines

OOM_ROWS = [
    json.loads(line)
    for line in Path("/work/shared/data/oom-cases.jsonl").read_text().splitlines()
    if line.strip()
]
REAL_LINES = [line for row in OOM_ROWS for line in row["log"].splitlines()]


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=4096))
def test_binary_garbage_never_raises(blob: bytes) -> None:
    import io

    parsed = parse_stream(read_binary_lines(io.BytesIO(blob)))
    diagnose(parsed)  # the doctor on top never raises either
    parsed.to_dict()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.text(max_size=300), max_size=40))
def test_arbitrary_text_never_raises(lines: list[str]) -> None:
    parsed = parse_stream(lines)
    diagnose(parsed).to_dict()


def test_empty_input() -> None:
    parsed = parse_stream([])
    assert parsed.lines == 0
    assert not parsed.shows_failure
    assert not diagnose(parsed).oom_found


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(REAL_LINES), st.integers(min_value=0, max_value=400)), max_size=30
    )
)
def test_truncated_real_lines_never_raise(picks: list[tuple[str, int]]) -> None:
    lines = [line[:cut] for line, cut in picks]
    diagnose(parse_stream(lines)).to_dict()


@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_random_interleavings_keep_the_diagnosis(rnd) -> None:  # type: ignore[no-untyped-def]
    # two processes' lines interleaved in random order (each process keeps its own order):
    # the KV-too-small case still parses and is still diagnosed the same way
    first = OOM_ROWS[3]["log"].splitlines()
    second = [
        f"(Worker_TP1 pid=2) INFO 01-01 00:00:0{i % 10} [x.py:1] Loading weights took 1.{i} seconds"
        for i in range(12)
    ]
    merged: list[str] = []
    a, b = list(first), list(second)
    while a or b:
        source = a if (a and (not b or rnd.random() < 0.5)) else b
        merged.append(source.pop(0))
    parsed = parse_stream(merged)
    assert parsed.get("kv_capacity_tokens") == 7344
    top = diagnose(parsed).top
    assert top is not None and top.cause == "kv_too_small_for_max_len"


_FILLER = (
    "(APIServer pid=7) INFO 11-02 10:00:{s:02d} [loggers.py:123] Engine 000: Avg prompt "
    "throughput: 1234.5 tokens/s, Avg generation throughput: 456.7 tokens/s, Running: 37 reqs, "
    "Waiting: 0 reqs, GPU KV cache usage: 41.3%, Prefix cache hit rate: 12.0%",
    '(APIServer pid=7) INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3/site-packages/vllm/v1/engine/core.py", line 701, in run_busy_loop',
    "ValueError: something unrelated {s}",
)


def _lines(total_bytes: int) -> Iterator[str]:
    yield (
        "(Worker_TP0 pid=40) INFO 11-02 10:00:30 [gpu_model_runner.py:2] Model loading took "
        "7.64 GiB memory and 12.0 seconds"
    )
    produced = 0
    i = 0
    while produced < total_bytes:
        line = _FILLER[i % len(_FILLER)].format(s=i % 60)
        produced += len(line) + 1
        i += 1
        yield line
    yield (
        "(EngineCore_DP0 pid=9) ERROR 11-02 11:00:00 [core.py:710] torch.OutOfMemoryError: CUDA "
        "out of memory. Tried to allocate 960.00 MiB. GPU 0 has a total capacity of 79.14 GiB of "
        "which 712.75 MiB is free."
    )


def test_python_allocations_stay_bounded() -> None:
    tracemalloc.start()
    try:
        parsed = parse_stream(_lines(8 * 2**20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parsed.first_oom is not None and parsed.get("weights_gib") == 7.64
    assert len(parsed.errors) <= 16
    assert peak < 2 * 2**20, f"peak {peak / 2**20:.1f} MiB of Python allocations for an 8 MiB log"


_CHILD = textwrap.dedent(
    """
    import resource, sys
    sys.path.insert(0, {tests!r})
    from test_robustness import _lines
    from oomguard.logs import parse_stream
    parsed = parse_stream(_lines({size}))
    assert parsed.first_oom is not None
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, parsed.lines)
    """
)


def _child_rss_kib(size: int) -> tuple[int, int]:
    code = _CHILD.format(tests=str(Path(__file__).parent), size=size)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True
    )
    rss, lines = out.stdout.split()
    return int(rss), int(lines)


def test_200_mb_log_in_bounded_memory() -> None:
    """A 200 MB log (generated lazily, never held) parses with the same peak RSS as a 1 MB one."""
    small_rss, _ = _child_rss_kib(2**20)
    big_rss, big_lines = _child_rss_kib(200 * 2**20)
    assert big_lines > 1_000_000
    growth_mib = (big_rss - small_rss) / 1024
    assert growth_mib < 16, f"peak RSS grew by {growth_mib:.1f} MiB from a 1 MB to a 200 MB log"
