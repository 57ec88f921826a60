"""Human output for doctor, lint and calibrate: a view over the Diagnosis value."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from oomguard.doctor.findings import Diagnosis, Finding

_LABELS = {
    "util_overshoot": "GPU memory utilization overshoot",
    "kv_too_small_for_max_len": "KV cache too small for max_model_len",
    "concurrency_or_batch": "too many sequences / too large a batch",
    "weights_dont_fit": "the weights do not fit",
    "cuda_graph": "CUDA-graph capture",
    "fragmentation": "allocator fragmentation",
    "multimodal_encoder": "multimodal encoder profiling",
    "leak_or_other_process": "leak or another process",
    "cpu_ram": "host RAM",
    "other": "other",
}


def render_findings(console: Console, findings: list[Finding], title: str) -> None:
    """Print findings best first: cause, confidence, explanation, evidence, fixes in order."""
    console.print(Text(title, style="bold"))
    for rank, finding in enumerate(findings, start=1):
        label = _LABELS.get(finding.cause, finding.cause)
        head = Text(f"\n{rank}. {label}", style="bold cyan" if rank == 1 else "bold")
        head.append(f"  [{finding.cause}, confidence {finding.confidence:.0%}]", style="dim")
        console.print(head)
        console.print(f"   {finding.summary}", soft_wrap=True, highlight=False)
        if finding.explanation and rank == 1:
            console.print(Text(f"   {finding.explanation}", style="italic"), soft_wrap=True)
        for ev in finding.evidence[:4]:
            where = f"line {ev.line}" if ev.line else "command"
            console.print(Text(f"   {where}: ", style="dim") + Text(ev.text[:200]), soft_wrap=True)
        fixes = finding.ordered_fixes()
        if fixes:
            console.print(Text("   fix, in this order:", style="green"))
            for fix in fixes:
                line = Text("     → ", style="green") + Text(fix.as_text, style="bold")
                if fix.why:
                    line += Text(f"   {fix.why}", style="dim")
                console.print(line, soft_wrap=True)


def render_diagnosis(console: Console, diagnosis: Diagnosis) -> None:
    """The doctor's report (or the no-OOM message)."""
    parsed = diagnosis.parsed
    if not diagnosis.oom_found:
        console.print(f"No out-of-memory failure found in {parsed.lines:,} lines.")
        if parsed.errors:
            console.print(
                f"First error: line {parsed.errors[0].line}: {parsed.errors[0].text[:200]}",
                soft_wrap=True,
            )
        return
    render_findings(console, diagnosis.findings, f"Diagnosis ({parsed.lines:,} lines read)")
    table = Table(title="What the log states", show_header=True, header_style="bold", box=None)
    table.add_column("value")
    table.add_column("")
    table.add_column("line", justify="right")
    for name, obs in list(parsed.fields.items())[:24]:
        value = obs.value
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        table.add_row(name, shown, str(obs.evidence.line))
    if parsed.failure_phase is not None:
        table.add_row(
            "phase failed",
            parsed.failure_phase.value.value,
            str(parsed.failure_phase.evidence.line),
        )
    if table.row_count:
        console.print()
        console.print(table)
    plan = diagnosis.plan
    if plan:
        applied = ", ".join(plan.get("applied") or []) or "the same settings"
        verdict = "starts" if plan.get("fits") else "still does not fit"
        console.print(
            f"\nWith {applied}: predicted KV cache {plan.get('kv_cache_gib')} GiB, "
            f"{plan.get('kv_cache_tokens'):,} tokens, max concurrency {plan.get('max_concurrency'):.2f}x — {verdict}.",
            soft_wrap=True,
        )
