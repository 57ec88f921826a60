"""llama-server settings that decide its memory: context, slots, KV types, and the GPU/CPU split.

Defaults are llama-server's own (``common/common.h`` ``common_params``): ``n_batch`` 2048,
``n_ubatch`` 512, f16 K and V caches, KV offloaded with its layer, memory-mapped weights,
flash attention ``auto`` (on wherever the backend supports it, which includes the CPU and
CUDA backends).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from oomguard.errors import BadInput
from oomguard.tiering.ggml_types import kv_cache_type

# GPU buffer types by backend: alignment and whether quantized rows are padded to 512 elements
# (ggml-cuda.cu ggml_backend_cuda_buffer_type_get_alignment = 128 and get_alloc_size with
# MATRIX_ROW_PADDING 512; the RPC backend forwards both to the remote CPU backend: 32, none).
GPU_BACKENDS = {"cuda": (128, 512), "rpc": (32, 0)}
CPU_ALIGNMENT_BYTES = 32  # ggml-impl.h TENSOR_ALIGNMENT, the CPU buffer type's alignment
# Weights the CPU backend repacks into its CPU_REPACK buffer for faster matrix products
# (ggml-cpu/repack.cpp ggml_repack_get_optimal_repack_type, x86): with AVX2, Q4_0, Q4_K,
# IQ4_NL and MXFP4 matrices whose row count is a multiple of 8; with AVX-512 also Q2_K.
# Only weights of matrix products qualify (not token_embd, read by GET_ROWS).
REPACK_TYPES = {
    "none": frozenset(),
    "avx2": frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}),
    "avx512": frozenset({"Q4_0", "Q4_K", "IQ4_NL", "MXFP4", "Q2_K"}),
}


@dataclass(frozen=True)
class Override:
    """One ``--override-tensor PATTERN=DEVICE`` rule: tensors whose name matches go to
    ``device``."""

    pattern: str
    device: str  # "CPU" or "GPU0", "GPU1", ...

    def matches(self, tensor_name: str) -> bool:
        """``std::regex_search`` of the pattern in the name, as llama.cpp does."""
        return re.search(self.pattern, tensor_name) is not None


@dataclass(frozen=True)
class LlamaCppSettings:
    """What llama-server is told; ``n_gpu_layers`` counts the output layer, as ``-ngl`` does.

    ``n_gpu_layers = n_layer + 1`` (or -1) puts everything on the GPUs; ``n_layer`` leaves
    layer 0 on the CPU (llama-model.cpp: ``i_gpu_start = n_layer + 1 - n_gpu_layers``).
    """

    ctx_size: int = 0  # -c; 0 = the model's training context
    parallel: int = 1  # -np: server slots (sequences)
    kv_unified: bool = False  # -kvu: one pool shared by all slots
    n_gpu_layers: int = 0  # -ngl; -1 = all
    n_cpu_moe: int = 0  # --n-cpu-moe N: experts of the first N layers on the CPU
    cpu_moe: bool = False  # --cpu-moe: all experts on the CPU
    overrides: tuple[Override, ...] = ()
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: bool = True
    batch_size: int = 2048  # -b
    ubatch_size: int = 512  # -ub
    kv_offload: bool = True  # --no-kv-offload keeps every layer's KV on the CPU
    mmap: bool = True  # --load-mode none (or --no-mmap) reads the weights into allocated buffers
    gpu_count: int = 0  # GPU devices llama.cpp sees (0: a CPU-only build or run)
    gpu_backend: str = "cuda"
    tensor_split: tuple[float, ...] = ()  # -ts; default: by free memory (equal for equal GPUs)
    cpu_repack: str = "avx2"  # the host CPU's repack rules (REPACK_TYPES); "none" = --no-repack

    def __post_init__(self) -> None:
        kv_cache_type(self.cache_type_k)
        kv_cache_type(self.cache_type_v)
        if self.parallel < 1:
            raise BadInput(
                f"--parallel {self.parallel} must be at least 1", "pass the number of slots"
            )
        if self.ctx_size < 0:
            raise BadInput(f"--ctx-size {self.ctx_size} is negative", "pass a token count, or 0")
        if self.cpu_repack not in REPACK_TYPES:
            raise BadInput(
                f"unknown CPU repack rule set {self.cpu_repack!r}",
                f"use one of {', '.join(REPACK_TYPES)}",
            )
        if self.gpu_backend not in GPU_BACKENDS:
            raise BadInput(
                f"unknown GPU backend {self.gpu_backend!r}", f"use one of {', '.join(GPU_BACKENDS)}"
            )
        if not self.flash_attn and kv_cache_type(self.cache_type_v) not in ("F16", "F32", "BF16"):
            raise BadInput(
                f"--cache-type-v {self.cache_type_v} needs flash attention",
                "turn flash attention on (-fa on) or use an f16 V cache",
            )

    def all_overrides(self) -> tuple[Override, ...]:
        """The override rules in llama.cpp's order: ``-ot`` first, then the MoE shortcuts."""
        rules = list(self.overrides)
        exps = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # common.h LLM_FFN_EXPS_REGEX
        if self.cpu_moe:
            rules.append(Override(exps, "CPU"))
        rules.extend(Override(rf"blk\.{i}{exps}", "CPU") for i in range(self.n_cpu_moe))
        return tuple(rules)


@dataclass(frozen=True)
class ContextSize:
    """The context llama.cpp builds: total cells, per slot, streams, batch sizes."""

    n_ctx: int
    n_ctx_seq: int  # the context of one slot
    n_seq_max: int
    n_stream: int
    n_batch: int
    n_ubatch: int
