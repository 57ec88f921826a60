"""``oomguard watch``: monitor running vLLM servers against their plan and alert before they fail.

Exit codes: with ``--once``, 0 healthy, 1 an alert is firing, 2 bad input; a continuous watch
ends with 0 (or 1 when an alert was firing at the end of ``--duration``), 2 when no target
is left to watch.
"""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from oomguard.errors import BadInput

if TYPE_CHECKING:
    from oomguard.watch.plan_figures import PlanFigures
    from oomguard.watch.prefix import RecordKey
    from oomguard.watch.sampling import Target

_PLAN_FLAGS = (
    ("gpu", "--gpu"), ("gpu_count", "--gpu-count"), ("gpu_memory_gib", "--gpu-memory-gib"),
    ("tensor_parallel_size", "--tensor-parallel-size"),
    ("pipeline_parallel_size", "--pipeline-parallel-size"),
    ("gpu_memory_utilization", "--gpu-memory-utilization"), ("max_model_len", "--max-model-len"),
    ("max_num_seqs", "--max-num-seqs"), ("max_num_batched_tokens", "--max-num-batched-tokens"),
    ("kv_cache_dtype", "--kv-cache-dtype"), ("quantization", "--quantization"),
    ("dtype", "--dtype"), ("kv_cache_memory_bytes", "--kv-cache-memory-bytes"),
    ("block_size", "--block-size"), ("vllm_version", "--vllm-version"),
)  # fmt: skip


def _plan_args(
    model: str, values: dict[str, object], enforce_eager: bool | None, offline: bool
) -> list[str]:
    args = [model]
    for name, flag in _PLAN_FLAGS:
        if values.get(name) is not None:
            args += [flag, str(values[name])]
    if enforce_eager is not None:
        args.append("--enforce-eager" if enforce_eager else "--no-enforce-eager")
    if offline:
        args.append("--offline")
    return args


def _positive(value: float | None, flag: str) -> None:
    if value is not None and not value > 0:
        raise BadInput(f"{flag} {value:g} must be positive", f"pass a positive number to {flag}")


Urls = Annotated[
    list[str] | None,
    typer.Argument(help="vLLM servers: http://host:port (or host:port)."),
]
PlanFiles = Annotated[
    list[Path] | None,
    typer.Option(
        "--plan", help="Plan file (oomguard plan … --json); once for all servers or once per URL."
    ),
]
Model = Annotated[
    str | None,
    typer.Option("--model", help="Plan on the spot for this model (with the plan flags below)."),
]
Pids = Annotated[
    list[int] | None,
    typer.Option(
        "--pid", help="The engine's PID (once per URL, in order); alone: watch that process."
    ),
]
Interval = Annotated[float, typer.Option("--interval", help="Seconds between samples.")]
Once = Annotated[
    bool, typer.Option("--once", help="Check once and exit: 0 healthy, 1 firing, 2 bad input.")
]
JsonOutput = Annotated[bool, typer.Option("--json", help="Alert events as JSON lines on stdout.")]
Webhooks = Annotated[
    list[str] | None,
    typer.Option(
        "--webhook", help="POST alerts here (Alertmanager JSON; …/api/v2/alerts: an Alertmanager)."
    ),
]
Port = Annotated[
    int | None,
    typer.Option("--port", help="Serve /metrics (Prometheus), /status and /healthz on this port."),
]
Host = Annotated[str, typer.Option("--host", help="Address for --port.")]
Duration = Annotated[float | None, typer.Option("--duration", help="Stop after this many seconds.")]
MinDuration = Annotated[
    float | None,
    typer.Option(
        "--min-duration",
        help=(
            "Seconds a condition must hold before it fires (every alert; "
            "default: each alert's own)."
        ),
    ),
]
PreemptionWindow = Annotated[
    float, typer.Option("--preemption-window", help="Seconds over which preemptions are counted.")
]
FreeMarginGib = Annotated[
    float,
    typer.Option("--free-margin-gib", help="Alert when a GPU has less free memory than this."),
]
LeakWindow = Annotated[
    float, typer.Option("--leak-window", help="Seconds the leak slope is measured over.")
]
LeakRate = Annotated[
    float, typer.Option("--leak-rate", help="Growth (MiB/min) that counts as a leak.")
]
LeakSettle = Annotated[
    float,
    typer.Option(
        "--leak-settle", help="Seconds after the pool is allocated before leaks are measured."
    ),
]
Record = Annotated[
    bool,
    typer.Option(
        "--record/--no-record",
        help="Store each server's prefix-cache hit rate in the calibration store (not --once).",
    ),
]
# the plan flags (with --model)
Gpu = Annotated[str | None, typer.Option("--gpu", help="Plan flag (with --model).")]
GpuCount = Annotated[int | None, typer.Option("--gpu-count", help="Plan flag.")]
GpuMemoryGib = Annotated[float | None, typer.Option("--gpu-memory-gib", help="Plan flag.")]
TensorParallelSize = Annotated[
    int | None, typer.Option("--tensor-parallel-size", "-tp", help="Plan flag.")
]
PipelineParallelSize = Annotated[
    int | None, typer.Option("--pipeline-parallel-size", "-pp", help="Plan flag.")
]
GpuMemoryUtilization = Annotated[
    float | None, typer.Option("--gpu-memory-utilization", help="Plan flag.")
]
MaxModelLen = Annotated[str | None, typer.Option("--max-model-len", help="Plan flag.")]
MaxNumSeqs = Annotated[int | None, typer.Option("--max-num-seqs", help="Plan flag.")]
MaxNumBatchedTokens = Annotated[
    str | None, typer.Option("--max-num-batched-tokens", help="Plan flag.")
]
KvCacheDtype = Annotated[str | None, typer.Option("--kv-cache-dtype", help="Plan flag.")]
Quantization = Annotated[str | None, typer.Option("--quantization", "-q", help="Plan flag.")]
Dtype = Annotated[str | None, typer.Option("--dtype", help="Plan flag.")]
EnforceEager = Annotated[
    bool | None, typer.Option("--enforce-eager/--no-enforce-eager", help="Plan flag.")
]
KvCacheMemoryBytes = Annotated[
    str | None, typer.Option("--kv-cache-memory-bytes", help="Plan flag.")
]
BlockSize = Annotated[int | None, typer.Option("--block-size", help="Plan flag.")]
VllmVersion = Annotated[str | None, typer.Option("--vllm-version", help="Plan flag.")]
Offline = Annotated[bool, typer.Option("--offline", help="Plan flag: never contact the hub.")]


