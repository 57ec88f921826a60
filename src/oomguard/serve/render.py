"""Human output of a serve run: the engine's log as it comes, a live phase line, and the
events (launch, compare, failure, heal, ready, probe, exit) as readable lines and tables.

A view over the events only: everything shown here is also in ``--json``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console
from rich.status import Status
from rich.table import Table
from rich.text import Text

from oomguard.serve.events import Event


def _value(value: Any, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "tokens":
        return f"{int(value):,}"
    if unit == "x":
        return f"{float(value):.2f}x"
    if 0 < abs(float(value)) < 0.1:
        return f"{float(value) * 1024:.1f} MiB"
    return f"{float(value):.2f} GiB"


def _diff(row: dict[str, Any]) -> str:
    if row.get("predicted") is None:
        return "no prediction"
    diff, unit = row.get("diff") or 0, row["unit"]
    if unit == "tokens":
        text = f"{int(diff):+,}"
    elif unit == "x":
        text = f"{float(diff):+.2f}x"
    else:
        text = f"{float(diff):+.3f} GiB"
    pct = row.get("diff_pct")
    if pct is not None and diff:
        text += f" ({pct:+.1f} %)"
    return text


def comparison_table(rows: list[dict[str, Any]], title: str) -> Table:
    """Predicted against observed, one row per term the log stated."""
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("term")
    table.add_column("predicted", justify="right")
    table.add_column("range", justify="right", style="dim")
    table.add_column("observed", justify="right")
    table.add_column("difference", justify="right")
    table.add_column("line", justify="right", style="dim")
    for row in rows:
        unit = row["unit"]
        low_high = row.get("range")
        span = (
            f"{_value(low_high[0], unit)} – {_value(low_high[1], unit)}"
            if low_high and low_high[0] != low_high[1]
            else ""
        )
        style = (
            "green" if row.get("in_range") else ("yellow" if row.get("in_range") is False else "")
        )
        table.add_row(
            row["label"],
            _value(row.get("predicted"), unit),
            span,
            _value(row["observed"], unit),
            Text(_diff(row), style=style),
            str(row["line"]),
        )
    return table


class HumanRenderer:
    """Prints events and engine lines for a person; keeps a live phase line while launching."""

    def __init__(self, console: Console, *, engine_log: bool = True, log_file: Path | None = None):
        self.console = console
        self.engine_log = engine_log
        self._file: TextIO | None = log_file.open("a") if log_file else None
        self._status: Status | None = None
        self._lock = threading.Lock()

    def close(self) -> None:
        """Stop the live line and close the log file."""
        self._stop_status()
        if self._file is not None:
            self._file.close()

    # --- engine lines (reader thread) -------------------------------------------------------
    def on_line(self, line: str) -> None:
        """One line of the engine's output."""
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
            if self.engine_log:
                self.console.print(Text(line, style="dim"), soft_wrap=True, highlight=False)

    # --- events -----------------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """Render one event."""
        handler = getattr(self, "_on_" + event.kind, None)
        if handler is not None:
            with self._lock:
                handler(event.data)

    def _status_text(self, text: str) -> None:
        if self._status is None:
            self._status = self.console.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _on_plan(self, d: dict[str, Any]) -> None:
        self.console.print(f"[bold]serve[/] {d['command']}")
        device = d.get("device")
        if device:
            free = device.get("free_gib")
            free_text = "" if free is None else f", {free:.2f} GiB free"
            self.console.print(
                f"  device: {device['name']}{free_text} · {d['engine']} {d['engine_version']}"
            )
        prediction = d.get("prediction")
        if prediction and prediction.get("engine") == "llama.cpp":
            self._llama_plan(prediction)
        elif prediction:
            terms = prediction["terms"]
            kv = terms.get("kv_cache_gib", {})
            tokens = terms.get("kv_cache_tokens", {})
            verdict = "[green]fits[/]" if prediction["fits"] else "[red]does not fit[/]"
            self.console.print(
                f"  predicted: KV cache {kv.get('value', 0):.2f} GiB, "
                f"{int(tokens.get('value', 0)):,} tokens, max concurrency "
                f"{terms.get('max_concurrency', {}).get('value', 0):.2f}x — {verdict}"
            )
            for problem in prediction["problems"][:2]:
                self.console.print(f"  [yellow]{problem}[/]")

    def _llama_plan(self, prediction: dict[str, Any]) -> None:
        """llama.cpp: the split, the context per slot, the memory per device."""
        split, ctx = prediction["split"], prediction["context"]
        verdict = "[green]fits[/]" if prediction["fits"] else "[red]does not fit[/]"
        per_device = ", ".join(
            f"{d} {_value(g, 'GiB')}" for d, g in prediction["per_device_gib"].items()
        )
        self.console.print(
            f"  predicted: {split['gpu_layers']} of {split['layers']} layers on the GPU, "
            f"{ctx['slots']} slots × {ctx['n_ctx_per_slot']:,} tokens; {per_device} — {verdict}"
        )
        for problem in prediction["problems"][:2]:
            self.console.print(f"  [yellow]{problem}[/]")

    def _on_launch(self, d: dict[str, Any]) -> None:
        self._stop_status()
        self.console.print(
            f"[bold cyan]launch {d['number']}[/] (attempt {d['attempt']}/"
            f"{d['max_attempts']}, pid {d['pid']}): {d['command']}"
        )
        self.console.print(f"  log: {d['log']}", style="dim")
        self._status_text(f"launch {d['number']}: starting")

    def _on_phase(self, d: dict[str, Any]) -> None:
        self._status_text(f"launch {d['launch']}: {d['label']}")

    def _on_compare(self, d: dict[str, Any]) -> None:
        predicted = _value(d.get("predicted"), d["unit"])
        self.console.print(
            f"  [bold]{d['label']}[/]: observed {_value(d['observed'], d['unit'])}, "
            f"predicted {predicted} → {_diff(d)}"
        )

    def _on_failure(self, d: dict[str, Any]) -> None:
        self._stop_status()
        kind = d.get("kind")
        where = f" (line {d['line']})" if d.get("line") else ""
        self.console.print(
            f"[bold red]failure[/] {kind}{where}: {d.get('text', '')}", soft_wrap=True
        )
        if d.get("line_to_kill_s") is not None:
            self.console.print(
                f"  killed {d['line_to_kill_s'] * 1000:.0f} ms after the line; "
                f"memory released: {d.get('memory_released')} "
                f"({d.get('release_source')})"
            )
        if d.get("comparison"):
            self.console.print(comparison_table(d["comparison"], "  predicted vs observed"))

    def _on_heal(self, d: dict[str, Any]) -> None:
        self.console.print(f"[bold yellow]heal[/] {d['cause']}: {d['summary']}")
        for rejected in d.get("rejected", []):
            self.console.print(f"  not {rejected['change']}: {rejected['reason']}", style="dim")
        if d.get("healed"):
            self.console.print(f"  → {d['change']} ({d['source']}: {d['why']})")
        else:
            self.console.print("  [red]no runnable fix passes the checks[/]")

    def _on_ready(self, d: dict[str, Any]) -> None:
        self._stop_status()
        self.console.print(
            f"[bold green]ready[/] {d['url']} after {d['startup_s']:.1f} s "
            f"(launch {d['launch']}): {d['command']}"
        )
        if d.get("comparison"):
            self.console.print(comparison_table(d["comparison"], "  predicted vs observed"))

    def _on_calibration(self, d: dict[str, Any]) -> None:
        terms = ", ".join(f"{k} {v:.3f} GiB" for k, v in d["terms"].items())
        self.console.print(f"  calibration stored under {d['key']}: {terms}", style="dim")

    def _on_probe(self, d: dict[str, Any]) -> None:
        mark = "[green]passed[/]" if d.get("passed") else f"[red]failed[/] {d.get('error', '')}"
        self.console.print(
            f"[bold]probe[/] {d.get('probe')}: {d.get('requests', 0)} × "
            f"{d.get('prompt_tokens', 0)} + {d.get('max_tokens', 0)} tokens, "
            f"{d.get('elapsed_s', 0):.1f} s: {mark}"
        )

    def _on_guard(self, d: dict[str, Any]) -> None:
        state = "[green]up[/]" if d["healthy"] else "[red]not healthy[/]"
        self.console.print(f"[bold]guard[/] {d['url']} → {d['backend']}: {state}")

    def _on_restart(self, d: dict[str, Any]) -> None:
        healed = " (healed)" if d.get("healed") else ""
        self.console.print(f"[bold yellow]restart[/] in {d['after_s']:g} s{healed}: {d['command']}")

    def _on_alternatives(self, d: dict[str, Any]) -> None:
        alternatives = d.get("alternatives") or []
        self.console.print("[bold]what plan proposes instead:[/]")
        if d.get("recommendation") and d.get("command"):
            self.console.print(f"  recommended: {d['command']}")
        elif not alternatives:
            self.console.print("  nothing on this device", style="dim")
        for alt in alternatives[:5]:
            self.console.print(f"  {alt.get('rank', '')}. {alt.get('title', alt.get('kind', ''))}")
            if alt.get("command"):
                self.console.print(f"     {alt['command']}", style="dim")

    def _on_note(self, d: dict[str, Any]) -> None:
        self.console.print(f"  note: {d['text']}", style="dim")

    def _on_exit(self, d: dict[str, Any]) -> None:
        self._stop_status()
        style = "green" if d["code"] == 0 else "red"
        self.console.print(f"[bold {style}]exit {d['code']}[/]: {d['reason']}")
