"""``oomguard bench``: prove a configuration under peak load and find the highest safe
concurrency. Exit codes: 0 a safe point was found, 1 even the lowest concurrency preempted or
failed, 2 bad input (one line, no traceback)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from oomguard import cli_options as opt
from oomguard.errors import BadInput

if TYPE_CHECKING:
    from oomguard.bench.workload import LoadProfile

_HELP = """Find how many concurrent requests of your peak shape a running vLLM server holds with
zero preemptions, and what --max-num-seqs and the guard's watermarks should be.

Stages of fixed concurrency (closed loop) grow from the pool the server states and bisect to
the highest safe one; a stage stops at the first preemption or when KV usage reaches 0.98 (the
server is read every 0.25 s, and the client counts its requests' KV as the tokens arrive).
Works through `oomguard guard` too, and (client figures only) against any OpenAI-compatible
server."""


def register(app: typer.Typer) -> None:
    """Add ``oomguard bench`` to the main app."""
    app.command("bench", help=_HELP)(bench_command)


UrlArgument = Annotated[
    str, typer.Argument(help="Base URL of the server (vLLM, or the guard in front of it).")
]

PromptTokensOption = Annotated[
    int | None, typer.Option("--prompt-tokens", help="Peak prompt length in tokens (exact).")
]

MaxTokensOption = Annotated[
    int | None, typer.Option("--max-tokens", help="Tokens each request generates (ignore_eos).")
]

WorkloadOption = Annotated[
    Path | None,
    typer.Option("--workload", help="Length distributions (YAML/JSON) or real requests (.jsonl)."),
]

ModelOption = Annotated[
    str | None, typer.Option("--model", help="Served model name (default: the server's first).")
]

BudgetSOption = Annotated[
    float, typer.Option("--budget-s", help="Wall-clock budget for the whole run.")
]

ReportOption = Annotated[
    Path | None,
    typer.Option("--report", help="Write bench.json, report.html and PNG plots here."),
]

AsJsonOption = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")]

HighWatermarkOption = Annotated[
    float,
    typer.Option("--high-watermark", help="A safe stage keeps KV usage at or below this fraction."),
]

ConcurrencyOption = Annotated[
    int | None,
    typer.Option("--concurrency", help="Prove this one concurrency instead of searching."),
]

RequestsOption = Annotated[
    int | None, typer.Option("--requests", help="With --concurrency: requests in the stage.")
]

HoldSOption = Annotated[
    float,
    typer.Option("--hold-s", help="Then hold the safe concurrency this many seconds more."),
]

MaxConcurrencyOption = Annotated[
    int, typer.Option("--max-concurrency", help="Never test above this.")
]

StartConcurrencyOption = Annotated[
    int | None,
    typer.Option(
        "--start-concurrency", help="First stage (default: KV pool ÷ blocks per request)."
    ),
]

WavesOption = Annotated[int, typer.Option("--waves", help="Requests per slot in a stage.")]

SampleIntervalSOption = Annotated[
    float, typer.Option("--sample-interval-s", help="Server sampling period (≤ 0.5).")
]

MetricsUrlOption = Annotated[
    str | None, typer.Option("--metrics-url", help="vLLM's /metrics when URL is a proxy.")
]

TokenizerOption = Annotated[
    Path | None,
    typer.Option(
        "--tokenizer",
        help="tokenizer.json (or its directory) when the server has no /tokenize.",
    ),
]

GpuOption = Annotated[
    str | None,
    typer.Option("--gpu", help="GPU name for the calibration store (default: NVML)."),
]

TensorParallelSizeOption = Annotated[
    int,
    typer.Option(
        "--tensor-parallel-size", "-tp", help="The server's TP, for the calibration store."
    ),
]

RecordOption = Annotated[
    bool,
    typer.Option(
        "--record/--no-record",
        help="Write the measured capacity and prefix-cache hit rate into the calibration store.",
    ),
]


def bench_command(
    url: UrlArgument,
    prompt_tokens: PromptTokensOption = None,
    max_tokens: MaxTokensOption = None,
    workload: WorkloadOption = None,
    model: ModelOption = None,
    budget_s: BudgetSOption = 600.0,
    report: ReportOption = None,
    as_json: AsJsonOption = False,
    shared_prefix: opt.SharedPrefix = None,
    high_watermark: HighWatermarkOption = 0.95,
    concurrency: ConcurrencyOption = None,
    requests: RequestsOption = None,
    hold_s: HoldSOption = 0.0,
    max_concurrency: MaxConcurrencyOption = 256,
    start_concurrency: StartConcurrencyOption = None,
    waves: WavesOption = 3,
    sample_interval_s: SampleIntervalSOption = 0.25,
    metrics_url: MetricsUrlOption = None,
    tokenizer: TokenizerOption = None,
    gpu: GpuOption = None,
    tensor_parallel_size: TensorParallelSizeOption = 1,
    record: RecordOption = True,
) -> int:
    """Run the bench and render it; returns the exit code."""
    from rich.console import Console

    from oomguard.bench.runner import BenchSettings, run_bench

    settings = BenchSettings(
        url=url,
        workload=_workload(prompt_tokens, max_tokens, workload, shared_prefix),
        model=model,
        budget_s=budget_s,
        high_watermark=high_watermark,
        sample_interval_s=sample_interval_s,
        waves=waves,
        max_concurrency=max_concurrency,
        start_concurrency=start_concurrency,
        concurrency=concurrency,
        requests=requests,
        hold_s=hold_s,
        metrics_url=metrics_url,
        tokenizer=tokenizer,
    )
    if report is not None:
        _check_report_dir(report)
    err = Console(stderr=True, highlight=False)
    from oomguard.bench.progress import LiveProgress

    with LiveProgress(err, settings.budget_s, settings.high_watermark) as progress:
        result = run_bench(settings, progress)
    if record:
        from oomguard.bench.calibrate import record_run

        result.calibration = record_run(result, gpu=gpu, tp=tensor_parallel_size)
    from oomguard.bench.report import print_summary, result_dict, write_json

    data = result_dict(result)
    if report is not None:
        from oomguard.bench.html import write_report

        write_json(result, report / "bench.json")
        files = write_report(data, report)
        data["report_files"] = {k: str(v) for k, v in files.items()} | {
            "json": str(report / "bench.json")
        }
    if as_json:
        sys.stdout.write(json.dumps(data, indent=1) + "\n")
    else:
        out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
        print_summary(data, out)
        if report is not None:
            out.print(f"report: {report / 'report.html'}")
        if result.calibration and result.calibration.get("stored"):
            out.print(f"calibration: stored under {result.calibration['key']}")
    return 130 if result.stopped_by == "interrupted" else result.exit_code


def _workload(
    prompt_tokens: int | None, max_tokens: int | None, path: Path | None, prefix_text: str | None
) -> LoadProfile:
    from oomguard.bench.workload import (
        DistributionWorkload,
        FixedWorkload,
        ReplayWorkload,
        load_workload,
    )
    from oomguard.workload import shared_prefix_tokens

    # a fraction is of the request's length (prompt + output), as in plan
    length = prompt_tokens + max_tokens if prompt_tokens and max_tokens else None
    shared_prefix = shared_prefix_tokens(prefix_text, length)

    if path is not None:
        if prompt_tokens is not None:
            raise BadInput("--prompt-tokens and --workload both state the load", "give one of them")
        loaded = load_workload(path, default_max_tokens=max_tokens)
        if shared_prefix and isinstance(loaded, DistributionWorkload):
            from dataclasses import replace

            return replace(loaded, shared_prefix_tokens=shared_prefix)
        if shared_prefix and isinstance(loaded, ReplayWorkload):
            raise BadInput(
                "--shared-prefix does not apply to replayed requests",
                "their prompts share what they share",
            )
        return loaded
    if prompt_tokens is None or max_tokens is None:
        raise BadInput("no load given", "pass --prompt-tokens N --max-tokens M, or --workload FILE")
    return FixedWorkload(prompt_tokens, max_tokens, shared_prefix)


def _check_report_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise BadInput(f"--report {path} is a file", "give a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(
            f"cannot create --report {path}: {exc.strerror}", "give a writable directory"
        ) from None
