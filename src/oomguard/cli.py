"""The ``oomguard`` command: thin. Each face registers its own commands.

Only the face a command belongs to is imported (``oomguard plan`` never loads the gateway's
aiohttp stack); ``--help`` and unknown commands register them all.
"""

from __future__ import annotations

import importlib
import sys

import typer
from rich.console import Console
from rich.markup import escape

from oomguard.errors import EXIT_BAD_INPUT, MissingExtra, OomguardError

# command name → module whose ``register(app)`` adds it
FACES: dict[str, str] = {
    "plan": "oomguard.plan.cli",
    "doctor": "oomguard.doctor.cli",
    "calibrate": "oomguard.doctor.cli",
    "guard": "oomguard.guard.cli",
    "serve": "oomguard.serve.cli",
    "bench": "oomguard.bench.cli",
    "models": "oomguard.facts.cli",
    "gpus": "oomguard.facts.cli",
    "watch": "oomguard.watch.cli",
}

# command name → the optional extra (pyproject.toml) its libraries come from
FACE_EXTRA: dict[str, str] = {
    "guard": "guard",
    "serve": "serve",
    "bench": "bench",
    "watch": "watch",
}
# extra → the modules it installs (import names); a missing one names the extra to install
_GUARD_MODULES = frozenset(
    {"aiohttp", "redis", "uvloop", "prometheus_client", "pydantic", "tokenizers", "jinja2"}
)
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "serve": _GUARD_MODULES,  # --guard-port starts the guard
    "guard": _GUARD_MODULES,
    "bench": frozenset({"aiohttp", "matplotlib", "tokenizers", "prometheus_client"}),
    "watch": frozenset({"aiohttp", "prometheus_client"}),
}

_err = Console(stderr=True, highlight=False)


def build_app(command: str | None = None) -> typer.Typer:
    """The CLI app with the faces ``command`` needs (all of them when None or unknown)."""
    app = typer.Typer(
        name="oomguard",
        help="Keep vLLM out of out-of-memory failures: plan, serve, bench, guard, watch, doctor.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root() -> None:
        """Keep vLLM out of out-of-memory failures."""

    @app.command("version")
    def version() -> None:
        """Print oomguard's version."""
        from oomguard import __version__

        typer.echo(__version__)

    modules = [FACES[command]] if command in FACES else list(dict.fromkeys(FACES.values()))
    for module in modules:
        importlib.import_module(module).register(app)
    return app


def _command_of(args: list[str]) -> str | None:
    """The subcommand named in ``args`` (its first word that is not an option)."""
    for arg in args:
        if not arg.startswith("-"):
            return arg
    return None


def missing_extra(command: str | None, exc: ImportError) -> MissingExtra | None:
    """The extra to install when ``exc`` is a library of ``command``'s extra that is missing."""
    module = (exc.name or "").split(".")[0]
    extra = FACE_EXTRA.get(command or "")
    if extra is not None and module in EXTRA_MODULES[extra]:
        return MissingExtra(command or "", extra, module)
    return None


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors print one line and exit with their code, never a traceback."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    if debug:
        args = [a for a in args if a != "--debug"]
    command = _command_of(args)
    try:
        try:
            app = build_app(command)
            rv = app(args=args, prog_name="oomguard", standalone_mode=False)
        except ImportError as exc:
            missing = missing_extra(command, exc)
            if missing is None:
                raise
            raise missing from None
        if isinstance(rv, int):
            return rv
    except OomguardError as exc:
        if debug:
            raise
        _err.print(f"[bold red]error:[/] {escape(exc.one_line())}", soft_wrap=True)
        return exc.exit_code
    except SystemExit as exc:  # raised inside commands with their exit code
        return int(exc.code or 0)
    except (KeyboardInterrupt, typer.Abort):
        return 130
    except typer.Exit as exc:  # raised inside commands; not a SystemExit outside standalone mode
        return exc.exit_code
    except typer.TyperException as exc:  # the argument parser rejected the input
        show = getattr(exc, "show", None)  # usage errors print the usage line with the message
        if show is not None:
            show()
        else:
            _err.print(f"[bold red]error:[/] {escape(exc.format_message())}", soft_wrap=True)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