def watch_command(
    urls: Urls = None,
    plan: PlanFiles = None,
    model: Model = None,
    pid: Pids = None,
    interval: Interval = 1.0,
    once: Once = False,
    json_output: JsonOutput = False,
    webhook: Webhooks = None,
    port: Port = None,
    host: Host = "0.0.0.0",
    duration: Duration = None,
    min_duration: MinDuration = None,
    preemption_window: PreemptionWindow = 60.0,
    free_margin_gib: FreeMarginGib = 1.0,
    leak_window: LeakWindow = 300.0,
    leak_rate_mib_per_min: LeakRate = 10.0,
    leak_settle: LeakSettle = 60.0,
    record: Record = True,
    gpu: Gpu = None,
    gpu_count: GpuCount = None,
    gpu_memory_gib: GpuMemoryGib = None,
    tensor_parallel_size: TensorParallelSize = None,
    pipeline_parallel_size: PipelineParallelSize = None,
    gpu_memory_utilization: GpuMemoryUtilization = None,
    max_model_len: MaxModelLen = None,
    max_num_seqs: MaxNumSeqs = None,
    max_num_batched_tokens: MaxNumBatchedTokens = None,
    kv_cache_dtype: KvCacheDtype = None,
    quantization: Quantization = None,
    dtype: Dtype = None,
    enforce_eager: EnforceEager = None,
    kv_cache_memory_bytes: KvCacheMemoryBytes = None,
    block_size: BlockSize = None,
    vllm_version: VllmVersion = None,
    offline: Offline = False,
) -> None:
    """Watch vLLM servers against their plan: KV usage, preemptions, GPU memory, leaks; alert."""
    urls, plan, pid, webhook = urls or [], plan or [], pid or [], webhook or []
    for flag, value in (
        ("--interval", interval),
        ("--duration", duration),
        ("--leak-window", leak_window),
        ("--leak-rate", leak_rate_mib_per_min),
        ("--preemption-window", preemption_window),
    ):
        _positive(value, flag)
    if min_duration is not None and min_duration < 0:
        raise BadInput(f"--min-duration {min_duration:g} is negative", "pass 0 or more seconds")
    if leak_settle < 0 or free_margin_gib < 0:
        raise BadInput("--leak-settle and --free-margin-gib cannot be negative", "pass 0 or more")
    _check_targets(urls, pid, plan, model, webhook)
    plan_values = {name: value for name, value in locals().items() if name in dict(_PLAN_FLAGS)}
    given = [dict(_PLAN_FLAGS)[n] for n, v in plan_values.items() if v is not None]
    if given and not model:
        raise BadInput(
            f"{given[0]} is a plan flag, but no --model was given",
            "add --model MODEL (or pass a plan file with --plan)",
        )
    targets = _targets(urls, pid)
    plan_args = _plan_args(model, plan_values, enforce_eager, offline) if model else []
    plans = _plans(len(targets), plan, model, plan_args)
    settings = RunSettings(
        interval_s=interval,
        once=once,
        json_output=json_output,
        webhooks=webhook,
        port=port,
        host=host,
        duration_s=duration,
        min_duration_s=min_duration,
        free_margin_bytes=free_margin_gib * 2**30,
        preemption_window_s=preemption_window,
        leak_window_s=leak_window,
        leak_rate_bytes_per_s=leak_rate_mib_per_min * 2**20 / 60,
        leak_settle_s=leak_settle,
        record=record and not once,
        record_key=_record_key(gpu, vllm_version, tensor_parallel_size, pipeline_parallel_size),
    )
    raise SystemExit(asyncio.run(_run(targets, plans, settings)))


