"""CLI registration for the guard face: ``oomguard guard``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

# the options of `oomguard guard` (each overrides the same key of --config)
BackendOption = Annotated[
    list[str] | None,
    typer.Option("--backend", help="vLLM server base URL (repeatable)."),
]
PortOption = Annotated[int | None, typer.Option(help="Port to listen on (default 8100).")]
HostOption = Annotated[str | None, typer.Option(help="Address to listen on (default 127.0.0.1).")]
ConfigOption = Annotated[
    Path | None, typer.Option("--config", help="YAML file with guard settings.")
]
HighWatermarkOption = Annotated[
    float | None, typer.Option(help="Stop admitting at this KV fraction (0.90).")
]
LowWatermarkOption = Annotated[
    float | None, typer.Option(help="Resume admitting below this KV fraction (0.80).")
]
ProjectedWatermarkOption = Annotated[
    float | None,
    typer.Option(help="Ceiling of the projected KV peak of tracked requests (1.0)."),
]
MaxQueueOption = Annotated[
    int | None, typer.Option(help="Most requests waiting in the queue (256).")
]
QueueTimeoutOption = Annotated[
    float | None, typer.Option(help="Seconds a request may wait in the queue (60).")
]
TokenizerOption = Annotated[
    str | None,
    typer.Option(
        help="'backend' (exact: the model's tokenizer in-process where its files are "
        "here, else the backend's /tokenize) or 'estimate' (no tokenizer)."
    ),
]
TrackProgressOption = Annotated[
    str | None,
    typer.Option(
        help="Read in-flight progress for projected-peak admission: 'auto' (default: "
        "under KV pressure), 'always' or 'off'."
    ),
]
RedisUrlOption = Annotated[
    str | None,
    typer.Option(
        help="Share admission with other guard replicas through this Redis "
        "(redis://HOST:6379/0 or unix:///PATH)."
    ),
]
WorkersOption = Annotated[
    int | None,
    typer.Option(help="Worker processes on the one port (needs --redis-url) (1)."),
]
ReplicasOption = Annotated[
    int | None,
    typer.Option(
        help="Replicas the static share divides by while Redis is away "
        "(default: those last seen in Redis)."
    ),
]
RestartWaitOption = Annotated[
    float | None,
    typer.Option(
        help="Seconds an accepted request waits for a failed backend (default: twice "
        "the longest restart seen, at least 900)."
    ),
]


def guard_command(
    backend: BackendOption = None,
    port: PortOption = None,
    host: HostOption = None,
    config: ConfigOption = None,
    high_watermark: HighWatermarkOption = None,
    low_watermark: LowWatermarkOption = None,
    projected_watermark: ProjectedWatermarkOption = None,
    max_queue: MaxQueueOption = None,
    queue_timeout: QueueTimeoutOption = None,
    tokenizer: TokenizerOption = None,
    track_progress: TrackProgressOption = None,
    redis_url: RedisUrlOption = None,
    workers: WorkersOption = None,
    replicas: ReplicasOption = None,
    restart_wait: RestartWaitOption = None,
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


def register(app: typer.Typer) -> None:
    """Add ``oomguard guard`` to the main app."""
    app.command("guard")(guard_command)
