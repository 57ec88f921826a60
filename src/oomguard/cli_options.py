"""Command-line options declared once: vLLM's engine flags and the workload flags.

plan, serve, the doctor's lint and bench use these, so a flag has one name, one type, one
unit and one help text everywhere. Values arrive as text where vLLM reads them loosely
(``8k``, ``32K``, ``auto``) and are parsed by :func:`oomguard.vllm_args.settings_from_flags`
and :mod:`oomguard.workload`.
"""

from __future__ import annotations

from typing import Annotated

import typer

# -- vLLM engine flags (the names vLLM uses) --------------------------------------------------
TensorParallelSize = Annotated[int | None, typer.Option("--tensor-parallel-size", "-tp")]
PipelineParallelSize = Annotated[int | None, typer.Option("--pipeline-parallel-size", "-pp")]
DataParallelSize = Annotated[
    int | None,
    typer.Option(
        "--data-parallel-size", "-dp", help="Independent engines, each with its own KV pool."
    ),
]
EnableExpertParallel = Annotated[
    bool | None,
    typer.Option(
        "--enable-expert-parallel/--no-enable-expert-parallel",
        "-ep",
        help="Split MoE experts over TP × DP ranks.",
    ),
]
GpuMemoryUtilization = Annotated[float | None, typer.Option("--gpu-memory-utilization")]
MaxModelLen = Annotated[
    str | None, typer.Option("--max-model-len", help="Tokens (8192, 8k, 32K) or 'auto'.")
]
MaxNumSeqs = Annotated[int | None, typer.Option("--max-num-seqs")]
MaxNumBatchedTokens = Annotated[
    str | None, typer.Option("--max-num-batched-tokens", help="Tokens (8192, 8k).")
]
KvCacheDtype = Annotated[str | None, typer.Option("--kv-cache-dtype")]
KvCacheMemoryBytes = Annotated[
    str | None, typer.Option("--kv-cache-memory-bytes", help="Bytes (e.g. 20G).")
]
Quantization = Annotated[str | None, typer.Option("--quantization", "-q")]
Dtype = Annotated[str | None, typer.Option("--dtype")]
EnforceEager = Annotated[bool | None, typer.Option("--enforce-eager/--no-enforce-eager")]
EnablePrefixCaching = Annotated[
    bool | None, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching")
]
CpuOffloadGb = Annotated[float | None, typer.Option("--cpu-offload-gb")]
BlockSize = Annotated[int | None, typer.Option("--block-size")]
# LoRA and multimodal limits (vllm/config/lora.py, vllm/config/multimodal.py)
EnableLora = Annotated[
    bool | None,
    typer.Option(
        "--enable-lora/--no-enable-lora",
        help="Serve LoRA adapters: buffers for --max-loras adapters at --max-lora-rank.",
    ),
]
MaxLoras = Annotated[
    int | None, typer.Option("--max-loras", help="Adapters in one batch (default 1).")
]
MaxLoraRank = Annotated[
    int | None,
    typer.Option("--max-lora-rank", help="1, 8, 16, 32, 64, 128, 256, 320 or 512 (default 16)."),
]
MaxCpuLoras = Annotated[
    int | None,
    typer.Option("--max-cpu-loras", help="Adapters cached in host memory (default --max-loras)."),
]
LoraDtype = Annotated[
    str | None, typer.Option("--lora-dtype", help="auto (the model's), float16 or bfloat16.")
]
FullyShardedLoras = Annotated[
    bool | None, typer.Option("--fully-sharded-loras/--no-fully-sharded-loras")
]
LimitMmPerPrompt = Annotated[
    str | None,
    typer.Option(
        "--limit-mm-per-prompt",
        help='Items per prompt as JSON: \'{"image": 2, "video": {"count": 1, "num_frames": 16}}\'.',
    ),
]
SkipMmProfiling = Annotated[bool | None, typer.Option("--skip-mm-profiling/--no-skip-mm-profiling")]
MmEncoderTpMode = Annotated[
    str | None, typer.Option("--mm-encoder-tp-mode", help="weights (split) or data (whole).")
]
MmProcessorCacheGb = Annotated[
    float | None, typer.Option("--mm-processor-cache-gb", help="Host memory, GiB (default 4).")
]
MmProcessorCacheType = Annotated[
    str | None, typer.Option("--mm-processor-cache-type", help="lru or shm.")
]
# context parallelism, KV offloading, sleep mode, CUDA graphs, Mamba caches (vLLM's names and
# value forms: JSON objects as text, capture sizes as "1 2 4" or "1,2,4")
DecodeContextParallelSize = Annotated[
    int | None, typer.Option("--decode-context-parallel-size", "-dcp")
]
PrefillContextParallelSize = Annotated[
    int | None, typer.Option("--prefill-context-parallel-size", "-pcp")
]
KvOffloadingSize = Annotated[
    float | None,
    typer.Option("--kv-offloading-size", help="GiB of host memory for offloaded KV (all ranks)."),
]
KvOffloadingBackend = Annotated[str | None, typer.Option("--kv-offloading-backend")]
KvTransferConfig = Annotated[
    str | None, typer.Option("--kv-transfer-config", help="JSON, as vLLM takes it.")
]
EnableSleepMode = Annotated[bool | None, typer.Option("--enable-sleep-mode/--no-enable-sleep-mode")]
CompilationConfig = Annotated[
    str | None, typer.Option("--compilation-config", "-cc", help="JSON, as vLLM takes it.")
]
CudagraphCaptureSizes = Annotated[
    str | None, typer.Option("--cudagraph-capture-sizes", help="Sizes: '1 2 4 8' or '1,2,4,8'.")
]
MaxCudagraphCaptureSize = Annotated[int | None, typer.Option("--max-cudagraph-capture-size")]
MambaCacheDtype = Annotated[str | None, typer.Option("--mamba-cache-dtype")]
MambaSsmCacheDtype = Annotated[str | None, typer.Option("--mamba-ssm-cache-dtype")]
MambaBlockSize = Annotated[int | None, typer.Option("--mamba-block-size")]
MambaCacheMode = Annotated[str | None, typer.Option("--mamba-cache-mode")]
# speculative decoding: vLLM's JSON, and the older flags that fill its keys
SpeculativeConfig = Annotated[
    str | None,
    typer.Option(
        "--speculative-config",
        "-sc",
        help=(
            "Drafter as vLLM's JSON, e.g. "
            '\'{"method":"eagle3","model":"…","num_speculative_tokens":3}\'.'
        ),
    ),
]
SpecMethod = Annotated[str | None, typer.Option("--spec-method", help="speculative method")]
SpecModel = Annotated[str | None, typer.Option("--spec-model", help="drafter model")]
SpecTokens = Annotated[int | None, typer.Option("--spec-tokens", help="speculative tokens")]
VllmVersion = Annotated[
    str | None, typer.Option("--vllm-version", help="e.g. 0.11 or 0.19.1 (default: newest).")
]

# -- the workload (oomguard.workload.Workload) -------------------------------------------------
P99Tokens = Annotated[
    str | None,
    typer.Option("--p99-tokens", help="P99 prompt+output length in tokens (8192, 8k, 16K)."),
]
Concurrency = Annotated[
    int | None, typer.Option("--concurrency", help="Peak concurrent sequences.")
]
SharedPrefix = Annotated[
    str | None,
    typer.Option(
        "--shared-prefix",
        help="Prefix all requests share: fraction of the P99 (0.3) or tokens (2048, 2k).",
    ),
]
HeadroomGib = Annotated[
    float,
    typer.Option(
        "--headroom-gib", help="GPU memory to leave free for other processes (co-tenants)."
    ),
]
Margin = Annotated[
    float, typer.Option("--margin", help="Spare KV capacity to demand (0.1 = 10 %).")
]
