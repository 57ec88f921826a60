"""``oomguard serve``: thin shell over :class:`oomguard.serve.session.ServeSession`.

Two forms::

    oomguard serve MODEL [plan flags] [workload flags] [-- extra vLLM flags]
    oomguard serve [options] -- vllm serve MODEL --flags…
    oomguard serve MODEL.gguf [--engine llama.cpp] [workload flags] [-- extra llama-server flags]
    oomguard serve [options] -- llama-server -m MODEL.gguf --flags…

Exit codes: 0 stopped cleanly (SIGINT/SIGTERM, or ``--dry-run``), 1 could not be made to
start (or kept crashing), 2 bad input, 5 no vLLM or llama-server, 6 the engine failed
(docs/exit-codes.md).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from oomguard import cli_options as opt
from oomguard.errors import BadInput

_CONTEXT = {"allow_extra_args": True, "allow_interspersed_args": True}
# the first word of a pasted command (``vllm serve``, ``python -m …``, ``VAR=x vllm …``)
_COMMAND_START = re.compile(
    r"(?:.*/)?(?:vllm|llama-server|python\d*(?:\.\d+)?|env|docker|podman|nerdctl)$|\w+=.*"
)


# serve's own options (the vLLM and workload flags come from oomguard.cli_options)
ModelArg = Annotated[
    str | None,
    typer.Argument(help="Model to plan for and serve (or, after --, a pasted vllm serve command)."),
]
Host = Annotated[str | None, typer.Option("--host", help="Address the engine binds (MODEL form).")]
Port = Annotated[
    int | None, typer.Option("--port", help="Port of the engine (MODEL form; default 8000).")
]
MaxAttempts = Annotated[int, typer.Option("--max-attempts", help="Most launches to start it.")]
Probe = Annotated[
    bool | None,
    typer.Option("--probe/--no-probe", help="Probe once ready (default: on with a workload)."),
]
Record = Annotated[
    bool,
    typer.Option("--record/--no-record", help="Record the observed terms for the next plan."),
]
NoCalibration = Annotated[
    bool, typer.Option("--no-calibration", help="Predict without the calibration store.")
]
AllowPrecisionChange = Annotated[
    bool,
    typer.Option(
        "--allow-precision-change",
        help="Let a heal change --quantization, --kv-cache-dtype or --dtype.",
    ),
]
GuardPort = Annotated[
    int | None,
    typer.Option("--guard-port", help="Start oomguard guard on this port in front of the engine."),
]
MaxRestarts = Annotated[int, typer.Option("--max-restarts", help="Crash restarts in the window.")]
RestartWindow = Annotated[float, typer.Option("--restart-window", help="Seconds.")]
StartupTimeout = Annotated[float, typer.Option("--startup-timeout", help="Seconds.")]
LogFile = Annotated[
    Path | None,
    typer.Option("--log-file", help="Write the engine's log here instead of the terminal."),
]
LogDir = Annotated[Path | None, typer.Option("--log-dir", help="Where each launch's log is kept.")]
VllmPython = Annotated[str | None, typer.Option("--vllm-python", help="Python that has vLLM.")]
Offline = Annotated[bool, typer.Option("--offline", help="Never contact the Hugging Face hub.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the command and prediction.")]
JsonOutput = Annotated[bool, typer.Option("--json", help="One JSON event per line.")]
Engine = Annotated[
    str,
    typer.Option(
        "--engine",
        help="auto (llama.cpp for a .gguf or a llama-server command), vllm or llama.cpp.",
    ),
]
Gguf = Annotated[
    Path | None, typer.Option("--gguf", help="The GGUF llama.cpp serves (beside a model id).")
]
LlamaServer = Annotated[str | None, typer.Option("--llama-server", help="The llama-server binary.")]

# the MODEL form's flags that go to the planner
_PLAN_FLAGS = (
    "gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "kv_cache_dtype", "kv_cache_memory_bytes", "quantization", "dtype", "tensor_parallel_size",
    "enforce_eager", "speculative_config", "spec_method", "spec_model", "spec_tokens",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype",
    "fully_sharded_loras", "limit_mm_per_prompt", "skip_mm_profiling", "mm_encoder_tp_mode",
    "mm_processor_cache_gb", "mm_processor_cache_type",
)  # fmt: skip


def serve_command(
    ctx: typer.Context,
    model: ModelArg = None,
    p99_tokens: opt.P99Tokens = None,
    concurrency: opt.Concurrency = None,
    gpu_memory_utilization: opt.GpuMemoryUtilization = None,
    max_model_len: opt.MaxModelLen = None,
    max_num_seqs: opt.MaxNumSeqs = None,
    max_num_batched_tokens: opt.MaxNumBatchedTokens = None,
    kv_cache_dtype: opt.KvCacheDtype = None,
    kv_cache_memory_bytes: opt.KvCacheMemoryBytes = None,
    quantization: opt.Quantization = None,
    dtype: opt.Dtype = None,
    tensor_parallel_size: opt.TensorParallelSize = None,
    enforce_eager: opt.EnforceEager = None,
    speculative_config: opt.SpeculativeConfig = None,
    spec_method: opt.SpecMethod = None,
    spec_model: opt.SpecModel = None,
    spec_tokens: opt.SpecTokens = None,
    enable_lora: opt.EnableLora = None,
    max_loras: opt.MaxLoras = None,
    max_lora_rank: opt.MaxLoraRank = None,
    max_cpu_loras: opt.MaxCpuLoras = None,
    lora_dtype: opt.LoraDtype = None,
    fully_sharded_loras: opt.FullyShardedLoras = None,
    limit_mm_per_prompt: opt.LimitMmPerPrompt = None,
    skip_mm_profiling: opt.SkipMmProfiling = None,
    mm_encoder_tp_mode: opt.MmEncoderTpMode = None,
    mm_processor_cache_gb: opt.MmProcessorCacheGb = None,
    mm_processor_cache_type: opt.MmProcessorCacheType = None,
    host: Host = None,
    port: Port = None,
    max_attempts: MaxAttempts = 3,
    probe: Probe = None,
    record: Record = True,
    no_calibration: NoCalibration = False,
    allow_precision_change: AllowPrecisionChange = False,
    guard_port: GuardPort = None,
    max_restarts: MaxRestarts = 5,
    restart_window: RestartWindow = 600.0,
    startup_timeout: StartupTimeout = 1800.0,
    log_file: LogFile = None,
    log_dir: LogDir = None,
    vllm_python: VllmPython = None,
    offline: Offline = False,
    dry_run: DryRun = False,
    json_output: JsonOutput = False,
    engine: Engine = "auto",
    gguf: Gguf = None,
    llama_server: LlamaServer = None,
) -> None:
    """Launch vLLM (or llama-server), check the prediction against its log, heal a startup OOM, supervise."""  # noqa: E501
    from oomguard.serve.session import ServeOptions

    given = locals()
    plan_flags: dict[str, Any] = {name: given[name] for name in _PLAN_FLAGS}
    options = ServeOptions(
        workload=_workload(p99_tokens, concurrency),
        max_attempts=max_attempts,
        probe=probe,
        calibrate=record,
        use_calibration=not no_calibration,
        allow_precision_change=allow_precision_change,
        guard_port=guard_port,
        max_restarts=max_restarts,
        restart_window_s=restart_window,
        startup_timeout_s=startup_timeout,
        log_dir=log_dir,
        vllm_python=vllm_python,
        allow_hub=not offline,
        dry_run=dry_run,
        engine=engine,
        gguf=gguf,
        llama_server=llama_server,
    )
    _read_form(options, model, list(ctx.args), plan_flags, host, port)
    raise SystemExit(_run(options, json_output=json_output, log_file=log_file))


def _workload(p99_tokens: str | None, concurrency: int | None) -> Any:
    from oomguard.serve.heal import HealWorkload
    from oomguard.workload import stated_workload

    stated = stated_workload(p99_tokens, concurrency)
    return HealWorkload(
        p99_tokens=stated.p99_tokens or None, concurrency=stated.concurrency or None
    )


def _read_form(
    options: Any,
    model: str | None,
    rest: list[str],
    plan_flags: dict[str, Any],
    host: str | None,
    port: int | None,
) -> None:
    """Fill ``options`` for the MODEL form or the pasted-command form."""
    from oomguard.serve.command import EngineCommand
    from oomguard.vllm_args import settings_from_flags

    pasted = model is None or bool(_COMMAND_START.fullmatch(model))
    given = {k: v for k, v in plan_flags.items() if v is not None}
    if pasted:
        words = ([model] if model else []) + rest
        if not words:
            raise BadInput(
                "nothing to serve",
                "oomguard serve MODEL …  or  oomguard serve -- vllm serve MODEL …",
            )
        if given or host is not None or port is not None:
            flags = ", ".join("--" + k.replace("_", "-") for k in given) or "--host/--port"
            raise BadInput(
                f"{flags} given beside a pasted command",
                "put the engine's flags in the pasted command itself",
            )
        if _names_llama_server(words):
            from oomguard.serve.llama_session import PastedLlamaCommand

            if options.engine == "vllm":
                raise BadInput(
                    "--engine vllm given with a llama-server command",
                    "drop --engine or paste a vllm command",
                )
            options.engine = "llama.cpp"
            options.command = PastedLlamaCommand.from_tokens(words, base_dir=Path.cwd())
            return
        if options.engine == "llama.cpp":
            raise BadInput(
                "--engine llama.cpp given with a vLLM command",
                "paste a llama-server command, or serve MODEL.gguf --engine llama.cpp",
            )
        options.command = EngineCommand.from_tokens(words, base_dir=Path.cwd())
        return
    if options.engine == "auto" and str(model).endswith(".gguf"):
        options.engine = "llama.cpp"
    if options.engine == "llama.cpp" and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise BadInput(
            f"{flags} are vLLM flags; llama.cpp does not take them",
            "pass llama-server's own flags after --, e.g. -- --ctx-size 8192",
        )
    options.model = model
    options.engine_args = tuple(rest)
    options.host, options.port = host, port
    options.plan_settings = settings_from_flags(given)


def _names_llama_server(words: list[str]) -> bool:
    """Whether the pasted words run llama-server (after any ``VAR=value`` assignments)."""
    from oomguard.serve.llama_session import is_llama_server

    first = next((w for w in words if not re.fullmatch(r"\w+=.*", w) and w != "env"), "")
    return is_llama_server(first)


def _run(options: Any, *, json_output: bool, log_file: Path | None) -> int:
    from rich.console import Console

    from oomguard.serve.render import HumanRenderer
    from oomguard.serve.session import ServeSession

    if json_output:
        handlers = [lambda event: typer.echo(event.to_json())]
        sink = None
        renderer = None
        if log_file is not None:
            renderer = HumanRenderer(Console(stderr=True), engine_log=False, log_file=log_file)
            sink = renderer.on_line
    else:
        renderer = HumanRenderer(
            Console(highlight=False), engine_log=log_file is None, log_file=log_file
        )
        handlers = [renderer.on_event]
        sink = renderer.on_line
    session: Any
    why = None
    if options.engine == "auto" and options.gguf is not None and options.model is not None:
        from oomguard.serve.choose import choose_engine

        options.engine, why = choose_engine(options)
        if options.engine == "llama.cpp":
            options.plan_settings = {}  # vLLM's settings: llama.cpp plans its own split
    if options.engine == "llama.cpp":
        from oomguard.serve.llama_session import LlamaServeSession

        session = LlamaServeSession(options, handlers=handlers, line_sink=sink)
    else:
        session = ServeSession(options, handlers=handlers, line_sink=sink)
    if why is not None:
        session.events.emit("note", text=why)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, lambda *_: session.stop())
    try:
        return session.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if renderer is not None:
            renderer.close()


def register(app: typer.Typer) -> None:
    """Add ``oomguard serve`` to the main app."""
    app.command("serve", context_settings=_CONTEXT)(serve_command)