def _check_targets(
    urls: list[str], pid: list[int], plan: list[Path], model: str | None, webhook: list[str]
) -> None:
    """Something to watch, one source of plans, and webhooks that are http(s) URLs."""
    if not urls and not pid:
        raise BadInput(
            "nothing to watch", "pass a vLLM server URL (e.g. http://127.0.0.1:8000) or --pid PID"
        )
    if plan and model:
        raise BadInput(
            "both --plan and --model given", "pass one: a plan file, or --model with plan flags"
        )
    for hook in webhook:
        if not hook.startswith(("http://", "https://")):
            raise BadInput(
                f"--webhook {hook!r} is not an http(s) URL",
                "pass e.g. http://alertmanager:9093/api/v2/alerts",
            )


@dataclass(frozen=True)
class RunSettings:
    """The options of one watch run, checked."""

    interval_s: float
    once: bool
    json_output: bool
    webhooks: list[str]
    port: int | None
    host: str
    duration_s: float | None
    min_duration_s: float | None
    free_margin_bytes: float
    preemption_window_s: float
    leak_window_s: float
    leak_rate_bytes_per_s: float
    leak_settle_s: float
    record: bool = False
    record_key: RecordKey | None = None


def _record_key(gpu: str | None, version: str | None, tp: int | None, pp: int | None) -> RecordKey:
    from oomguard.watch.prefix import RecordKey

    return RecordKey(gpu=gpu, vllm_version=version, tp=tp or 1, pp=pp or 1)


def _plans(
    count: int, plan_files: list[Path], model: str | None, plan_args: list[str]
) -> list[PlanFigures | None]:
    """One plan (or None) per target: a plan given once applies to every target."""
    from oomguard.watch.plan_figures import load_plan_file, plan_from_flags

    if model:
        return [plan_from_flags(plan_args)] * count
    if not plan_files:
        return [None] * count
    if len(plan_files) not in (1, count):
        raise BadInput(
            f"{len(plan_files)} --plan files for {count} servers",
            "pass one plan for all servers, or one per URL in the same order",
        )
    loaded: list[PlanFigures | None] = [load_plan_file(p) for p in plan_files]
    return loaded * count if len(loaded) == 1 else loaded


def _targets(urls: list[str], pids: list[int]) -> list[Target]:
    from oomguard.watch.sampling import Target

    if urls and pids and len(pids) != len(urls):
        raise BadInput(
            f"{len(pids)} --pid for {len(urls)} servers",
            "pass one --pid per URL, in the same order (or none: found from the port)",
        )
    if not urls:
        targets = [Target.for_pid(p) for p in pids]
    else:
        targets = [Target.for_url(u, pids[i] if pids else None) for i, u in enumerate(urls)]
    seen = set()
    for t in targets:
        if t.name in seen:
            raise BadInput(f"{t.name} given twice", "pass each server once")
        seen.add(t.name)
    return targets


async def _run(targets: list[Target], plans: list[PlanFigures | None], s: RunSettings) -> int:
    import psutil
    from rich.console import Console

    from oomguard.watch.alerts import AlertTracker
    from oomguard.watch.evaluate import Evaluator, LeakSettings
    from oomguard.watch.runner import Outputs, Watch
    from oomguard.watch.sinks import JsonLinesSink, WebhookSink

    leak = LeakSettings(
        window_s=s.leak_window_s,
        min_rate_bytes_per_s=s.leak_rate_bytes_per_s,
        settle_s=s.leak_settle_s,
    )
    evaluator = Evaluator(
        {t.name: p for t, p in zip(targets, plans, strict=True)},
        leak,
        free_margin_bytes=s.free_margin_bytes,
        available_host_bytes=float(psutil.virtual_memory().available),
        preemption_window_s=s.preemption_window_s,
    )
    tracker = AlertTracker(0.0 if s.once else s.min_duration_s)
    own_url = f"http://{s.host}:{s.port}/status" if s.port else ""
    console = Console(stderr=s.json_output, highlight=False)
    outputs = Outputs(
        json=JsonLinesSink() if s.json_output else None,
        webhooks=[WebhookSink(u, own_url=own_url) for u in s.webhooks],
        console=console,
        live=not s.json_output and not s.once and sys.stdout.isatty(),
    )
    watch = Watch(targets, evaluator, tracker, outputs, s.interval_s, port=s.port, host=s.host)
    if s.record and s.record_key is not None:
        from oomguard.watch.prefix import PrefixCacheRecorder

        watch.recorder = PrefixCacheRecorder(
            s.record_key, {t.name: p for t, p in zip(targets, plans, strict=True)}
        )
    try:
        return await watch.run(once=s.once, duration_s=s.duration_s)
    except BrokenPipeError:  # whoever read the JSON lines went away: nothing left to do
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - no flush error at exit
        return 0


def register(app: typer.Typer) -> None:
    """Add ``oomguard watch`` to the main app."""
    app.command("watch")(watch_command)
