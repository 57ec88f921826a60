"""``oomguard plan``: thin shell over :func:`oomguard.plan.service.plan`.

Flags are named like vLLM's. ``oomguard plan -- vllm serve MODEL --flags…`` reads a pasted
command line. Exit codes: 0 fits, 1 does not fit, 2 bad input (one line, no traceback).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from oomguard import cli_options as opt
from oomguard.errors import BadInput
from oomguard.workload import DEFAULT_MARGIN

_CONTEXT = {"allow_extra_args": True, "allow_interspersed_args": True}

ModelArgument = Annotated[
    str | None,
    typer.Argument(
        help="Catalogue name, hub id or local path (or, after --, a pasted vllm serve command).",
    ),
]
GpuOption = Annotated[
    str | None,
    typer.Option(
        "--gpu", help="GPU name from the catalogue, or 'auto' (NVML). Omit for a sizing table."
    ),
]
GpuCountOption = Annotated[
    int | None,
    typer.Option("--gpu-count", help="GPUs available (default: TP × PP, or all detected)."),
]
GpuMemoryGibOption = Annotated[
    float | None,
    typer.Option("--gpu-memory-gib", help="GPU memory as CUDA reports it (custom GPU)."),
]
HostMemoryGibOption = Annotated[
    float | None,
    typer.Option(
        "--host-memory-gib",
        help=(
            "Host RAM the fallback chain's tiers may use (default with --gpu auto: this machine's)."
        ),
    ),
]
OfflineOption = Annotated[
    bool, typer.Option("--offline", help="Never contact the Hugging Face hub.")
]
NoCalibrationOption = Annotated[
    bool, typer.Option("--no-calibration", help="Ignore the calibration store.")
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def plan_command(
    ctx: typer.Context,
    model: ModelArgument = None,
    gpu: GpuOption = None,
    gpu_count: GpuCountOption = None,
    gpu_memory_gib: GpuMemoryGibOption = None,
    tensor_parallel_size: opt.TensorParallelSize = None,
    pipeline_parallel_size: opt.PipelineParallelSize = None,
    data_parallel_size: opt.DataParallelSize = None,
    enable_expert_parallel: opt.EnableExpertParallel = None,
    gpu_memory_utilization: opt.GpuMemoryUtilization = None,
    max_model_len: opt.MaxModelLen = None,
    max_num_seqs: opt.MaxNumSeqs = None,
    max_num_batched_tokens: opt.MaxNumBatchedTokens = None,
    kv_cache_dtype: opt.KvCacheDtype = None,
    quantization: opt.Quantization = None,
    dtype: opt.Dtype = None,
    enforce_eager: opt.EnforceEager = None,
    enable_prefix_caching: opt.EnablePrefixCaching = None,
    kv_cache_memory_bytes: opt.KvCacheMemoryBytes = None,
    cpu_offload_gb: opt.CpuOffloadGb = None,
    block_size: opt.BlockSize = None,
    speculative_config: opt.SpeculativeConfig = None,
    spec_method: opt.SpecMethod = None,
    spec_model: opt.SpecModel = None,
    spec_tokens: opt.SpecTokens = None,
    vllm_version: opt.VllmVersion = None,
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
    decode_context_parallel_size: opt.DecodeContextParallelSize = None,
    prefill_context_parallel_size: opt.PrefillContextParallelSize = None,
    kv_offloading_size: opt.KvOffloadingSize = None,
    kv_offloading_backend: opt.KvOffloadingBackend = None,
    kv_transfer_config: opt.KvTransferConfig = None,
    enable_sleep_mode: opt.EnableSleepMode = None,
    compilation_config: opt.CompilationConfig = None,
    cudagraph_capture_sizes: opt.CudagraphCaptureSizes = None,
    max_cudagraph_capture_size: opt.MaxCudagraphCaptureSize = None,
    mamba_cache_dtype: opt.MambaCacheDtype = None,
    mamba_ssm_cache_dtype: opt.MambaSsmCacheDtype = None,
    mamba_block_size: opt.MambaBlockSize = None,
    mamba_cache_mode: opt.MambaCacheMode = None,
    p99_tokens: opt.P99Tokens = None,
    concurrency: opt.Concurrency = None,
    shared_prefix: opt.SharedPrefix = None,
    headroom_gib: opt.HeadroomGib = 0.0,
    margin: opt.Margin = DEFAULT_MARGIN,
    host_memory_gib: HostMemoryGibOption = None,
    offline: OfflineOption = False,
    no_calibration: NoCalibrationOption = False,
    json_output: JsonOption = False,
) -> None:
    """Predict vLLM's startup memory and print the configuration that serves your workload."""
    run_plan(ctx, dict(locals()))


