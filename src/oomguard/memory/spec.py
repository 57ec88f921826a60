"""Model facts as the memory model sees them: small immutable values, no I/O.

Readers in :mod:`oomguard.facts` turn a ``config.json`` (catalogue entry, local directory,
hub metadata or GGUF header) into a :class:`ModelSpec`. Everything in :mod:`oomguard.memory`
computes from these values only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property

from oomguard.units import GIB


class AttentionKind(str, Enum):
    """How one decoder layer keeps per-token state (mirrors vLLM's KV-cache spec classes)."""

    FULL = "full"  # FullAttentionSpec
    SLIDING = "sliding"  # SlidingWindowSpec
    CHUNKED = "chunked"  # ChunkedLocalAttentionSpec (Llama-4 attention_chunk_size)
    MLA = "mla"  # MLAAttentionSpec (one latent per token, not TP-sharded)
    MAMBA = "mamba"  # MambaSpec: fixed-size recurrent state (Mamba1/2, GDN, short-conv, linear)
    # CrossAttentionSpec: K/V of the request's encoder tokens (mllama image tiles), sized by
    # encoder tokens per request, not by the decoded sequence length
    CROSS = "cross"
    NONE = "none"  # no per-token state (attention-free or KV shared with another layer)


class MambaVariant(str, Enum):
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"
    GATED_DELTA_NET = "gdn"  # Qwen3-Next, Kimi-Linear (KDA has the same state shapes)
    SHORT_CONV = "short_conv"  # LFM2
    LINEAR_ATTENTION = "linear_attention"  # MiniMax lightning attention


@dataclass(frozen=True)
class MambaStateSpec:
    """Shapes that size one layer's recurrent state (before tensor parallelism)."""

    variant: MambaVariant
    conv_kernel: int = 4
    # Mamba1 / Mamba2
    intermediate_size: int = 0
    state_size: int = 0
    n_groups: int = 1
    num_heads: int = 0
    head_dim: int = 0
    # Gated DeltaNet / KDA
    num_k_heads: int = 0
    head_k_dim: int = 0
    num_v_heads: int = 0
    head_v_dim: int = 0
    # dtype of the SSM state when the model pins it (e.g. "float32" for Nemotron-H); None: conv
    # dtype
    ssm_dtype: str | None = None
    # the model's SSD chunk size (config ``chunk_size`` / ``mamba_chunk_size``); sizes the
    # per-block Mamba caching ("all" mode) block size. None: vLLM's fallback of 256 is used.
    mamba_chunk_size: int | None = None


@dataclass(frozen=True)
class LayerSpec:
    """Per-token state of one decoder layer."""

    kind: AttentionKind
    num_kv_heads: int = 0  # total across TP ranks (MLA: 1)
    head_size: int = 0  # K head size (MLA: kv_lora_rank + qk_rope_head_dim)
    head_size_v: int = 0  # V head size; 0 means equal to head_size (MLA: 0, no separate V)
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba: MambaStateSpec | None = None
    # DeepSeek-V3.2 sparse MLA: an fp8 cache uses the 656-byte fp8_ds_mla token layout
    ds_sparse: bool = False
    # a lightning-indexer key cache (DeepSeek-V3.2): ``head_size`` bytes per token, uint8
    indexer: bool = False


class ParamSharding(str, Enum):
    """How a parameter group is split over tensor-parallel ranks."""

    TP = "tp"  # column/row-parallel linears: divided by tp
    VOCAB = "vocab"  # vocab-parallel embedding / LM head: vocab padded to 64, then divided by tp
    REPLICATED = "replicated"  # norms, routers, small layers: full copy on every rank
    EXPERTS = "experts"  # MoE experts: divided by tp (or by ep with expert parallelism)
    KV_REPLICATED = "kv"  # K/V projections: divided by tp, replicated when tp > kv heads


@dataclass(frozen=True)
class ParamGroup:
    """A set of parameters sharing sharding, quantization and pipeline placement.

    ``count`` is the number of elements summed over all layers it covers. ``per_layer`` groups
    are spread evenly over decoder layers (pipeline stages hold their share); others sit on the
    first stage (``stage="first"``, embeddings) or the last (``stage="last"``, LM head, final
    norm, MTP heads).
    """

    # "embed", "lm_head", "attn_qo", "attn_kv", "mlp", "experts", "shared_experts", "router",
    # "norm", "mamba", "vision", "mtp"
    name: str
    count: int
    sharding: ParamSharding
    quantizable: bool  # linear weights a quantization method converts
    per_layer: bool = True
    stage: str = "layers"  # "layers" | "first" | "last" | "all" (vision tower: first stage)
    rows: int = 0  # for VOCAB groups: vocabulary rows before padding (to pad to 64)
    cols: int = 0  # for VOCAB groups: row width (hidden size)


@dataclass(frozen=True)
class QuantSpec:
    """The checkpoint's weight format. ``method=None`` means unquantized (model dtype)."""

    # "fp8", "awq", "gptq", "compressed-tensors", "bitsandbytes", "mxfp4", "nvfp4", "gguf", ...
    method: str | None = None
    weight_bits: int = 16
    group_size: int | None = None
    zero_point: bool = False
    scale_granularity: str = "tensor"  # "tensor" | "channel" | "block" | "group"
    desc_act: bool = False
    # parameter groups the method leaves in model dtype (e.g. ("attn_qo","attn_kv") for MoE-only
    # mxfp4)
    unquantized_groups: tuple[str, ...] = ()
    gguf_bits_per_weight: float | None = None


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = 0


@dataclass(frozen=True)
class VisionSpec:
    """Multimodal encoder facts: tower size and the worst-case tokens of one item."""

    params: int
    max_tokens_per_item: int  # placeholder tokens of one maximal image (vLLM's profiling unit)
    hidden_size: int = 0
    num_layers: int = 0
    modality: str = "image"


@dataclass(frozen=True)
class RopeCache:
    """One rotary embedding vLLM instantiates: its cos/sin cache is positions × rotary_dim.

    vLLM's ``get_rope`` shares one instance among all layers with the same parameters
    (vllm/model_executor/layers/rotary_embedding/__init__.py, ``_ROPE_DICT``), and each holds a
    ``cos_sin_cache`` buffer of ``[positions, rotary_dim]`` (…/rotary_embedding/base.py).
    """

    positions: int
    rotary_dim: int
    dtype: str | None = None  # None: the model's dtype (vLLM's default dtype while loading)


@dataclass(frozen=True)
class ModelSpec:
    """Everything the memory model needs to know about one model checkpoint."""

    name: str
    architecture: str  # HF architectures[0]
    model_type: str
    dtype: str  # checkpoint/model dtype: "bfloat16" | "float16" | "float32"
    hidden_size: int
    intermediate_size: int
    num_layers: int  # decoder layers that run (excludes MTP)
    num_attention_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    tie_word_embeddings: bool
    derived_max_model_len: int  # vLLM's default max_model_len (docs/memory-model.md §3.5)
    layers: tuple[LayerSpec, ...]
    params: tuple[ParamGroup, ...]
    quant: QuantSpec = field(default_factory=QuantSpec)
    moe: MoESpec | None = None
    vision: VisionSpec | None = None
    num_mtp_layers: int = 0  # multi-token-prediction layers in the checkpoint (DeepSeek-V3)
    # Exact checkpoint bytes by safetensors dtype when known ({"BF16": n, "F8_E4M3": m, ...}).
    checkpoint_bytes_by_dtype: dict[str, int] = field(
        default_factory=dict, hash=False, compare=False
    )
    source: str = ""  # where the facts came from (catalogue entry, path, hub repo)
    # False when the config was read by the generic reader (an architecture the reader table
    # does not know): estimates then carry wider ranges
    verified: bool = True
    # what the user must know about how the facts were obtained (generic reader, a sibling's
    # config standing in for this repo's); shown with the plan
    caveats: tuple[str, ...] = field(default=(), hash=False, compare=False)
    # the rotary embeddings vLLM builds (one cos/sin cache each; () for a model without RoPE);
    # None: not read from a config, priced as one cache of derived_max_model_len × head_size
    rope_caches: tuple[RopeCache, ...] | None = None

    @property
    def total_params(self) -> int:
        return sum(g.count for g in self.params)

    @property
    def is_hybrid(self) -> bool:
        kinds = {layer.kind for layer in self.layers if layer.kind is not AttentionKind.NONE}
        return len(kinds) > 1

    @cached_property  # asked on every prediction; the layers never change
    def has_mamba(self) -> bool:
        return any(layer.kind is AttentionKind.MAMBA for layer in self.layers)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator model as vLLM sees it."""

    name: str  # canonical name, e.g. "H100 SXM"
    total_bytes: int  # what cudaMemGetInfo reports as total (below the marketing size)
    marketing_gb: float  # the size on the box, for display
    vendor: str = "nvidia"  # "nvidia" | "amd"
    compute_capability: str = ""  # "9.0"; Blackwell "10.0" changes capture sizes and MLA backends
    device_name: str = ""  # torch.cuda.get_device_name(), lower-cased by vLLM for default tiers
    source: str = ""
    # GPUs of this model in one server are linked by NVLink/NVSwitch (AMD: xGMI): vLLM's custom
    # all-reduce (and NCCL's NVLink paths) set up their device buffers only then; PCIe-only
    # cards skip them (vllm distributed/device_communicators/custom_all_reduce.py: world size
    # > 2 needs full NVLink, 2 needs P2P). Default True: an unknown card is priced the
    # conservative way (the larger non-torch term).
    nvlink: bool = True
    # NVSwitch Hopper/Blackwell (HGX H100/H200/H20/H800, B200): NCCL can use NVLink SHARP (NVLS),
    # whose buffers vLLM 0.11+ (cuMem on) measures as non-torch memory under TP.
    nvls: bool = False
    # Integrated GPU sharing one memory with the host (DGX Spark GB10, Jetson): CUDA's total is
    # the system RAM, and since vLLM 0.12 the startup free memory is what the OS reports
    # available (page cache included) instead of cudaMemGetInfo's free figure.
    unified_memory: bool = False

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB
