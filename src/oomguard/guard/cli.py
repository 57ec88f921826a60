"""CLI registration for the guard face: ``oomguard guard``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


def register(app: typer.Typer) -> None:
    """Add ``oomguard guard`` to the main app."""

    @app.command("guard")
    def guard(
        backend: Annotated[
            list[str] | None,
            typer.Option("--backend", help="vLLM server base URL (repeatable)."),
        ] = None,
        port: Annotated[int | None, typer.Option(help="Port to listen on (default 8100).")] = None,
        host: Annotated[
            str | None, typer.Option(help="Address to listen on (default 127.0.0.1).")
        ] = None,
        config: Annotated[
            Path | None, typer.Option("--config", help="YAML file with guard settings.")
        ] = None,
        high_watermark: Annotated[
            float | None, typer.Option(help="Stop admitting at this KV fraction (0.90).")
        ] = None,
        low_watermark: Annotated[
            float | None, typer.Option(help="Resume admitting below this KV fraction (0.80).")
        ] = None,
        projected_watermark: Annotated[
            float | None,
            typer.Option(help="Ceiling of the projected KV peak of tracked requests (1.0)."),
        ] = None,
        max_queue: Annotated[
            int | None, typer.Option(help="Most requests waiting in the queue (256).")
        ] = None,
        queue_timeout: Annotated[
            float | None, typer.Option(help="Seconds a request may wait in the queue (60).")
        ] = None,
        tokenizer: Annotated[
            str | None,
            typer.Option(
                help="'backend' (exact: the model's tokenizer in-process where its files are "
                "here, else the backend's /tokenize) or 'estimate' (no tokenizer)."
            ),
        ] = None,
        track_progress: Annotated[
            str | None,
            typer.Option(
                help="Read in-flight progress for projected-peak admission: 'auto' (default: "
                "under KV pressure), 'always' or 'off'."
            ),
        ] = None,
        redis_url: Annotated[
            str | None,
            typer.Option(
                help="Share admission with other guard replicas through this Redis "
                "(redis://HOST:6379/0 or unix:///PATH)."
            ),
        ] = None,
        workers: Annotated[
            int | None,
            typer.Option(help="Worker processes on the one port (needs --redis-url) (1)."),
        ] = None,
        replicas: Annotated[
            int | None,
            typer.Option(
                help="Replicas the static share divides by while Redis is away "
                "(default: those last seen in Redis)."
            ),
        ] = None,
        restart_wait: Annotated[
            float | None,
            typer.Option(
                help="Seconds an accepted request waits for a failed backend (default: twice "
                "the longest restart seen, at least 900)."
            ),
        ] = None,
    ) -> None:
        """Memory-aware admission gateway in front of vLLM servers (OpenAI-compatible)."""
        from oomguard.guard.app import run_guard
        from oomguard.guard.config import load_config

        overrides: dict[str, Any] = {
            "backends": backend,
            "port": port,
            "host": host,
            "high_watermark": high_watermark,
            "low_watermark": low_watermark,
            "projected_watermark": projected_watermark,
            "max_queue_requests": max_queue,
            "queue_timeout_s": queue_timeout,
            "tokenizer": tokenizer,
            "track_progress": track_progress,
            "redis_url": redis_url,
            "workers": workers,
            "replicas": replicas,
            "restart_wait_s": restart_wait,
        }
        run_guard(load_config(config, overrides))
