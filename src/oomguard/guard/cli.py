"""CLI registration for the guard face (placeholder until the face lands)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this face's commands to the main app."""
    return None
