"""``oomguard doctor`` and ``oomguard calibrate``: thin shells over the library.

Exit codes (doctor LOG): 0 a cause was found, 2 bad input, 3 the log shows no out-of-memory
failure (a failure that is not memory, such as an illegal instruction, is named with what to
do), 4 an out-of-memory failure whose cause the log does not settle (the doctor abstained
and says which lines or facts would). Linting (--command): 0 no problems (tips, which are
worth changing but not wrong, do not fail it), 1 problems found,
2 bad input (an unreadable command, a flag vLLM does not have).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from oomguard import cli_options as opt
from oomguard.errors import BadInput

_CONTEXT = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "allow_interspersed_args": True,
}
_LAUNCHERS = ("vllm", "python", "python3", "serve")
EXIT_NO_OOM = 3
EXIT_ABSTAINED = 4


def doctor_command(
    ctx: typer.Context,
    items: list[str] = typer.Argument(
        None, help="LOGFILE (or - for stdin); or, after --, a vllm serve command."
    ),
    model: str = typer.Option(None, "--model", help="The model, when the log does not name it."),
    gpu: str = typer.Option(
        None, "--gpu", help="The GPU (catalogue name, or text like '2x A100 80GB')."
    ),
    command: str = typer.Option(
        None, "--command", help="The original 'vllm serve …' command line."
    ),
    p99_tokens: opt.P99Tokens = None,
    concurrency: opt.Concurrency = None,
    shared_prefix: opt.SharedPrefix = None,
    headroom_gib: opt.HeadroomGib = 0.0,
    expect_cotenant: bool = typer.Option(
        False, "--expect-cotenant", help="Another process is meant to share the GPU."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Diagnose a vLLM out-of-memory failure from its log, or lint a command before launch.

    Exit codes, diagnosing: 0 a cause was found, 3 no out-of-memory failure in the log (a failure that is not memory is named, with what to do), 4 the log does not settle the cause (the doctor says what would), 2 bad input.

    Linting (--command): 0 no problems (tips alone do not fail), 1 problems found, 2 bad input (a misspelt flag, an unknown GPU).
    """  # noqa: E501
    from oomguard.doctor.diagnose import diagnose_file
    from oomguard.doctor.lint import lint_command
    from oomguard.doctor.render import render_diagnosis, render_findings
    from oomguard.doctor.situation import Context
    from oomguard.workload import stated_workload

    tokens = list(items or []) + list(ctx.args)
    logfile: str | None = None
    if tokens and Path(tokens[0]).name not in _LAUNCHERS:
        logfile, tokens = tokens[0], tokens[1:]
    if tokens:
        if command:
            raise BadInput(
                "give the command either with --command or after --, not both", "drop one of them"
            )
        command = " ".join(_quote(t) for t in tokens)
    console = Console(highlight=False)
    if logfile is None:
        if not command:
            raise BadInput(
                "nothing to examine",
                "pass a log file (or - for stdin), or --command 'vllm serve …'",
            )
        workload = stated_workload(p99_tokens, concurrency, shared_prefix, headroom_gib)
        report = lint_command(command, gpu=gpu, workload=workload)
        if as_json:
            typer.echo(json.dumps({**report.to_dict(), "command": command}, indent=1))
        else:
            if report.findings:
                render_findings(console, list(report.findings), "Before launch")
            console.print(lint_verdict(len(report.problems), len(report.findings)))
            for note in report.notes:
                console.print(f"note: {note}", soft_wrap=True)
        raise typer.Exit(1 if report.problems else 0)
    context = Context(model=model, gpu=gpu, command=command, expect_cotenant=expect_cotenant)
    diagnosis = diagnose_file(logfile, context)
    if as_json:
        typer.echo(json.dumps(diagnosis.to_dict(), indent=1, default=str))
    else:
        render_diagnosis(console, diagnosis)
    raise typer.Exit(exit_code(diagnosis))


def lint_verdict(problems: int, findings: int) -> str:
    """The lint's closing line: problems (exit 1), tips only (exit 0), or nothing found."""
    if problems:
        return f"{problems} problem{'s' * (problems != 1)} found in this command."
    if findings:
        return f"{findings} tip{'s' * (findings != 1)}, no problem: the command can run as it is."
    return "No problems found in this command."


def exit_code(diagnosis: Any) -> int:
    """0 a cause was found, 3 no out-of-memory failure, 4 the doctor abstained."""
    if not diagnosis.oom_found:
        return EXIT_NO_OOM
    return EXIT_ABSTAINED if diagnosis.abstained else 0


def calibrate_command(
    logfiles: list[str] = typer.Argument(..., help="vLLM start-up logs (V0 or V1 format)."),
    gpu: str = typer.Option(None, "--gpu", help="GPU name, when the log does not state it."),
    vllm_version: str = typer.Option(
        None, "--vllm-version", help="vLLM version, when the log does not state it."
    ),
    model: str = typer.Option(None, "--model", help="Model, when the log does not name it."),
    tensor_parallel_size: int = typer.Option(None, "--tensor-parallel-size", "-tp"),
    pipeline_parallel_size: int = typer.Option(
        None, "--pipeline-parallel-size", "-pp", help="PP, when the log does not state it."
    ),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Store the memory figures of real start-up logs; the planner uses them next time."""
    from oomguard.calibration import Store, record_logs

    store = Store()
    stored, skipped = record_logs(
        logfiles,
        store=store,
        gpu=gpu,
        vllm_version=vllm_version,
        model=model,
        tp=tensor_parallel_size,
        pp=pipeline_parallel_size,
    )
    if as_json:
        payload: dict[str, Any] = {
            "store": str(store.path),
            "stored": [
                {
                    "key": o.key,
                    **{
                        k: getattr(o, k)
                        for k in (
                            "source",
                            "gpu",
                            "gpu_raw",
                            "tp",
                            "pp",
                            "weights_gib",
                            "activation_gib",
                            "non_torch_gib",
                            "cudagraph_gib",
                        )
                    },
                    "settings": o.settings(),
                    "user_set": list(o.user_set),
                }
                for o in stored
            ],
            "skipped": skipped,
        }
        typer.echo(json.dumps(payload, indent=1))
    else:
        console = Console(highlight=False)
        for obs in stored:
            terms = ", ".join(
                f"{name} {value:.2f} GiB"
                for name, value in (
                    ("weights", obs.weights_gib),
                    ("activation", obs.activation_gib),
                    ("non-torch", obs.non_torch_gib),
                    ("CUDA graphs", obs.cudagraph_gib),
                )
                if value is not None
            )
            settings = ", ".join(
                f"{name}={value}" for name, value in obs.settings().items() if value is not None
            )
            console.print(
                f"stored {obs.key}: {terms}  ({obs.source})"
                + (f"\n  measured with {settings}" if settings else ""),
                soft_wrap=True,
            )
        for line in skipped:
            console.print(f"skipped {line}", soft_wrap=True)
        console.print(f"store: {store.path}")
    raise typer.Exit(0 if stored else 3)


def _quote(token: str) -> str:
    import shlex

    return shlex.quote(token)


def register(app: typer.Typer) -> None:
    """Add ``doctor`` and ``calibrate`` to the main app."""
    app.command("doctor", context_settings=_CONTEXT)(doctor_command)
    app.command("calibrate")(calibrate_command)
