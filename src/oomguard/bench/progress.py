"""Live progress on the terminal (stderr): the stage, its concurrency, a KV bar, preemptions,
running and waiting; one line per finished stage."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from oomguard.bench.stage import Sample, StageResult

_BAR_CELLS = 30


def kv_bar(usage: float | None, high: float) -> Text:
    """A bar of KV usage with the high watermark marked."""
    if usage is None:
        return Text("KV  (not visible)", style="dim")
    filled = int(round(min(usage, 1.0) * _BAR_CELLS))
    mark = min(int(round(high * _BAR_CELLS)), _BAR_CELLS - 1)
    style = "green" if usage <= high else ("yellow" if usage < 0.98 else "red")
    bar = Text("KV [")
    for i in range(_BAR_CELLS):
        if i == mark:
            bar.append("|", style="bold")
        else:
            bar.append("█" if i < filled else "·", style=style if i < filled else "dim")
    bar.append(f"] {usage:5.1%}")
    return bar


class LiveProgress:
    """A listener for :func:`oomguard.bench.runner.run_bench` that draws on ``console``."""

    def __init__(self, console: Console, budget_s: float, high_watermark: float) -> None:
        self.console = console
        self.budget_s = budget_s
        self.high = high_watermark
        self.t0 = time.monotonic()
        self.stage: StageResult | None = None
        self.sample: Sample | None = None
        self.live = Live(self._render(), console=console, refresh_per_second=8, transient=True)

    def __enter__(self) -> LiveProgress:
        if self.console.is_terminal:  # elsewhere (CI logs, pipes): one line per stage only
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live.is_started:
            self.live.__exit__(None, None, None)

    def __call__(self, event: str, payload: Any) -> None:
        if event == "note":
            self.live.console.print(Text(f"note: {payload}", style="yellow"))
        elif event == "prepared":
            self.sample = None
        elif event.startswith("stage_"):
            stage, sample = payload
            self.stage = stage
            if sample is not None:
                self.sample = sample
            if event == "stage_end":
                self.live.console.print(self._finished_line(stage))
                self.stage, self.sample = None, None
        self.live.update(self._render())

    def _finished_line(self, st: StageResult) -> Text:
        verdict = {
            True: ("safe", "green"),
            False: ("unsafe", "red"),
            None: ("not tested (spread out)" if st.staggered else "cut short", "yellow"),
        }[st.safe]
        kv = st.kv_peak if st.kv_peak is not None else st.kv_peak_client
        line = Text(f"stage {st.spec.index:>2}  concurrency {st.concurrency:>4}  ")
        line.append(f"{len(st.ok_records)}/{len(st.records)} ok  ")
        line.append("KV peak " + ("-" if kv is None else f"{kv:.3f}") + "  ")
        pre = st.preemptions
        line.append(f"preemptions {'-' if pre is None else f'{pre:g}'}  ")
        line.append(f"{st.output_tokens_per_s():,.0f} tok/s  ")
        line.append(verdict[0], style=f"bold {verdict[1]}")
        if st.reasons:
            line.append(": " + "; ".join(st.reasons), style="dim")
        if st.stop_latency_s is not None:
            line.append(
                f" (stopped {st.stop_latency_s * 1000:,.0f} ms after the first sign)", style="dim"
            )
        return line

    def _render(self) -> Group:
        elapsed = time.monotonic() - self.t0
        head = Text(f"oomguard bench  {elapsed:6.1f} s of {self.budget_s:g} s", style="bold")
        if self.stage is None:
            return Group(head, Text("preparing…", style="dim"))
        st, s = self.stage, self.sample
        done = sum(1 for r in st.records if r.end_s is not None)
        line = Text(
            f"stage {st.spec.index} ({st.spec.purpose})  concurrency {st.concurrency}  "
            f"{done}/{len(st.spec.request_indices)} requests"
        )
        server = Text()
        if s is not None:
            server.append(
                f"preemptions {'-' if s.preemptions is None else f'{s.preemptions:g}'}  ",
                style="red" if s.preemptions else "",
            )
            server.append(f"running {'-' if s.running is None else f'{s.running:g}'}  ")
            server.append(f"waiting {'-' if s.waiting is None else f'{s.waiting:g}'}  ")
            server.append(f"in flight {s.in_flight}")
        usage = None if s is None else (s.kv_usage if s.kv_usage is not None else s.client_kv_usage)
        return Group(head, line, kv_bar(usage, self.high), server)
