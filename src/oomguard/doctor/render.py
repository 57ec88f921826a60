"""Human output for doctor, lint and calibrate: a view over the Diagnosis value."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from oomguard.doctor.findings import LABELS, Diagnosis, Finding
from oomguard.doctor.not_memory import EngineFault


def _head(rank: int, finding: Finding) -> Text:
    label = LABELS.get(finding.cause, finding.cause.replace("_", " "))
    head = Text(f"\n{rank}. {label}", style="bold cyan" if rank == 1 else "bold")
    if finding.sure:
        tier = f"sure: {finding.mechanism}, right {finding.confidence:.0%} of the time"
    else:
        tier = f"probability {finding.confidence:.0%}"
    if getattr(finding, "severity", None) == "tip":
        tier = f"tip, {tier}"
    head.append(f"  [{finding.cause}, {tier}]", style="dim")
    return head


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.4g}"


def render_findings(
    console: Console, findings: list[Finding], title: str, *, fixes_of_first_only: bool = False
) -> None:
    """Print findings best first: cause, confidence, explanation, evidence, fixes in order."""
    console.print(Text(title, style="bold"))
    for rank, finding in enumerate(findings, start=1):
        console.print(_head(rank, finding))
        console.print(f"   {finding.summary}", soft_wrap=True, highlight=False)
        if finding.explanation and rank == 1:
            console.print(Text(f"   {finding.explanation}", style="italic"), soft_wrap=True)
        if finding.numbers and rank == 1:
            shown = ", ".join(f"{k} {_number(v)}" for k, v in finding.numbers.items())
            console.print(Text(f"   numbers: {shown}", style="dim"), soft_wrap=True)
        for ev in finding.evidence[:4]:
            where = f"line {ev.line}" if ev.line else "command"
            console.print(Text(f"   {where}: ", style="dim") + Text(ev.text[:200]), soft_wrap=True)
        if fixes_of_first_only and rank > 1:
            continue
        if finding.fixes:
            console.print(Text("   fix, in this order:", style="green"))
            for fix in finding.fixes:
                line = Text("     → ", style="green") + Text(fix.as_text, style="bold")
                if fix.why:
                    line += Text(f"   {fix.why}", style="dim")
                console.print(line, soft_wrap=True)


def render_diagnosis(console: Console, diagnosis: Diagnosis) -> None:
    """The doctor's report: the answer (or the candidates it cannot tell apart), the facts
    that would settle it, what the log states, and the predicted restart."""
    parsed = diagnosis.parsed
    if not diagnosis.oom_found and diagnosis.not_memory is not None:
        render_not_memory(console, diagnosis.not_memory, parsed.lines)
        return
    if not diagnosis.oom_found:
        console.print(f"No out-of-memory failure found in {parsed.lines:,} lines.")
        if parsed.errors:
            console.print(
                f"First error: line {parsed.errors[0].line}: {parsed.errors[0].text[:200]}",
                soft_wrap=True,
            )
        return
    if diagnosis.abstained:
        title = (
            f"An out-of-memory failure ({parsed.lines:,} lines read), but the log does not "
            "say which cause: these are the candidates, none likely enough to answer"
        )
    else:
        title = f"Diagnosis ({parsed.lines:,} lines read)"
    render_findings(console, diagnosis.findings, title, fixes_of_first_only=True)
    if diagnosis.needs:
        console.print(Text("\nWhat would settle it:", style="bold yellow"))
        for need in diagnosis.needs:
            settles = ", ".join(LABELS.get(c, c) for c in need.settles)
            console.print(f"  • {need.what}: {need.how}  (tells apart: {settles})", soft_wrap=True)
    _render_stated(console, diagnosis)
    plan = diagnosis.plan
    if plan:
        applied = ", ".join(plan.get("applied") or []) or "the same settings"
        verdict = "starts" if plan.get("fits") else "still does not fit"
        console.print(
            f"\nWith {applied}: predicted KV cache {plan.get('kv_cache_gib')} GiB, "
            f"{plan.get('kv_cache_tokens'):,} tokens, max concurrency "
            f"{plan.get('max_concurrency'):.2f}x — {verdict}.",
            soft_wrap=True,
        )


def render_not_memory(console: Console, fault: EngineFault, lines: int) -> None:
    """A failure that is not memory: what it is, why no memory setting fixes it, what to do."""
    info = fault.info
    console.print(Text(f"Not a memory failure ({lines:,} lines read): {info.label}", style="bold"))
    console.print(f"   {info.summary}", soft_wrap=True, highlight=False)
    console.print(Text(f"   {info.why}", style="italic"), soft_wrap=True)
    ev = fault.evidence
    console.print(Text(f"   line {ev.line}: ", style="dim") + Text(ev.text[:200]), soft_wrap=True)
    console.print(Text("   what to do, in this order:", style="green"))
    for action in info.actions:
        console.print(Text("     → ", style="green") + Text(action), soft_wrap=True)


def _render_stated(console: Console, diagnosis: Diagnosis) -> None:
    parsed = diagnosis.parsed
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
