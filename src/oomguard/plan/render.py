"""Human output for a :class:`PlanResult`: one rich renderable per concept, composed in order.

Everything fits 80 columns: tables wrap their last column, commands break at flag boundaries
with shell continuations so that what is printed can be pasted as is.
"""

from __future__ import annotations

import shlex

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from oomguard.memory.activation import Estimate
from oomguard.memory.engine import MemoryPrediction, Problem
from oomguard.plan.result import Candidate, PlanResult, SizingRow, weights_known
from oomguard.units import GIB, MIB, gib_text
from oomguard.vllm_args import render_serve

COMMAND_WIDTH = 76


def _estimate_cell(est: Estimate) -> str:
    if not est.estimated:
        return "measured" if est.basis.startswith("measured") else "exact"
    low, high = est.low_bytes / GIB, est.high_bytes / GIB
    return f"estimate ({low:.2f}–{high:.2f})"


def _gpu_source(c: Candidate) -> str:
    source = (c.gpu.source or "").lower()
    if source.startswith("nvml"):
        return "NVML"
    if source.startswith("user"):
        return "--gpu-memory-gib"
    if source.startswith("observed"):
        return "catalogue, as real logs report it"
    if source.startswith("derived"):
        return "catalogue, nvidia-smi total less driver reserve"
    return "catalogue"


def wrap_command(command: str, width: int = COMMAND_WIDTH, indent: str = "    ") -> str:
    """Break a one-line shell command at flag boundaries (`` \\`` continuations) to ``width``.

    A flag stays with its value; the result pastes into a shell as the same command.
    """
    tokens = shlex.split(command)
    groups: list[str] = []
    for token in tokens:
        if groups and not token.startswith("-") and groups[-1].startswith("-"):
            if " " not in groups[-1]:
                groups[-1] += " " + shlex.quote(token)
                continue
        groups.append(shlex.quote(token))
    lines: list[str] = []
    line = ""
    for group in groups:
        candidate = f"{line} {group}" if line else group
        room = width - (len(indent) if lines else 0) - 2
        if line and len(candidate) > room:
            lines.append(line)
            line = group
        else:
            line = candidate
    lines.append(line)
    return " \\\n".join((indent + part if i else part) for i, part in enumerate(lines))


def problem_line(problem: Problem, p: MemoryPrediction) -> str:
    """One short line for a startup failure (the full vLLM text is in the log box)."""
    s = p.settings
    if problem.code == "max_len_exceeds_kv" and s.max_model_len:
        est = (
            f"; it suggests --max-model-len {p.estimated_max_model_len:,}"
            if p.estimated_max_model_len
            else ""
        )
        return (
            f"one request of max_model_len {s.max_model_len:,} needs more than the "
            f"{p.kv_cache_bytes / GIB:.2f} GiB KV cache: vLLM refuses to start{est}"
        )
    if problem.code == "no_kv_memory":
        return (
            "nothing is left for the KV cache after weights and activations: vLLM refuses to start"
        )
    if problem.code == "free_memory_below_requested":
        return (
            "free GPU memory is below gpu_memory_utilization × total: vLLM refuses to start "
            "(lower the utilization or free the GPU)"
        )
    first = problem.message.split(". ")[0].rstrip(".")
    return first if len(first) <= 160 else first[:157] + "…"


def header(result: PlanResult) -> RenderableType:
    """Model, GPUs, vLLM version; the workload when one was stated."""
    c = result.plan
    s = c.prediction.settings
    text = Text()
    text.append(result.model_ref, style="bold cyan")
    if not c.model.verified:
        text.append(" [architecture not verified]", style="bold yellow")
    text.append(f" on {c.gpus_used}× {c.gpu.name} ({c.gpu.total_gib:.2f} GiB)")
    if c.parallel_label:
        text.append(f", {c.parallel_label}")
    if c.gpu_count > c.gpus_used and result.gpu_source != "sizing":
        text.append(f" of {c.gpu_count}", style="dim")
    text.append(f", vLLM {s.vllm_version}", style="dim")
    w = result.workload
    if w is not None and w.stated:
        line = f"\nworkload: {w.concurrency} concurrent × {w.p99_tokens:,} tokens (P99)"
        dp = s.data_parallel_size
        if dp > 1:
            line += f", {-(-w.concurrency // dp)} per data-parallel rank"
        if w.shared_prefix_tokens:
            line += f", {w.shared_prefix_tokens:,}-token shared prefix"
        line += f", +{w.margin:.0%} margin"
        if w.headroom_bytes:
            line += f", {w.headroom_bytes / GIB:.1f} GiB kept free"
        text.append(line, style="dim")
    if result.gpu_source == "sizing":
        text.append(
            "\nno --gpu: the smallest catalogue GPU that serves (sizing table below)", style="dim"
        )
    return text


