"""``oomguard plan``: thin shell over :func:`oomguard.plan.service.plan`.

Flags are named like vLLM's. ``oomguard plan -- vllm serve MODEL --flags…`` reads a pasted
command line. Exit codes: 0 fits, 1 does not fit, 2 bad input (one line, no traceback).
"""

from __future__ import annotations

from typing import Any

import typer

from oomguard.errors import BadInput

_CONTEXT = {"allow_extra_args": True, "allow_interspersed_args": True}


def _human(value: str | None, flag: str, *, allow_auto: bool = False) -> int | None:
    from oomguard.vllm_args import parse_human_int

    if value is None:
        return None
    number = parse_human_int(value, flag=flag, allow_auto=allow_auto)
    if allow_auto and number == -1:
        return -1
    if number <= 0:
        raise BadInput(f"{flag} {value}: must be positive", f"pass a positive number to {flag}")
    return number


def plan_command(
    ctx: typer.Context,
    model: str = typer.Argument(
        None,
        help="Catalogue name, hub id or local path (or, after --, a pasted vllm serve command).",
    ),
    gpu: str = typer.Option(
        None,
        "--gpu",
        help="GPU name from the catalogue, or 'auto' (NVML). Omit for a sizing table.",
    ),
    gpu_count: int = typer.Option(
        None, "--gpu-count", help="GPUs available (default: TP × PP, or all detected)."
    ),
    gpu_memory_gib: float = typer.Option(
        None, "--gpu-memory-gib", help="GPU memory as CUDA reports it (custom GPU)."
    ),
    tensor_parallel_size: int = typer.Option(None, "--tensor-parallel-size", "-tp"),
    pipeline_parallel_size: int = typer.Option(None, "--pipeline-parallel-size", "-pp"),
    data_parallel_size: int = typer.Option(
        None, "--data-parallel-size", "-dp", help="Independent engines, each with its own KV pool."
    ),
    enable_expert_parallel: bool = typer.Option(
        None, "--enable-expert-parallel/--no-enable-expert-parallel", "-ep",
        help="Split MoE experts over TP × DP ranks.",
    ),  # fmt: skip
    gpu_memory_utilization: float = typer.Option(None, "--gpu-memory-utilization"),
    max_model_len: str = typer.Option(
        None, "--max-model-len", help="Tokens (8192, 8k, 32K) or 'auto'."
    ),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs"),
    max_num_batched_tokens: str = typer.Option(None, "--max-num-batched-tokens"),
    kv_cache_dtype: str = typer.Option(None, "--kv-cache-dtype"),
    quantization: str = typer.Option(None, "--quantization", "-q"),
    dtype: str = typer.Option(None, "--dtype"),
    enforce_eager: bool = typer.Option(None, "--enforce-eager/--no-enforce-eager"),
    enable_prefix_caching: bool = typer.Option(
        None, "--enable-prefix-caching/--no-enable-prefix-caching"
    ),
    kv_cache_memory_bytes: str = typer.Option(
        None, "--kv-cache-memory-bytes", help="Bytes (e.g. 20G)."
    ),
    cpu_offload_gb: float = typer.Option(None, "--cpu-offload-gb"),
    block_size: int = typer.Option(None, "--block-size"),
    vllm_version: str = typer.Option(
        None, "--vllm-version", help="e.g. 0.11 or 0.19.1 (default: newest)."
    ),
    p99_tokens: str = typer.Option(
        None, "--p99-tokens", help="P99 prompt+output length in tokens."
    ),
    concurrency: int = typer.Option(None, "--concurrency", help="Peak concurrent sequences."),
    shared_prefix: str = typer.Option(
        None,
        "--shared-prefix",
        help="Prefix all requests share: fraction of the P99 (0.3) or tokens (2048).",
    ),
    headroom_gib: float = typer.Option(
        0.0, "--headroom-gib", help="GPU memory to leave free for other processes."
    ),
    margin: float = typer.Option(
        0.10, "--margin", help="Spare KV capacity to demand (0.1 = 10 %)."
    ),
    host_memory_gib: float = typer.Option(
        None, "--host-memory-gib", help="Host RAM the fallback chain's tiers may use (default with --gpu auto: this machine's)."
    ),
    offline: bool = typer.Option(False, "--offline", help="Never contact the Hugging Face hub."),
    no_calibration: bool = typer.Option(
        False, "--no-calibration", help="Ignore the calibration store."
    ),
    json_output: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Predict vLLM's startup memory and print the configuration that serves your workload."""
    from rich.console import Console

    from oomguard.plan.render import render
    from oomguard.plan.service import plan
    from oomguard.vllm_args import parse_float, parse_max_model_len

    command: list[str] | None = None
    if ctx.args:
        command = ([model] if model else []) + list(ctx.args)
        model = None  # type: ignore[assignment]
    elif model in ("vllm", "python", "python3"):
        raise BadInput(
            "a pasted command must follow --", "write: oomguard plan -- vllm serve MODEL --flags…"
        )
    if gpu_memory_utilization is not None:
        parse_float(str(gpu_memory_utilization), "--gpu-memory-utilization")
        if not 0 < gpu_memory_utilization <= 1:
            raise BadInput(
                f"--gpu-memory-utilization {gpu_memory_utilization} is outside (0, 1]",
                "it is the fraction of the GPU's total memory vLLM may use, e.g. 0.85",
            )
    settings: dict[str, Any] = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "data_parallel_size": data_parallel_size,
        "enable_expert_parallel": enable_expert_parallel,
        "gpu_memory_utilization": gpu_memory_utilization,
        "max_model_len": None
        if max_model_len is None
        else parse_max_model_len(max_model_len, "--max-model-len"),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": _human(max_num_batched_tokens, "--max-num-batched-tokens"),
        "kv_cache_dtype": kv_cache_dtype,
        "quantization": quantization,
        "dtype": dtype,
        "enforce_eager": enforce_eager,
        "enable_prefix_caching": enable_prefix_caching,
        "kv_cache_memory_bytes": _human(kv_cache_memory_bytes, "--kv-cache-memory-bytes"),
        "cpu_offload_gb": cpu_offload_gb,
        "block_size": block_size,
        "vllm_version": vllm_version,
    }
    _check_choices(settings)
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                 "max_num_seqs", "block_size"):  # fmt: skip
        value = settings[name]
        if value is not None and value < 1:
            raise BadInput(
                f"--{name.replace('_', '-')} {value} must be at least 1", "pass a positive integer"
            )
    result = plan(
        model,
        gpu,
        gpu_count=gpu_count,
        gpu_memory_gib=gpu_memory_gib,
        p99_tokens=p99_tokens,
        concurrency=concurrency,
        shared_prefix=shared_prefix,
        headroom_gib=headroom_gib,
        margin=margin,
        host_memory_gib=host_memory_gib,
        command=command,
        allow_hub=not offline,
        use_calibration=not no_calibration,
        **{k: v for k, v in settings.items() if v is not None},
    )
    if json_output:
        typer.echo(result.to_json())
    else:
        render(result, Console(highlight=False))
    # SystemExit passes through click unchanged (typer.Exit codes are swallowed in non-standalone mode).
    raise SystemExit(result.exit_code)


def _check_choices(settings: dict[str, Any]) -> None:
    from oomguard.vllm_args import (
        DTYPE_CHOICES,
        KV_CACHE_DTYPE_CHOICES,
        QUANTIZATION_CHOICES,
        choice_parser,
    )

    for name, choices in (
        ("kv_cache_dtype", KV_CACHE_DTYPE_CHOICES),
        ("dtype", DTYPE_CHOICES),
        ("quantization", QUANTIZATION_CHOICES),
    ):
        if settings[name] is not None:
            choice_parser(choices)(settings[name], "--" + name.replace("_", "-"))


def register(app: typer.Typer) -> None:
    """Add ``oomguard plan`` to the main app."""
    app.command("plan", context_settings=_CONTEXT)(plan_command)
