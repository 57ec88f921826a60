"""``oomguard models`` and ``oomguard gpus``: what the built-in catalogues know."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console
from rich.table import Table


def _print_rows(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A rich table on a terminal; tab-separated lines, never cut, when piped (``| cat``, grep)."""
    console = Console()
    if not console.is_terminal:
        for line in [header, *rows]:
            typer.echo("\t".join(line))
        return
    table = Table(title=title)
    for i, col in enumerate(header):
        # names are what people copy: wrap them rather than cutting them with an ellipsis
        table.add_column(col, overflow="fold", no_wrap=i > 0)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def models_command(
    contains: str = typer.Argument("", help="Only names containing this text."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """List the built-in model catalogue (offline): parameters, context, sources."""
    from oomguard.facts.catalogue import list_entries

    needle = contains.lower()
    rows: list[dict[str, Any]] = []
    for entry in list_entries():
        if needle and not any(needle in n.lower() for n in entry.names):
            continue
        spec = entry.spec()
        rows.append(
            {
                "id": entry.id,
                "architecture": spec.architecture,
                "params_b": round(spec.total_params / 1e9, 3),
                "published_params_b": (
                    round(entry.published_params / 1e9, 3) if entry.published_params else None
                ),
                "max_model_len": spec.derived_max_model_len,
                "quantization": spec.quant.method,
                "config_source": entry.config_source,
                "base_model": entry.base_model or None,
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    _print_rows(
        f"{len(rows)} catalogue models",
        ["model", "architecture", "params (B)", "context", "quant"],
        [
            [
                str(r["id"]),
                str(r["architecture"]),
                f"{r['params_b']:.2f}",
                f"{r['max_model_len']:,}",
                str(r["quantization"] or "-"),
            ]
            for r in rows
        ],
    )


def gpus_command(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List the GPU catalogue: the total memory CUDA reports for each card, and its source."""
    from oomguard.facts.gpus import list_gpus

    items = list_gpus()
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "name": g.name,
                        "total_gib": round(g.total_gib, 2),
                        "marketing_gb": g.marketing_gb,
                        "vendor": g.vendor,
                        "source": g.source,
                    }
                    for g in items
                ],
                indent=2,
            )
        )
        return
    _print_rows(
        f"{len(items)} GPUs (total as CUDA reports it)",
        ["GPU", "on the box", "CUDA total (GiB)", "total is"],
        [
            [
                g.name,
                f"{g.marketing_gb:g} GB",
                f"{g.total_gib:.2f}",
                g.source.split(":", 1)[0] if ":" in g.source else "catalogue",
            ]
            for g in items
        ],
    )


def register(app: typer.Typer) -> None:
    """Add the catalogue listing commands to the main app."""
    app.command("models")(models_command)
    app.command("gpus")(gpus_command)
