"""Human output for a :class:`PlanResult`: one rich renderable per concept, composed in order."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from oomguard.memory.activation import Estimate
from oomguard.plan.result import GIB, Candidate, PlanResult


def _gib(value_bytes: float) -> str:
    return f"{value_bytes / GIB:.2f}"


def _estimate_cell(est: Estimate) -> str:
    if not est.estimated:
        return "measured" if est.basis.startswith("measured") else "exact"
    low, high = est.low_bytes / GIB, est.high_bytes / GIB
    return f"estimate ({low:.2f}–{high:.2f})"


def header(result: PlanResult) -> Text:
    """One line: model, GPUs, vLLM version, and where the GPU facts came from."""
    c = result.plan
    s = c.prediction.settings
    text = Text()
    text.append("oomguard plan ", style="bold")
    text.append(result.model_ref, style="bold cyan")
    text.append(f"  on {c.gpu_count}× {c.gpu.name} ({c.gpu.total_gib:.2f} GiB)")
    text.append(f"  vLLM {s.vllm_version}", style="dim")
    if result.gpu_source == "sizing":
        text.append("  (smallest catalogue GPU that serves; see the sizing table)", style="dim")
    return text


def memory_table(c: Candidate) -> Table:
    """The startup memory breakdown vLLM will compute, per GPU (most loaded rank)."""
    p = c.prediction
    s = p.settings
    table = Table(title="Memory per GPU (GiB)", title_justify="left", show_edge=False)
    table.add_column("term")
    table.add_column("GiB", justify="right")
    table.add_column("how known", style="dim")
    table.add_row("total (CUDA)", _gib(p.total_bytes), c.gpu.source or "catalogue")
    if s.kv_cache_memory_bytes:
        table.add_row(
            "requested", _gib(p.requested_bytes), "--kv-cache-memory-bytes fixes the KV size"
        )
    else:
        table.add_row("requested", _gib(p.requested_bytes), f"{s.gpu_memory_utilization} × total")
    table.add_row(
        "  weights",
        _gib(p.weights.value_bytes),
        _estimate_cell(p.weights) if p.weights.estimated else c.weights_label or "exact",
    )
    table.add_row("  activation peak", _gib(p.activation.value_bytes), _estimate_cell(p.activation))
    table.add_row("  non-torch", _gib(p.non_torch.value_bytes), _estimate_cell(p.non_torch))
    graph_note = "--enforce-eager: none" if s.enforce_eager else _estimate_cell(p.cudagraph)
    table.add_row("  CUDA graphs", _gib(p.cudagraph.value_bytes), graph_note)
    if any(x.code == "weights_exceed_gpu" for x in p.problems):
        table.add_row("[bold]KV cache[/]", "[bold]—[/]", "never reached: loading the weights fails")
    elif p.kv_cache_bytes <= 0:
        table.add_row(
            "[bold]KV cache[/]",
            f"[bold red]{_gib(p.kv_cache_bytes)}[/]",
            "nothing left for the KV cache",
        )
    else:
        table.add_row(
            "[bold]KV cache[/]",
            f"[bold]{_gib(p.kv_cache_bytes)}[/]",
            f"{p.num_blocks:,} blocks × {p.bytes_per_block:,} B",
        )
    table.add_section()
    table.add_row(
        "KV cache tokens", f"{p.kv_cache_tokens:,}", f"{p.kv_bytes_per_token:,} B/token per GPU"
    )
    table.add_row(
        "max concurrency",
        f"{float(p.max_concurrency):.2f}×",
        f"requests of max_model_len {s.max_model_len:,} tokens",
    )
    if p.estimated_max_model_len:
        table.add_row(
            "estimated max model len",
            f"{p.estimated_max_model_len:,}",
            "what vLLM's error will suggest",
        )
    return table


def verdict(result: PlanResult) -> Text:
    """Green when the plan starts (and serves the stated workload), red otherwise, with why."""
    c = result.plan
    text = Text()
    w = result.workload
    if result.fits:
        text.append("✓ fits", style="bold green")
        if w is not None and w.stated and c.serve is not None:
            text.append(
                f": serves {w.concurrency} concurrent requests of {w.p99_tokens:,} tokens "
                f"({c.serve.max_concurrency:.2f} fit, {c.serve.margin_achieved:+.0%} spare; asked {w.margin:.0%})"
            )
        return text
    text.append("✗ does not fit", style="bold red")
    if not c.fits:
        for problem in c.prediction.problems:
            text.append(f"\n  [{problem.code}] ", style="red")
            text.append(problem.message)
    elif c.serve is not None and not c.serve.served:
        text.append(f": {c.serve.reason}")
    return text


def log_lines(c: Candidate) -> RenderableType:
    """The startup lines vLLM will print for this configuration."""
    lines = "\n".join(c.prediction.log_lines) or "(none)"
    return Panel(
        Text(lines, style="dim"), title="vLLM will log", title_align="left", border_style="dim"
    )


def recommendation(result: PlanResult) -> RenderableType | None:
    """The recommended flags, each with its reason."""
    rec = result.recommendation
    if rec is None:
        return None
    heading = (
        "Recommendation"
        if result.workload and result.workload.stated
        else "A configuration that fits"
    )
    table = Table(title=heading, title_justify="left", show_edge=False, expand=False)
    table.add_column("flag", style="cyan", no_wrap=True)
    table.add_column("value", no_wrap=True)
    table.add_column("why")
    for reason in rec.reasons:
        value = "" if reason.value is None else str(reason.value)
        table.add_row(reason.flag, value, reason.reason)
    extra = []
    if rec.min_gpu_memory_utilization is not None:
        extra.append(
            Text(
                f"Lowest --gpu-memory-utilization that still serves: ~{rec.min_gpu_memory_utilization} "
                "(frees the rest for co-tenants).",
                style="dim",
            )
        )
    return Group(table, *extra)


def alternatives(result: PlanResult) -> RenderableType | None:
    """Ranked ways out when nothing on the given GPUs serves the workload."""
    if not result.alternatives:
        return None
    parts: list[RenderableType] = [
        Text("Nothing on the given GPUs serves this workload. Alternatives, ranked:", style="bold")
    ]
    for alt in result.alternatives:
        mark = "✓" if alt.serves_workload else "~"
        style = "green" if alt.serves_workload else "yellow"
        line = Text(f"{alt.rank}. ")
        line.append(f"{mark} {alt.title}", style=style)
        parts.append(line)
        n = alt.numbers
        figures = []
        if "kv_cache_tokens" in n and n.get("kv_cache_tokens") is not None:
            figures.append(f"KV {n.get('kv_cache_gib')} GiB = {n['kv_cache_tokens']:,} tokens")
        if n.get("max_concurrency") is not None:
            figures.append(f"{n['max_concurrency']} concurrent at the P99")
        if n.get("weights_gib_per_gpu") is not None:
            figures.append(f"weights {n['weights_gib_per_gpu']} GiB/GPU")
        if alt.kind == "llama_cpp":
            figures = [
                f"-ngl {n['ngl']} of {n['layers']} layers ({n['layer_gib']} GiB + {n['kv_per_layer_gib']} GiB KV each)",
                f"GPU ~{n['gpu_gib']} GiB, host RAM ~{n['cpu_ram_gib']} GiB, GGUF ~{n['file_gib']} GiB",
            ]
        if alt.kind == "cpu_offload" and alt.serves_workload:
            figures.append(f"host RAM ~{n['host_ram_gib']} GiB")
        if figures:
            parts.append(Text("   " + "; ".join(figures), style="dim"))
        parts.append(Text("   $ " + alt.command, style="cyan"))
        for caveat in alt.caveats:
            parts.append(Text("   ! " + caveat, style="yellow"))
    return Group(*parts)


def sizing(result: PlanResult) -> RenderableType | None:
    """Which catalogue GPUs (and how many) serve the workload."""
    if not result.sizing:
        return None
    w = result.workload
    title = "Sizing: smallest count of each GPU that serves"
    if w is not None:
        title += f" {w.concurrency}× {w.p99_tokens:,} tokens"
        if w.margin:
            title += f" (+{w.margin:.0%})"
    table = Table(title=title, title_justify="left", show_edge=False)
    for col, justify in (("GPU", "left"), ("GiB", "right"), ("count", "right"), ("weights/GPU", "right"),
                         ("KV tokens", "right"), ("concurrency", "right"), ("spare", "right")):  # fmt: skip
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in result.sizing:
        spare = "" if row.margin_achieved is None else f"{row.margin_achieved:+.0%}"
        table.add_row(row.gpu, f"{row.total_gib:.1f}", str(row.count), f"{row.weights_gib_per_gpu}",
                      f"{row.kv_cache_tokens:,}", f"{row.max_concurrency:.2f}", spare)  # fmt: skip
    return table


def commands(result: PlanResult) -> RenderableType:
    """``vllm serve``, ``LLM(...)`` and YAML forms of the planned configuration."""
    cmds = result.commands()
    title = "Run it" if result.fits else "Your configuration (does not fit as is)"
    return Group(
        Text(title, style="bold"),
        Syntax(cmds["vllm_serve_multiline"], "bash", theme="ansi_dark", background_color="default"),
        Syntax(
            "from vllm import LLM\nllm = " + cmds["llm"],
            "python",
            theme="ansi_dark",
            background_color="default",
        ),
        Text("# vllm serve --config plan.yaml", style="dim"),
        Syntax(cmds["yaml"].rstrip(), "yaml", theme="ansi_dark", background_color="default"),
    )


def footer(result: PlanResult) -> Text:
    """Calibration status, notes, and the time the plan took."""
    text = Text()
    if result.calibration.used:
        text.append(
            f"Calibrated: {', '.join(result.calibration.terms)} measured ({result.calibration.source}).\n",
            style="green",
        )
    else:
        text.append(
            "Activation, non-torch and CUDA-graph terms are estimates (ranges above); "
            "`oomguard calibrate LOG` replaces them with your own measurements.\n",
            style="dim",
        )
    for note in result.notes:
        text.append(f"note: {note}\n", style="yellow")
    text.append(f"planned in {result.elapsed_s * 1000:.0f} ms", style="dim")
    return text


def render(result: PlanResult, console: Console) -> None:
    """Print the whole plan: header, breakdown, verdict, logs, recommendation, fallbacks, commands."""
    console.print(header(result))
    if result.given is not result.plan and result.workload is not None and result.workload.stated:
        given = result.given
        console.print(
            Text(
                f"As given: KV cache {given.prediction.kv_cache_bytes / GIB:.2f} GiB, "
                f"{given.prediction.kv_cache_tokens:,} tokens"
                + (f" — {given.serve.reason}" if given.serve and given.serve.reason else ""),
                style="dim",
            )
        )
    console.print(memory_table(result.plan))
    console.print(verdict(result))
    console.print(log_lines(result.plan))
    for part in (recommendation(result), sizing(result), alternatives(result)):
        if part is not None:
            console.print(part)
    if not result.alternatives or result.plan.fits:
        console.print(commands(result))
    console.print(footer(result))
