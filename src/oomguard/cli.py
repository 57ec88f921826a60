"""The ``oomguard`` command: thin. Each face registers its own commands."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from oomguard.errors import OomguardError

app = typer.Typer(
    name="oomguard",
    help="Keep vLLM out of out-of-memory failures: plan, doctor, guard, calibrate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_err = Console(stderr=True, highlight=False)


def _register_faces() -> None:
    from oomguard.doctor.cli import register as register_doctor
    from oomguard.facts.cli import register as register_facts
    from oomguard.guard.cli import register as register_guard
    from oomguard.plan.cli import register as register_plan

    register_plan(app)
    register_doctor(app)
    register_guard(app)
    register_facts(app)


@app.command("version")
def version() -> None:
    """Print oomguard's version."""
    from oomguard import __version__

    typer.echo(__version__)


_register_faces()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors print one line and exit with their code, never a traceback."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    if debug:
        args = [a for a in args if a != "--debug"]
    try:
        rv = app(args=args, prog_name="oomguard", standalone_mode=False)
        if isinstance(rv, int):
            return rv
    except OomguardError as exc:
        if debug:
            raise
        _err.print(f"[bold red]error:[/] {exc.one_line()}", soft_wrap=True)
        return exc.exit_code
    except SystemExit as exc:  # typer.Exit raised inside commands
        return int(exc.code or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # usage errors from the argument parser, and its exits
        name = type(exc).__name__
        if name == "Exit":
            return int(getattr(exc, "exit_code", 0))
        if name == "Abort":
            return 130
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            return 2
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
