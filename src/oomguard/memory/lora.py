"""LoRA adapter buffers: what ``--enable-lora`` adds to "Model loading took" on each rank.

vLLM preallocates, for every module it wraps, stacked A and B buffers for ``max_loras``
adapters at ``max_lora_rank`` (zero-filled, in ``lora_dtype``), inside the weight-loading
profiler (vllm 0.32 ``v1/worker/gpu_model_runner.py: load_model`` calls
``load_lora_model`` under ``DeviceMemoryProfiler``). Shapes, all from vllm 0.32:

* every linear layer is wrapped (``lora/utils.py: get_supported_lora_modules`` collects all
  ``LinearBase``/MoE modules): column-parallel layers (``lora/layers/column_parallel_linear.py``)
  hold A ``[L, 1, r, in]`` per slice (3 slices for a packed q/k/v, 2 for gate/up) and B
  ``[L, 1, out/tp, r]`` per slice; row-parallel layers (``row_parallel_linear.py``) A
  ``[L, 1, r, in/tp]`` and B ``[L, 1, out, r]``; replicated layers (a MoE router) A
  ``[L, 1, r, in]``, B ``[L, 1, out, r]``. ``--fully-sharded-loras`` divides the column A's rank
  and the row B's output by tp (``base_linear.py``).
* MoE experts (``lora/layers/fused_moe.py``, 2-D weights): w1/w3 A ``[L, E, r, H]`` each, w2 A
  ``[L, E, r, I/tp]``, w1/w3 B ``[L, E, I/tp, r]`` each, w2 B ``[L, E, H, r]``; with expert
  parallelism E is the rank's experts and I is not split.
* embedding and LM head, only for models whose ``embedding_modules`` name them
  (``lora/layers/vocab_parallel_embedding.py``: A ``[L, V, r]``, B ``[L, 1, H, r]``;
  ``logits_processor.py``: A ``[L, 1, r, H]``, B ``[L, 1, V, r]``; neither split by TP). The
  LM head wrapper refuses a vocabulary above 258,048 tokens.
* the Punica metadata (``lora/punica_wrapper/punica_base.py`` and ``punica_gpu.py``): four
  int64 index vectors of ``max_num_batched_tokens``, three int64 vectors of ``max_num_seqs``,
  and two kernel-metadata sets of two int32 token vectors and three small per-adapter vectors
  (``lora/ops/triton_ops/lora_kernel_metadata.py``).

Each tensor is one allocation, rounded up to PyTorch's 512-byte block. The adapters themselves
live in host memory (``max_cpu_loras`` of them), and the profile run activates none (its
dummy batch runs with ``num_active_loras=0``), so LoRA adds nothing to the activation peak.
With ``cudagraph_specialize_lora`` (the default) every capture size is captured with and
without adapters (``v1/cudagraph_dispatcher.py: _get_lora_cases``).

Exact for standard attention (separate q/k/v heads), gated MLPs and 2-D MoE experts; layers of
other kinds (MLA, Mamba, linear attention) are priced as a standard attention layer of the
model's widths, an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.memory.spec import AttentionKind, LayerSpec, ModelSpec

# vllm 0.32 config/lora.py: MaxLoRARanks and LoRADType
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_DTYPES = ("auto", "float16", "bfloat16")
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
LORA_MAX_VOCAB = 258048  # lora/layers/logits_processor.py: create_lora_weights
ALLOCATION_BLOCK = 512  # PyTorch's caching allocator rounds every block to 512 bytes
_STANDARD_KINDS = frozenset({AttentionKind.FULL, AttentionKind.SLIDING, AttentionKind.CHUNKED})

# Registered architectures whose ``embedding_modules`` (inherited included) name the input
# embedding and the LM head, so both get LoRA buffers (vllm 0.32 model_executor/models/*.py;
# CohereForCausalLM and Cohere2ForCausalLM name only the embedding).
EMBEDDING_AND_HEAD_ARCHITECTURES = frozenset(
    {
        "ApertusForCausalLM", "DeciLMForCausalLM", "Ernie4_5ForCausalLM", "Exaone4ForCausalLM",
        "ExaoneForCausalLM", "ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM",
        "FalconH1ForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
        "GraniteMoeHybridForCausalLM", "GraniteMoeSWAForCausalLM",
        "GraniteMoeSharedForCausalLM", "GraniteSWAForCausalLM", "HyperCLOVAXForCausalLM",
        "IQuestCoderForCausalLM", "InternLM3ForCausalLM", "JambaForCausalLM",
        "K2HorizonForCausalLM", "LLaMAForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM",
        "Llama4ForCausalLM", "LlamaForCausalLM", "MiniCPM3ForCausalLM", "MiniCPMForCausalLM",
        "MixtralForCausalLM", "NemotronForCausalLM", "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM", "Param2MoEForCausalLM", "Phi3ForCausalLM",
        "PhiMoEForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM", "SolarForCausalLM", "TeleChat2ForCausalLM",
        "TeleChat3ForCausalLM", "TeleFLMForCausalLM",
    }
)  # fmt: skip
EMBEDDING_ONLY_ARCHITECTURES = frozenset({"CohereForCausalLM", "Cohere2ForCausalLM"})


@dataclass(frozen=True)
class LoraShape:
    """The LoRA settings that size the buffers on one rank."""

    max_loras: int
    rank: int
    dtype_bytes: int
    tp: int = 1
    ep: int = 1
    fully_sharded: bool = False
    block: int = ALLOCATION_BLOCK  # allocation granularity (1: the tensors' own bytes)


@dataclass(frozen=True)
class LoraBuffers:
    """LoRA bytes of one pipeline stage on one rank, and whether every layer was exact."""

    bytes: int
    exact: bool


def _block(nbytes: float, block: int = ALLOCATION_BLOCK) -> int:
    """One allocation as the caching allocator counts it (rounded up to ``block`` bytes)."""
    n = int(nbytes)
    return max(block, -(-n // block) * block) if n else 0


def _stack(s: LoraShape, *dims: int) -> int:
    """Bytes of one stacked buffer ``[max_loras, *dims]``."""
    elems = s.max_loras
    for d in dims:
        elems *= d
    return _block(elems * s.dtype_bytes, s.block)


def column_parallel(s: LoraShape, hidden_in: int, outputs: tuple[int, ...]) -> int:
    """A column-parallel linear with one slice per full output size in ``outputs``."""
    rank_a = s.rank // s.tp if s.fully_sharded else s.rank
    a = _stack(s, 1, rank_a, hidden_in) * len(outputs)
    return a + sum(_stack(s, 1, out // s.tp, s.rank) for out in outputs)


def row_parallel(s: LoraShape, full_in: int, out: int) -> int:
    """A row-parallel linear: A over the rank's input share, B over the full output."""
    out_b = out // s.tp if s.fully_sharded else out
    return _stack(s, 1, s.rank, full_in // s.tp) + _stack(s, 1, out_b, s.rank)


def replicated(s: LoraShape, full_in: int, out: int) -> int:
    """A replicated linear (every rank holds it whole)."""
    return _stack(s, 1, s.rank, full_in) + _stack(s, 1, out, s.rank)


def _attention(model: ModelSpec, layer: LayerSpec, s: LoraShape) -> int:
    """q/k/v (three slices) and the output projection of a layer with separate K/V heads."""
    head = layer.head_size or model.head_size
    kv_heads = layer.num_kv_heads or model.num_kv_heads
    q = model.num_attention_heads * head
    # K/V heads are replicated when tp exceeds them (QKVParallelLinear: num_kv_head_replicas)
    kv_rank = max(1, kv_heads // s.tp) * head * s.tp
    qkv = column_parallel(s, model.hidden_size, (q, kv_rank, kv_rank))
    return qkv + row_parallel(s, q, model.hidden_size)


def gated_mlp(s: LoraShape, hidden: int, intermediate: int) -> int:
    """gate/up (two slices) and down."""
    up = column_parallel(s, hidden, (intermediate, intermediate))
    return up + row_parallel(s, intermediate, hidden)


def moe_experts(s: LoraShape, hidden: int, intermediate: int, experts: int) -> int:
    """The 2-D MoE LoRA buffers of one layer (w1 and w3 separate, w2)."""
    local = experts // s.ep if s.ep > 1 else experts
    split = 1 if s.ep > 1 else s.tp  # EP collapses the MoE tp size to 1
    part = intermediate // split
    rank_a = s.rank // split if s.fully_sharded else s.rank
    hidden_b = hidden // split if s.fully_sharded else hidden
    w13 = 2 * (_stack(s, local, rank_a, hidden) + _stack(s, local, part, s.rank))
    return w13 + _stack(s, local, s.rank, part) + _stack(s, local, hidden_b, s.rank)


def _mlp_layer(model: ModelSpec, s: LoraShape, moe_layer: bool) -> int:
    moe = model.moe
    if not moe_layer or moe is None:
        return gated_mlp(s, model.hidden_size, model.intermediate_size)
    total = replicated(s, model.hidden_size, moe.num_experts)  # the router
    total += moe_experts(s, model.hidden_size, moe.expert_intermediate_size, moe.num_experts)
    if moe.num_shared_experts and moe.shared_expert_intermediate_size:
        shared = moe.num_shared_experts * moe.shared_expert_intermediate_size
        total += gated_mlp(s, model.hidden_size, shared)
    return total


def _moe_layer_flags(model: ModelSpec) -> list[bool]:
    """Which decoder layers hold MoE experts (the dense ones first, as the readers count)."""
    n = model.num_layers
    if model.moe is None:
        return [False] * n
    moe_layers = model.moe.num_moe_layers or n
    return [i >= n - moe_layers for i in range(n)]


def vocab_buffers(model: ModelSpec, s: LoraShape, *, first: bool, last: bool) -> int:
    """Embedding (first stage) and LM-head (last stage) buffers, for models that wrap them."""
    arch = model.architecture
    total = 0
    if first and (arch in EMBEDDING_AND_HEAD_ARCHITECTURES or arch in EMBEDDING_ONLY_ARCHITECTURES):
        total += _stack(s, model.vocab_size, s.rank) + _stack(s, 1, model.hidden_size, s.rank)
    if last and arch in EMBEDDING_AND_HEAD_ARCHITECTURES:
        total += _stack(s, 1, s.rank, model.hidden_size) + _stack(s, 1, model.vocab_size, s.rank)
    return total


def head_refused(model: ModelSpec) -> bool:
    """Whether vLLM refuses LoRA for this model: an LM-head wrapper over too large a vocab."""
    return model.architecture in EMBEDDING_AND_HEAD_ARCHITECTURES and (
        model.vocab_size > LORA_MAX_VOCAB
    )


def punica_metadata_bytes(max_num_batched_tokens: int, max_num_seqs: int, max_loras: int) -> int:
    """The Punica wrapper's index tensors (every rank)."""
    t, seqs = max_num_batched_tokens, max_num_seqs
    base = 4 * _block(8 * t) + 3 * _block(8 * seqs)
    per_adapter = 2 * _block(4 * (max_loras + 1)) + _block(4 * (max_loras + 2))
    return base + 2 * (2 * _block(4 * t) + per_adapter)


def module_bytes(
    model: ModelSpec, s: LoraShape, layers: range, *, first: bool, last: bool
) -> LoraBuffers:
    """The wrapped modules' A/B stacks on one rank of the stage owning ``layers``."""
    moe_flags = _moe_layer_flags(model)
    total, exact = 0, True
    for i in layers:
        layer = model.layers[i] if i < len(model.layers) else LayerSpec(AttentionKind.FULL)
        if layer.kind not in _STANDARD_KINDS:
            exact = False  # MLA, Mamba and linear attention priced as standard attention
        total += _attention(model, layer, s) + _mlp_layer(model, s, moe_flags[i])
    total += vocab_buffers(model, s, first=first, last=last)
    return LoraBuffers(total, exact)


def lora_stage_bytes(
    model: ModelSpec,
    s: LoraShape,
    layers: range,
    *,
    first: bool,
    last: bool,
    tokens: int,
    seqs: int,
) -> LoraBuffers:
    """LoRA buffers one rank of the stage owning ``layers`` allocates while loading."""
    modules = module_bytes(model, s, layers, first=first, last=last)
    total = modules.bytes + punica_metadata_bytes(tokens, seqs, s.max_loras)
    return LoraBuffers(total, modules.exact)


def adapter_host_bytes(model: ModelSpec, s: LoraShape) -> int:
    """Host memory of one adapter at the maximum rank, unsharded (the CPU LoRA cache's unit)."""
    whole = LoraShape(1, s.rank, s.dtype_bytes)
    moe_flags = _moe_layer_flags(model)
    total = 0
    for i in range(model.num_layers):
        layer = model.layers[i] if i < len(model.layers) else LayerSpec(AttentionKind.FULL)
        total += _attention(model, layer, whole) + _mlp_layer(model, whole, moe_flags[i])
    return total + vocab_buffers(model, whole, first=True, last=True)
