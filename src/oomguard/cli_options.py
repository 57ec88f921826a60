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
# speculative decoding: vLLM's JSON, and the older flags that fill its keys
SpeculativeConfig = Annotated[
    str | None,
    typer.Option(
        "--speculative-config",
        "-sc",
        help='Drafter as vLLM\'s JSON, e.g. \'{"method":"eagle3","model":"…","num_speculative_tokens":3}\'.',
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