def memory_table(c: Candidate, title: str = "Memory per GPU (GiB)") -> Table:
    """The startup memory breakdown vLLM will compute, per GPU (most loaded rank)."""
    p = c.prediction
    s = p.settings
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("term", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("how known", style="dim")
    table.add_row("total (CUDA)", gib_text(p.total_bytes), _gpu_source(c))
    if s.kv_cache_memory_bytes:
        table.add_row(
            "requested", gib_text(p.requested_bytes), "--kv-cache-memory-bytes fixes the KV size"
        )
    else:
        table.add_row(
            "requested", gib_text(p.requested_bytes), f"{s.gpu_memory_utilization} × total"
        )
    estimated, how = weights_known(c)
    weights_cell = f"{_estimate_cell(p.weights)}: {how.split(': ', 1)[-1]}" if estimated else how
    table.add_row("  weights", gib_text(p.weights.value_bytes), weights_cell)
    table.add_row(
        "  activation peak", gib_text(p.activation.value_bytes), _estimate_cell(p.activation)
    )
    table.add_row("  non-torch", gib_text(p.non_torch.value_bytes), _estimate_cell(p.non_torch))
    if s.enforce_eager:
        graph_note = "--enforce-eager: none"
    elif p.cudagraph.value_bytes == 0 and not p.cudagraph.estimated:
        graph_note = "not taken from the KV budget in this version"
    else:
        graph_note = _estimate_cell(p.cudagraph)
    table.add_row("  CUDA graphs", gib_text(p.cudagraph.value_bytes), graph_note)
    if any(x.code == "weights_exceed_gpu" for x in p.problems):
        table.add_row("[bold]KV cache[/]", "[bold]—[/]", "never reached: loading the weights fails")
        return table
    if p.kv_cache_bytes <= 0:
        table.add_row(
            "[bold]KV cache[/]", f"[bold red]{gib_text(p.kv_cache_bytes)}[/]", "nothing left for it"
        )
        return table
    low, high = p.kv_cache_bytes_range
    spread = f"; range {gib_text(low)}–{gib_text(high)}" if high > low else ""
    table.add_row(
        "[bold]KV cache[/]",
        f"[bold]{gib_text(p.kv_cache_bytes)}[/]",
        f"{p.num_blocks:,} blocks × {p.bytes_per_block / MIB:g} MiB{spread}",
    )
    table.add_section()
    t_low, t_high = p.kv_cache_tokens_range
    t_spread = f"; range {t_low:,}–{t_high:,}" if t_high > t_low else ""
    table.add_row(
        "KV cache tokens",
        f"{p.kv_cache_tokens:,}",
        f"{p.kv_bytes_per_token:,} B/token per GPU{t_spread}",
    )
    table.add_row(
        "max concurrency",
        f"{float(p.max_concurrency):.2f}×",
        f"requests of {s.max_model_len:,} tokens (max_model_len)",
    )
    if p.estimated_max_model_len:
        table.add_row(
            "max model len", f"{p.estimated_max_model_len:,}", "what vLLM's error will suggest"
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
            dp = c.settings.data_parallel_size
            if dp > 1:
                text.append(
                    f": {c.serve.max_concurrency:.2f} requests of {w.p99_tokens:,} tokens fit on "
                    f"each of {dp} data-parallel ranks ({c.serve.max_concurrency * dp:.1f} in "
                    f"all), {-(-w.concurrency // dp)} per rank needed for {w.concurrency} "
                    f"({c.serve.margin_achieved:+.0%} spare)"
                )
            else:
                text.append(
                    f": {c.serve.max_concurrency:.2f} requests of {w.p99_tokens:,} tokens fit, "
                    f"{w.concurrency} needed ({c.serve.margin_achieved:+.0%} spare)"
                )
            low = c.serve.max_concurrency_range[0]
            if not c.serve.served_at_low_end and low > 0:
                text.append(
                    f"\n  ! at the low end of the estimates' range only {low:.2f} fit: "
                    "`oomguard calibrate` with your own startup log makes the terms exact",
                    style="yellow",
                )
        return text
    if not c.fits:
        text.append("✗ does not start", style="bold red")
        problems = c.prediction.problems
        if len(problems) == 1:
            text.append(": " + problem_line(problems[0], c.prediction))
        for problem in problems if len(problems) > 1 else ():
            text.append("\n  · " + problem_line(problem, c.prediction))
    else:
        text.append("✗ does not serve the workload", style="bold red")
        if c.serve is not None and c.serve.reason:
            text.append(f": {c.serve.reason}")
    return text


def log_lines(c: Candidate) -> RenderableType | None:
    """The startup lines (or the error) vLLM will print for this configuration."""
    p = c.prediction
    lines = list(p.log_lines)
    if not lines:
        if any(x.code == "weights_exceed_gpu" for x in p.problems):
            lines = [
                "vLLM stops while loading the weights: torch.OutOfMemoryError: CUDA out of "
                "memory (no KV cache lines are printed)"
            ]
        else:
            lines = [x.message for x in p.problems]
    if not lines:
        return None
    return Panel(
        Text("\n".join(lines), style="dim"),
        title="vLLM will log",
        title_align="left",
        border_style="dim",
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
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("flag", style="cyan", no_wrap=True)
    table.add_column("value", no_wrap=True, max_width=24, overflow="fold")
    table.add_column("why")
    head: list[RenderableType] = [Text(heading, style="italic")]
    for reason in rec.reasons:
        if reason.flag == "(verdict)":
            continue  # the verdict line says it
        if reason.flag == "model":  # a repo id is too long for the value column
            line = Text("model ", style="cyan")
            line.append(str(reason.value), style="bold")
            line.append(f": {reason.reason}", style="dim")
            head.append(line)
            continue
        value = "" if reason.value is None else str(reason.value)
        table.add_row(reason.flag, value, reason.reason)
    extra: list[RenderableType] = []
    if rec.candidate is not result.plan:
        extra.append(Text("$ " + wrap_command(_serve_line(rec.candidate)), style="cyan"))
        est = result.given.prediction.estimated_max_model_len
        if est:
            extra.append(
                Text(
                    "or keep the weights and KV cache as they are and cap the context at vLLM's "
                    f"own estimate: --max-model-len {est}",
                    style="dim",
                )
            )
    if rec.min_gpu_memory_utilization is not None:
        extra.append(
            Text(
                f"--gpu-memory-utilization down to ~{rec.min_gpu_memory_utilization} still serves "
                "(frees the rest for other processes).",
                style="dim",
            )
        )
    return Group(*head, table, *extra)


def _tier_figures(n: dict[str, object]) -> str:
    """The fallback chain's price of one tier (oomguard.plan.chain)."""
    parts = [f"tier {n['tier']}: {n['tier_name']}"]
    if n.get("gpu_count"):
        parts.append(f"GPU {n['gpu_gib_per_device']} GiB × {n['gpu_count']}")
    if n.get("host_gib"):
        parts.append(f"host {n['host_gib']} GiB")
    if n.get("decode_tokens_per_s_bound") is not None:
        slow = (
            f", ~{n['slowdown']}× the planned GPU's time per token"
            if n.get("slowdown") is not None
            else ""
        )
        parts.append(f"≤{n['decode_tokens_per_s_bound']} tokens/s per sequence{slow} (estimate)")
    return " · ".join(parts)


def _alt_figures(alt_kind: str, serves: bool, n: dict[str, object]) -> list[str]:
    if "tier" in n and alt_kind in ("llama_cpp", "cpu_only", "as_planned"):
        return [_tier_figures(n)]
    if n.get("problem"):
        return [str(n["problem"])]
    figures: list[str] = []
    if n.get("weights_gib_per_gpu") is not None and alt_kind != "cpu_offload":
        figures.append(f"weights {n['weights_gib_per_gpu']} GiB/GPU")
    if n.get("kv_cache_tokens"):
        figures.append(f"KV {n.get('kv_cache_gib')} GiB = {n['kv_cache_tokens']:,} tokens")
    if n.get("max_concurrency") is not None:
        figures.append(f"{n['max_concurrency']} concurrent at the P99")
    if alt_kind == "cpu_offload" and serves:
        figures.append(f"host RAM ~{n['host_ram_gib']} GiB")
    if "tier" in n:
        figures.append(_tier_figures(n))
    return figures


def alternatives(result: PlanResult, width: int = 80) -> RenderableType | None:
    """Ranked ways out when nothing on the given GPUs serves the workload."""
    if not result.alternatives:
        return None
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    command_width = max(40, width - 8)  # "1. ✓ " and "$ " before the first line
    for alt in result.alternatives:
        mark = "✓" if alt.serves_workload else "~"
        style = "green" if alt.serves_workload else "yellow"
        body: list[RenderableType] = [Text(alt.title, style=style)]
        starts = not alt.numbers.get("problem")
        figures = _alt_figures(alt.kind, alt.serves_workload, alt.numbers)
        if figures:
            body.append(Text("; ".join(figures), style="dim"))
        useful = starts and (alt.serves_workload or alt.kind not in ("cpu_offload", "as_planned"))
        if alt.command and useful:
            body.append(Text("$ " + wrap_command(alt.command, command_width), style="cyan"))
        for caveat in alt.caveats:
            body.append(Text("! " + caveat, style="yellow"))
        grid.add_row(Text(f"{alt.rank}. {mark}", style=style), Group(*body))
    heading = Text(
        "Nothing on the given GPUs serves this workload. Alternatives, ranked:", style="bold"
    )
    return Group(heading, grid)


SIZING_ROWS = 12


def _join_names(names: list[str]) -> str:
    """``["A100 40GB PCIe", "A100 40GB SXM"]`` → ``A100 40GB PCIe/SXM``."""
    heads = {n.rsplit(" ", 1)[0] for n in names if " " in n}
    if len(names) > 1 and len(heads) == 1 and all(" " in n for n in names):
        head = heads.pop()
        return head + " " + "/".join(n.rsplit(" ", 1)[1] for n in names)
    return ", ".join(names)


def sizing(result: PlanResult) -> RenderableType | None:
    """Which catalogue GPUs (and how many) serve the workload, cheapest first.

    GPUs with the same figures (PCIe and SXM of one chip) share a row; the table stops after
    :data:`SIZING_ROWS` rows (``--json`` lists them all).
    """
    if not result.sizing:
        return None
    w = result.workload
    title = "Sizing: smallest count of each GPU that serves"
    if w is not None:
        title += f" {w.concurrency}× {w.p99_tokens:,} tokens"
        if w.margin:
            title += f" (+{w.margin:.0%})"
    merged: list[tuple[list[str], SizingRow]] = []
    for row in result.sizing:
        same = next(
            (
                m
                for m in merged
                if m[1].count == row.count
                and m[1].kv_cache_tokens == row.kv_cache_tokens
                and round(m[1].total_gib, 1) == round(row.total_gib, 1)
            ),
            None,
        )
        if same is not None:
            same[0].append(row.gpu)
        else:
            merged.append(([row.gpu], row))
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("GPU", max_width=26)
    for col in ("GiB", "n", "weights", "KV tokens", "concurrent", "spare"):
        table.add_column(col, justify="right", no_wrap=True)
    for names, row in merged[:SIZING_ROWS]:
        spare = "" if row.margin_achieved is None else f"{row.margin_achieved:+.0%}"
        table.add_row(
            _join_names(names),
            f"{row.total_gib:.1f}",
            str(row.count),
            "" if row.weights_gib_per_gpu is None else f"{row.weights_gib_per_gpu:.1f}",
            f"{row.kv_cache_tokens:,}",
            f"{row.max_concurrency:.1f}",
            spare,
        )
    parts: list[RenderableType] = [table]
    rest = merged[SIZING_ROWS:]
    if rest:
        others = ", ".join(_join_names(group) for group, _ in rest)
        parts.append(Text(f"also serve (more memory): {others}", style="dim"))
    return Group(*parts)


def _serve_line(candidate: Candidate) -> str:
    """The one-line ``vllm serve`` of ``candidate`` (what its ``commands()`` gives, without
    building the LLM and YAML forms)."""
    return render_serve(candidate.model_ref, candidate.settings)


def commands(result: PlanResult) -> RenderableType:
    """``vllm serve``, ``LLM(...)`` and YAML forms of the planned configuration."""
    cmds = result.commands()
    title = "Run it" if result.fits else "Your configuration (does not fit as is)"
    # plain styled text, not rich.syntax: highlighting loads pygments' lexers, the largest
    # import of a plan (tens of ms on every run) for a few coloured words
    return Group(
        Text(title, style="bold"),
        Text(cmds["vllm_serve_multiline"], style="green"),
        Text("from vllm import LLM\nllm = " + cmds["llm"], style="green"),
        Text("# or: vllm serve --config plan.yaml", style="dim"),
        Text(cmds["yaml"].rstrip(), style="green"),
    )


def prefix_caching(result: PlanResult) -> Text | None:
    """Prefix caching on or off from the hit rate bench or watch measured (nothing when none
    was measured)."""
    advice = result.prefix_caching
    if advice is None:
        return None
    text = Text()
    if advice.flag is None:
        text.append("Prefix caching: ", style="bold")
        text.append(advice.reason + ".\n", style="dim")
        return text
    text.append("Prefix caching: ", style="bold")
    text.append(advice.flag, style="bold green" if advice.enable else "bold yellow")
    text.append(f" ({advice.reason}).\n")
    planned = result.plan.settings.enable_prefix_caching
    if planned is not None and planned != advice.enable:
        text.append(f"The command below sets the opposite: use {advice.flag}.\n", style="yellow")
    return text


def footer(result: PlanResult) -> Text:
    """Calibration status, notes, and the time the plan took."""
    text = Text()
    cal = result.calibration
    if cal.used:
        names = {
            "weights": "weights",
            "activation": "activation peak",
            "non_torch": "non-torch",
            "cudagraph": "CUDA graphs",
        }
        terms = ", ".join(names.get(t, t) for t in cal.terms)
        source = cal.source.removeprefix("calibration: ")
        text.append(f"Calibrated: {terms} measured in {source}", style="green")
        if cal.key:
            text.append(f" (store entry {cal.key})", style="green")
        text.append(".\n", style="green")
    elif result.plan.prediction.activation.estimated:
        text.append(
            "Activation, non-torch and CUDA-graph terms are estimates; "
            "`oomguard calibrate LOG` replaces them with your own startup log's figures.\n",
            style="dim",
        )
    for note in result.notes:
        text.append(f"note: {note}\n", style="yellow")
    text.append(f"planned in {result.elapsed_s * 1000:.0f} ms", style="dim")
    return text


def render(result: PlanResult, console: Console) -> None:
    """Print the whole plan: header, breakdown, verdict, logs, recommendation, fallbacks,
    commands."""
    console.print(header(result))
    stated = result.workload is not None and result.workload.stated
    if result.given is not result.plan and stated:
        given = result.given
        gp = given.prediction
        if not given.fits:
            why = "does not start: " + problem_line(gp.problems[0], gp) if gp.problems else ""
        else:
            why = given.serve.reason if given.serve else ""
        console.print(Text(f"As given (vLLM defaults for unset flags): {why}", style="dim"))
    title = "Memory per GPU (GiB)"
    if result.given is result.plan and result.alternatives:
        title += ", as given"
    console.print(memory_table(result.plan, title))
    console.print(verdict(result))
    box = log_lines(result.plan)
    if box is not None:
        console.print(box)
    parts = (recommendation(result), prefix_caching(result), sizing(result))
    for part in (*parts, alternatives(result, console.width)):
        if part is not None:
            console.print(part)
    if result.fits:
        console.print(commands(result))
    if not stated and result.gpu_source != "sizing":
        console.print(
            Text(
                "Pass --p99-tokens and --concurrency to size the settings for your traffic.",
                style="dim",
            )
        )
    console.print(footer(result))