def run_plan(ctx: typer.Context, given: dict[str, Any]) -> None:
    """Plan with the options ``plan_command`` was given (its locals) and exit with the verdict."""
    from rich.console import Console

    from oomguard.plan.render import render
    from oomguard.plan.service import plan
    from oomguard.vllm_args import settings_from_flags

    model = given["model"]
    command: list[str] | None = None
    if ctx.args:
        command = ([model] if model else []) + list(ctx.args)
        model = None
    elif model in ("vllm", "python", "python3"):
        raise BadInput(
            "a pasted command must follow --", "write: oomguard plan -- vllm serve MODEL --flags…"
        )
    flags = {name: value for name, value in given.items() if name in _ENGINE_FLAGS}
    flags["estimate_cudagraphs"] = _estimate_from_environment(command)
    result = plan(
        model,
        given["gpu"],
        gpu_count=given["gpu_count"],
        gpu_memory_gib=given["gpu_memory_gib"],
        p99_tokens=given["p99_tokens"],
        concurrency=given["concurrency"],
        shared_prefix=given["shared_prefix"],
        headroom_gib=given["headroom_gib"],
        margin=given["margin"],
        host_memory_gib=given["host_memory_gib"],
        command=command,
        allow_hub=not given["offline"],
        use_calibration=not given["no_calibration"],
        **settings_from_flags(flags),
    )
    if given["json_output"]:
        typer.echo(result.to_json())
    else:
        render(result, Console(highlight=False))
    # SystemExit passes through click unchanged (typer.Exit codes are swallowed in non-standalone
    # mode).
    raise SystemExit(result.exit_code)


# the parameters of plan_command that are EngineSettings fields
_ENGINE_FLAGS = frozenset({
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "enable_expert_parallel", "gpu_memory_utilization", "max_model_len", "max_num_seqs",
    "max_num_batched_tokens", "kv_cache_dtype", "quantization", "dtype", "enforce_eager",
    "enable_prefix_caching", "kv_cache_memory_bytes", "cpu_offload_gb", "block_size",
    "vllm_version", "speculative_config", "spec_method", "spec_model", "spec_tokens",
    "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype",
    "fully_sharded_loras", "limit_mm_per_prompt", "skip_mm_profiling", "mm_encoder_tp_mode",
    "mm_processor_cache_gb", "mm_processor_cache_type",
    "decode_context_parallel_size", "prefill_context_parallel_size",
    "kv_offloading_size", "kv_offloading_backend", "kv_transfer_config", "enable_sleep_mode",
    "compilation_config", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
    "mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_block_size", "mamba_cache_mode",
})  # fmt: skip


def _estimate_from_environment(command: list[str] | None) -> bool | None:
    """VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS from this shell, as vLLM started here would read
    it; a pasted command that sets it itself keeps its own value."""
    import os

    from oomguard.vllm_args import ESTIMATE_CUDAGRAPHS_ENV, estimate_cudagraphs_from_env

    if command and any(word.startswith(ESTIMATE_CUDAGRAPHS_ENV + "=") for word in command):
        return None
    return estimate_cudagraphs_from_env(os.environ)


def register(app: typer.Typer) -> None:
    """Add ``oomguard plan`` to the main app."""
    app.command("plan", context_settings=_CONTEXT)(plan_command)
