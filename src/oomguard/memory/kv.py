"""KV-cache pages, groups, block counts and the capacity formulas of every vLLM era.

Mirrors vLLM's ``v1/kv_cache_interface.py`` (one small frozen class per attention kind, each
knowing its ``page_size_bytes`` and how many blocks one request needs) and the planning math
of ``v1/core/kv_cache_utils.py`` (grouping, ``bytes_per_block``, ``num_blocks``, capacity,
fit check, estimated maximum model length). Section numbers refer to the memory
model, docs/memory-model.md. Everything here is exact integer arithmetic; nothing is estimated.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from functools import lru_cache

from oomguard.errors import BadInput, UnsupportedArchitecture
from oomguard.memory.dtypes import DTYPE_BYTES, dtype_bytes
from oomguard.memory.spec import AttentionKind, LayerSpec, MambaStateSpec, MambaVariant, ModelSpec
from oomguard.memory.versions import VllmEra

# spare KV capacity a sized configuration keeps: plan's default margin over the workload, the
# share of the pool's capacity a shortened --max-model-len leaves unused
KV_MARGIN = 0.10
FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
# DeepSeek's fp8_ds_mla token: 512 fp8 NoPE values, 4 fp32 scales, 64 bf16 RoPE values
# (v1/attention/backends/mla/flashmla_sparse.py; kv_cache_interface.py MLAAttentionSpec)
DS_MLA_FP8_TOKEN_BYTES = 656
PER_TOKEN_HEAD_KV_DTYPES = ("int8_per_token_head", "fp8_per_token_head")
KV_CACHE_DTYPES = (
    "auto",
    "bfloat16",
    "float16",
    "float32",
    *FP8_KV_DTYPES,
    "nvfp4",
    *PER_TOKEN_HEAD_KV_DTYPES,
    "int4_per_token_head",
)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


def check_kv_cache_dtype(kv_cache_dtype: str, era: VllmEra) -> None:
    """Raise :class:`BadInput` when the KV-cache dtype does not exist in this vLLM release."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise BadInput(
            f"--kv-cache-dtype {kv_cache_dtype!r} is unknown",
            "use auto, fp8, fp8_e4m3, fp8_e5m2, fp8_inc, nvfp4, int8_per_token_head, "
            "fp8_per_token_head or int4_per_token_head",
        )
    if kv_cache_dtype in ("nvfp4", *PER_TOKEN_HEAD_KV_DTYPES) and not era.new_kv_dtypes:
        raise BadInput(
            f"--kv-cache-dtype {kv_cache_dtype} needs vLLM 0.20 or newer (version {era.label})",
            "use fp8 or a newer vLLM",
        )
    if kv_cache_dtype == "int4_per_token_head" and not era.int4_kv_dtype:
        raise BadInput(
            f"--kv-cache-dtype int4_per_token_head needs vLLM 0.25 or newer (version {era.label})",
            "use fp8 or a newer vLLM",
        )


def head_token_bytes(kv_cache_dtype: str, model_dtype_bytes: int, head_size: int) -> int:
    """Bytes one token of one K (or V) head takes in the cache (§4.1)."""
    if kv_cache_dtype == "auto":
        return head_size * model_dtype_bytes
    if kv_cache_dtype in ("bfloat16", "float16", "float32"):
        return head_size * DTYPE_BYTES[kv_cache_dtype]
    if kv_cache_dtype in FP8_KV_DTYPES:
        return head_size
    if kv_cache_dtype == "nvfp4":  # packed fp4 + one fp8 scale per 16 elements
        return head_size // 2 + head_size // 16
    if kv_cache_dtype in PER_TOKEN_HEAD_KV_DTYPES:  # 1 B/elem + one fp32 scale
        return head_size + 4
    if kv_cache_dtype == "int4_per_token_head":
        return head_size // 2 + 4
    raise BadInput(f"--kv-cache-dtype {kv_cache_dtype!r} is unknown", "use auto or fp8")


def kv_heads_per_rank(total_kv_heads: int, tp: int) -> int:
    """KV heads one tensor-parallel rank holds; replicated when tp > heads (§4.1).

    Raises :class:`BadInput` when the heads cannot be split evenly over the ranks.
    """
    if tp < 1:
        raise BadInput(f"tensor parallel size {tp} is not positive", "use 1 or more")
    if total_kv_heads >= tp:
        if total_kv_heads % tp:
            raise BadInput(
                f"the model's {total_kv_heads} KV heads cannot be split over "
                f"tensor parallel size {tp}",
                "use a tensor parallel size that divides the KV head count",
            )
        return total_kv_heads // tp
    if tp % total_kv_heads:
        raise BadInput(
            f"tensor parallel size {tp} is not a multiple of the model's {total_kv_heads} KV heads",
            "use a tensor parallel size that is a multiple (or divisor) of the KV head count",
        )
    return 1


# --------------------------------------------------------------------------------------------
# Per-layer specs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestBound:
    """What bounds one request's blocks: its length and the tokens in flight (§4.3, §4.4)."""

    max_model_len: int
    lookahead_tokens: int  # max_num_batched_tokens (≤0.25) or max_in_flight_tokens (0.26+)
    num_speculative_blocks: int = 0
    # encoder tokens one request's cross-attention layers hold (vLLM's
    # scheduler_config.max_num_encoder_input_tokens; 0 when the model has no cross-attention)
    encoder_tokens: int = 0
    # §14.1 decode context parallelism: the ranks a full-attention or MLA layer's tokens are
    # sharded over (0.21+; vllm 0.32 v1/kv_cache_interface.py FullAttentionSpec
    # .max_memory_usage_bytes uses cdiv(max_model_len, dcp)); replicated layers ignore it
    kv_shards: int = 1
    # ≤0.20: the CP sizes the "KV cache size" line is multiplied by instead (§6)
    log_tokens_factor: int = 1
    # tokens a sliding window keeps below itself for a multi-module MTP chain (vllm 0.32
    # kv_cache_interface.py SlidingWindowSpec.extra_retained_tokens)
    sliding_retained_tokens: int = 0


@dataclass(frozen=True)
class KVLayerSpec:
    """Base of the per-layer cache specs: a block of ``block_size`` tokens of one layer."""

    block_size: int
    page_size_padded: int | None = None

    @property
    def raw_page_size_bytes(self) -> int:
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer (after any padding to a common page)."""
        return self.page_size_padded if self.page_size_padded else self.raw_page_size_bytes

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        """Blocks one request at ``bound.max_model_len`` holds in this layer."""
        raise NotImplementedError

    def max_memory_usage_bytes(self, bound: RequestBound) -> int:
        """Bytes one maximal request holds in this layer."""
        return self.max_blocks_per_request(bound) * self.page_size_bytes

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class FullAttention(KVLayerSpec):
    """Full causal attention (vLLM FullAttentionSpec); heads are per rank."""

    num_kv_heads: int = 0
    head_bytes_k: int = 0  # bytes per token per head for K at the cache dtype
    head_bytes_v: int = 0

    @property
    def raw_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_bytes_k + self.head_bytes_v)

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of this layer."""
        return self.num_kv_heads * (self.head_bytes_k + self.head_bytes_v)

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        return cdiv(cdiv(bound.max_model_len, bound.kv_shards), self.block_size)


@dataclass(frozen=True)
class SlidingWindow(FullAttention):
    """Sliding-window attention: only the window plus the tokens in flight stay (§4.3)."""

    sliding_window: int = 0

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        extra = bound.sliding_retained_tokens
        tokens = min(self.sliding_window - 1 + extra + bound.lookahead_tokens, bound.max_model_len)
        return cdiv(tokens, self.block_size) + 1


@dataclass(frozen=True)
class ChunkedLocal(FullAttention):
    """Chunked local attention (Llama-4 ``attention_chunk_size``, §4.4)."""

    attention_chunk_size: int = 0

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        tokens = min(self.attention_chunk_size + bound.lookahead_tokens, bound.max_model_len)
        return cdiv(tokens, self.block_size)


@dataclass(frozen=True)
class CrossAttention(FullAttention):
    """Cross-attention over the request's encoder tokens (vLLM CrossAttentionSpec, §4.5).

    One request holds ``cdiv(encoder_tokens, block_size)`` blocks whatever its decoded length
    (vllm 0.32 ``v1/kv_cache_interface.py``: the bound is the scheduler's
    ``max_num_encoder_input_tokens``).
    """

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        return cdiv(bound.encoder_tokens, self.block_size)


@dataclass(frozen=True)
class MLA(KVLayerSpec):
    """Multi-head latent attention: one latent per token, not sharded by TP (§4.2)."""

    token_bytes_: int = 0  # bytes of one token's latent (576 × dtype bytes for DeepSeek-V3)
    sliding_window: int | None = None

    @property
    def token_bytes(self) -> int:
        return self.token_bytes_

    @property
    def raw_page_size_bytes(self) -> int:
        return self.block_size * self.token_bytes_

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        if self.sliding_window:
            tokens = min(self.sliding_window - 1 + bound.lookahead_tokens, bound.max_model_len)
            return cdiv(tokens, self.block_size) + 1
        return cdiv(cdiv(bound.max_model_len, bound.kv_shards), self.block_size)


@dataclass(frozen=True)
class Mamba(KVLayerSpec):
    """Recurrent state of a Mamba / linear-attention layer (§4.6).

    ``state_bytes`` is the unpadded per-rank state; ``cache_mode`` is vLLM's
    ``mamba_cache_mode``: "none" (one state per request), "align" (two) or "all" (one per block).
    ``checkpoint_blocks``: prefill checkpoint blocks a request holds in align mode on top of its
    two (vLLM ``MambaSpec.max_memory_usage_bytes``, v1/kv_cache_interface.py).
    """

    state_bytes: int = 0
    cache_mode: str = "none"
    checkpoint_blocks: int = 0

    @property
    def raw_page_size_bytes(self) -> int:
        return self.state_bytes

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        if self.cache_mode == "all":
            return cdiv(bound.max_model_len, self.block_size) + bound.num_speculative_blocks
        if self.cache_mode == "align":
            return 2 + bound.num_speculative_blocks + self.checkpoint_blocks
        return 1 + bound.num_speculative_blocks


@dataclass(frozen=True)
class UniformType(KVLayerSpec):
    """Same attention type with different per-layer sizes: one group, page = Σ pages (§4.7)."""

    members: tuple[KVLayerSpec, ...] = ()

    @property
    def raw_page_size_bytes(self) -> int:
        return sum(m.page_size_bytes for m in self.members)

    def max_blocks_per_request(self, bound: RequestBound) -> int:
        return max(m.max_blocks_per_request(bound) for m in self.members)


def mamba_state_bytes(
    state: MambaStateSpec, tp: int, conv_dtype_bytes: int, ssm_dtype_bytes: int, num_spec: int = 0
) -> int:
    """Bytes of one layer's recurrent state on one TP rank (vLLM MambaStateShapeCalculator)."""
    k = state.conv_kernel - 1 + num_spec
    v = state.variant
    if v is MambaVariant.MAMBA2:
        ng = state.n_groups + (tp - state.n_groups if state.n_groups % tp else 0)
        conv = (state.intermediate_size + 2 * ng * state.state_size) // tp * k
        ssm = (state.num_heads // tp) * state.head_dim * state.state_size
    elif v is MambaVariant.MAMBA1:
        conv = state.intermediate_size // tp * k
        ssm = state.intermediate_size // tp * state.state_size
    elif v is MambaVariant.GATED_DELTA_NET:
        conv = (
            (2 * state.num_k_heads * state.head_k_dim + state.num_v_heads * state.head_v_dim)
            // tp
            * k
        )
        ssm = (state.num_v_heads // tp) * state.head_v_dim * state.head_k_dim
    elif v is MambaVariant.SHORT_CONV:
        conv = state.intermediate_size // tp * k
        ssm = 0
    elif v is MambaVariant.LINEAR_ATTENTION:
        conv = 0
        ssm = (state.num_heads // tp) * state.head_dim * state.head_dim
    else:  # pragma: no cover - enum is closed
        raise UnsupportedArchitecture(f"Mamba variant {v} has no state shape", "")
    return conv * conv_dtype_bytes + ssm * ssm_dtype_bytes


@dataclass(frozen=True)
class LayerSpecsResult:
    """Per-layer cache specs of the model on one rank plus the block-size decisions."""

    specs: tuple[KVLayerSpec | None, ...]  # one per decoder layer; None: no cache
    block_size: int
    block_size_raised_from: int | None  # hybrid Mamba: the block size before the raise
    mamba_padding_pct: float | None  # "Padding mamba page size by %.2f%%"
    log_lines: tuple[str, ...]


@dataclass(frozen=True)
class CacheFormat:
    """How one rank stores a layer's cache: TP, the model's dtype width, the KV dtype, the era
    and whether the hybrid manager keeps sliding and chunked layers their own specs."""

    tp: int
    model_dtype_bytes: int
    kv_cache_dtype: str
    era: VllmEra
    hybrid_manager: bool = True
    # --mamba-cache-dtype / --mamba-ssm-cache-dtype ("auto": the model dtype / the conv dtype)
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_block_size: int | None = None  # --mamba-block-size: the per-block chunk ('all' mode)
    _heads: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def kv_heads(self, total: int) -> int:
        """KV heads per rank (:func:`kv_heads_per_rank`), computed once per head count."""
        if total not in self._heads:
            self._heads[total] = kv_heads_per_rank(total, self.tp)
        return self._heads[total]


def attention_spec(layer: LayerSpec, bs: int, fmt: CacheFormat) -> KVLayerSpec:
    """The cache spec of one attention layer (MLA, sliding, chunked, cross or full) at block
    size ``bs``."""
    kv_dtype, mbytes, hybrid = fmt.kv_cache_dtype, fmt.model_dtype_bytes, fmt.hybrid_manager
    if layer.kind is AttentionKind.MLA:
        tb = head_token_bytes(kv_dtype, mbytes, layer.head_size)
        if layer.indexer:  # uint8 key plus scales, whatever the KV dtype
            tb = layer.head_size
        elif layer.ds_sparse and (
            kv_dtype in FP8_KV_DTYPES or (kv_dtype == "auto" and fmt.era.ds_mla_fp8_default)
        ):
            tb = DS_MLA_FP8_TOKEN_BYTES
        window = layer.sliding_window if hybrid else None
        return MLA(block_size=bs, token_bytes_=tb, sliding_window=window)
    hk = head_token_bytes(kv_dtype, mbytes, layer.head_size)
    hv = head_token_bytes(kv_dtype, mbytes, layer.head_size_v or layer.head_size)
    n = fmt.kv_heads(layer.num_kv_heads)
    if layer.kind is AttentionKind.SLIDING and hybrid and layer.sliding_window:
        return SlidingWindow(bs, None, n, hk, hv, sliding_window=layer.sliding_window)
    if layer.kind is AttentionKind.CHUNKED and hybrid and layer.attention_chunk_size:
        return ChunkedLocal(bs, None, n, hk, hv, attention_chunk_size=layer.attention_chunk_size)
    if layer.kind is AttentionKind.CROSS:
        return CrossAttention(bs, None, n, hk, hv)
    return FullAttention(bs, None, n, hk, hv)


def mamba_state_sizes(model: ModelSpec, fmt: CacheFormat, num_spec: int = 0) -> dict[int, int]:
    """Each Mamba layer's per-rank state bytes, by layer index.

    Dtypes as vllm 0.32 ``model_executor/layers/mamba/mamba_utils.py``
    (``MambaStateDtypeCalculator``): the conv state in ``mamba_cache_dtype`` (auto: the model
    dtype), the SSM state in ``mamba_ssm_cache_dtype``, else the model's own SSM dtype (set by
    ``model_executor/models/config.py`` only while the flag is auto), else the conv dtype.
    ``num_spec`` speculative tokens widen the conv state (all variants but Mamba1, same file).
    """
    if fmt.mamba_cache_dtype != "auto":
        conv_b = dtype_bytes(fmt.mamba_cache_dtype)
    else:
        conv_b = fmt.model_dtype_bytes
    forced_ssm = fmt.mamba_ssm_cache_dtype != "auto"
    sizes: dict[int, int] = {}
    for i, layer in enumerate(model.layers):
        if layer.kind is not AttentionKind.MAMBA:
            continue
        if layer.mamba is None:
            raise UnsupportedArchitecture(
                f"{model.name}: Mamba layer {i} has no state shapes",
                "the model facts must describe the recurrent state",
            )
        ssm_b = dtype_bytes(layer.mamba.ssm_dtype) if layer.mamba.ssm_dtype else conv_b
        if forced_ssm:
            ssm_b = dtype_bytes(fmt.mamba_ssm_cache_dtype)
        if not fmt.era.mamba_separate_dtypes and fmt.kv_cache_dtype == "auto":
            ssm_b = conv_b
        spec_rows = 0 if layer.mamba.variant is MambaVariant.MAMBA1 else num_spec
        sizes[i] = mamba_state_bytes(layer.mamba, fmt.tp, conv_b, ssm_b, spec_rows)
    return sizes


@dataclass(frozen=True)
class UnifiedBlockSize:
    """The attention block size after a hybrid model's raise, with what vLLM logs about it."""

    block_size: int
    raised_from: int | None
    padding_pct: float | None
    log_lines: tuple[str, ...]


def unify_block_size(
    model: ModelSpec,
    fmt: CacheFormat,
    block_size: int,
    mamba_bytes: dict[int, int],
    mamba_cache_mode: str,
    mla_align: int,
) -> UnifiedBlockSize:
    """Raise the attention block size until an attention page holds the largest Mamba state
    (vLLM's ``unify_hybrid_kv_cache_specs`` and the page-size alignment before it)."""
    era = fmt.era
    if not mamba_bytes:
        return UnifiedBlockSize(block_size, None, None, ())
    attn_layers = [
        ly for ly in model.layers if ly.kind not in (AttentionKind.MAMBA, AttentionKind.NONE)
    ]
    if not attn_layers:
        return UnifiedBlockSize(block_size, None, None, ())
    one = attention_spec(attn_layers[0], 1, fmt)
    a1 = one.page_size_bytes  # attention page of one token
    m = max(mamba_bytes.values())
    if isinstance(one, MLA):
        align = mla_align if era.mamba_align_16 else max(128, mla_align)
    else:
        align = 16 if era.mamba_align_16 else max(16, block_size)
    if mamba_cache_mode == "all":
        # per-block Mamba caching: the block is a multiple of lcm(chunk, alignment),
        # chunk = the model's SSD chunk size (vLLM's fallback 256 when the facts carry
        # none; e.g. Nemotron-H and Falcon-H1 publish 128 or 256)
        chunks = [
            ly.mamba.mamba_chunk_size
            for ly in model.layers
            if ly.mamba is not None and ly.mamba.mamba_chunk_size
        ]
        chunk = math.lcm(fmt.mamba_block_size or (max(chunks) if chunks else 256), align)
        needed = chunk * cdiv(cdiv(m, a1), chunk)
    else:
        needed = align * cdiv(m, align * a1)
    logs: list[str] = []
    bs, raised_from, padding_pct = block_size, None, None
    if bs < needed:
        raised_from, bs = bs, needed
        logs.append(
            f"Setting attention block size to {bs} tokens to ensure that attention page "
            "size is >= mamba page size."
        )
    attn_page = bs * a1
    if attn_page != m:
        padding_pct = (attn_page - m) / m * 100
        logs.append(
            f"Padding mamba page size by {padding_pct:.2f}% to ensure that mamba page size "
            "and attention page size are exactly equal."
        )
    return UnifiedBlockSize(bs, raised_from, padding_pct, tuple(logs))


def pad_mamba_pages(specs: list[KVLayerSpec | None]) -> list[KVLayerSpec | None]:
    """Pad every Mamba page to the largest attention page (one page size for all groups)."""
    attn_pages = [s.page_size_bytes for s in specs if s is not None and not isinstance(s, Mamba)]
    if not attn_pages or not any(isinstance(s, Mamba) for s in specs):
        return specs
    target = max(attn_pages)
    return [
        replace(s, page_size_padded=target)
        if isinstance(s, Mamba) and s.raw_page_size_bytes != target
        else s
        for s in specs
    ]


@lru_cache(maxsize=256)  # pure: a plan's search asks for the same model's specs on every GPU
def build_layer_specs(
    model: ModelSpec,
    *,
    tp: int,
    model_dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    era: VllmEra,
    hybrid_manager: bool = True,
    mamba_cache_mode: str = "none",
    mla_align: int = 64,
    mamba_dtypes: tuple[str, str] = ("auto", "auto"),
    mamba_block_size: int | None = None,
    num_speculative_tokens: int = 0,
) -> LayerSpecsResult:
    """Build vLLM's per-layer KV specs for one TP rank, unifying hybrid Mamba pages (§4.6).

    ``block_size`` is the attention block size before any hybrid raise. With the hybrid manager
    off, sliding-window and chunked layers become full attention (allocate for full length).
    """
    fmt = CacheFormat(
        tp,
        dtype_bytes(model_dtype),
        kv_cache_dtype,
        era,
        hybrid_manager,
        mamba_cache_dtype=mamba_dtypes[0],
        mamba_ssm_cache_dtype=mamba_dtypes[1],
        mamba_block_size=mamba_block_size,
    )
    has_mamba = any(layer.kind is AttentionKind.MAMBA for layer in model.layers)
    mamba_bytes = mamba_state_sizes(model, fmt, num_speculative_tokens) if has_mamba else {}
    unified = unify_block_size(model, fmt, block_size, mamba_bytes, mamba_cache_mode, mla_align)
    bs = unified.block_size
    specs: list[KVLayerSpec | None] = []
    for i, layer in enumerate(model.layers):
        if layer.kind is AttentionKind.NONE:
            specs.append(None)
        elif layer.kind is AttentionKind.MAMBA:
            # Mamba groups use max_model_len as block size with mode none; the block count per
            # request does not depend on it, so the attention block size is kept for 'all'.
            mamba = layer.mamba
            ckpt = int(mamba is not None and mamba.variant in era.mamba_checkpoint_variants)
            specs.append(
                Mamba(
                    block_size=bs,
                    state_bytes=mamba_bytes[i],
                    cache_mode=mamba_cache_mode,
                    checkpoint_blocks=ckpt,
                )
            )
        else:
            specs.append(attention_spec(layer, bs, fmt))
    if has_mamba:
        specs = pad_mamba_pages(specs)
    shared: dict[KVLayerSpec, KVLayerSpec] = {}  # one object per distinct spec: grouping compares
    specs = [None if s is None else shared.setdefault(s, s) for s in specs]
    return LayerSpecsResult(
        tuple(specs), bs, unified.raised_from, unified.padding_pct, unified.log_lines
    )


# --------------------------------------------------------------------------------------------
# Grouping (§5.1) and bytes per block (§5.2)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: layers sharing one block table."""

    spec: KVLayerSpec
    layers: tuple[int, ...]  # decoder-layer indices in this group (on this rank)

    @property
    def num_layers(self) -> int:
        return len(self.layers)


@dataclass(frozen=True)
class KVLayout:
    """Grouping result for one rank: groups, bytes per block, warnings vLLM prints."""

    groups: tuple[KVGroup, ...]
    bytes_per_block: int
    padding_warnings: tuple[str, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def min_block_size(self) -> int:
        """Smallest block size over attention groups (Mamba groups excluded, §6)."""
        sizes = [g.spec.block_size for g in self.groups if not isinstance(g.spec, Mamba)]
        if not sizes:
            sizes = [g.spec.block_size for g in self.groups]
        return min(sizes) if sizes else 0

    def blocks_per_request(self, bound: RequestBound) -> int:
        """Σ over groups of the blocks one maximal request needs (n in §6)."""
        return sum(g.spec.max_blocks_per_request(bound) for g in self.groups)

    def needed_bytes(self, bound: RequestBound) -> int:
        """Memory one request at ``bound.max_model_len`` needs (§7.1, 0.17+ form)."""
        return self.bytes_per_block * self.blocks_per_request(bound)


def _uniform_type_ok(specs: list[KVLayerSpec]) -> bool:
    kinds = {type(s) for s in specs}
    if len(kinds) != 1 or len({s.block_size for s in specs}) != 1:
        return False
    first = specs[0]
    if isinstance(first, SlidingWindow):
        return len({s.sliding_window for s in specs if isinstance(s, SlidingWindow)}) == 1
    if isinstance(first, ChunkedLocal):
        return len({s.attention_chunk_size for s in specs if isinstance(s, ChunkedLocal)}) == 1
    return isinstance(first, FullAttention | MLA) and not isinstance(first, Mamba)


def group_layers(specs: list[tuple[int, KVLayerSpec]], era: VllmEra) -> KVLayout:
    """Group (layer index, spec) pairs the way vLLM's ``get_kv_cache_groups`` does (§5.1, §4.7).

    Raises :class:`UnsupportedArchitecture` when the page sizes cannot be unified.
    """
    if not specs:
        return KVLayout((), 0)
    only = [s for _, s in specs]
    idx = tuple(i for i, _ in specs)
    if all(s is only[0] or s == only[0] for s in only):
        return KVLayout((KVGroup(only[0], idx),), only[0].page_size_bytes * len(only))
    if era.uniform_type_groups and _uniform_type_ok(only):
        ut = UniformType(block_size=only[0].block_size, members=tuple(only))
        return KVLayout((KVGroup(ut, idx),), ut.page_size_bytes)

    # Hybrid: unify page sizes (§4.7), then bucket by equal spec.
    max_page = max(s.page_size_bytes for s in only)
    buckets: dict[KVLayerSpec, list[int]] = {}
    for i, s in specs:
        p = s.page_size_bytes
        if p == max_page:
            u = s
        elif isinstance(s, Mamba):
            u = replace(s, page_size_padded=max_page)
        elif max_page % p == 0:
            u = replace(s, block_size=s.block_size * (max_page // p))
        elif isinstance(s, FullAttention) and era.full_attention_page_padding:
            u = replace(s, page_size_padded=max_page)
        else:
            raise UnsupportedArchitecture(
                f"layer page sizes {p} and {max_page} bytes cannot be unified in vLLM {era.label}",
                "this hybrid layout is not supported by that vLLM release",
            )
        buckets.setdefault(u, []).append(i)
    counts = [len(v) for v in buckets.values()]
    group_size = min(counts)
    if era.group_rule_1_5 and max(counts) < group_size * 1.5:
        group_size = max(counts)
    groups: list[KVGroup] = []
    warnings: list[str] = []
    for spec, members in buckets.items():
        n = len(members)
        padding = group_size - n % group_size
        if padding != group_size:
            warnings.append(
                f"Add {padding} padding layers, may waste at most "
                f"{padding / n * 100:.2f}% KV cache memory"
            )
        num = cdiv(n, group_size)
        for g in range(num):
            if era.strided_grouping:
                part = tuple(members[g::num])
            else:
                part = tuple(members[g * group_size : (g + 1) * group_size])
            groups.append(KVGroup(spec, part))
    return KVLayout(tuple(groups), max_page * group_size, tuple(warnings))


def state_entry_layer(model: ModelSpec) -> tuple[int, ...]:
    """Decoder layer of each entry of ``model.layers``.

    ``ModelSpec.layers`` may be longer than ``num_layers``: Falcon-H1 lists two state entries
    per decoder layer (attention, then Mamba2). Entries are spread evenly, in order, over the
    decoder layers, so a pipeline stage owns the entries of its layers.
    """
    n_entries, n_layers = len(model.layers), max(1, model.num_layers)
    if n_entries == n_layers:
        return tuple(range(n_entries))
    return tuple(min(n_layers - 1, i * n_layers // n_entries) for i in range(n_entries))


def stage_state_indices(model: ModelSpec, stage_layers: range) -> frozenset[int]:
    """Indices into ``model.layers`` that belong to the decoder layers ``stage_layers``."""
    owner = state_entry_layer(model)
    return frozenset(i for i, layer in enumerate(owner) if layer in stage_layers)


def project_layout(global_layout: KVLayout, stage_layers: Collection[int]) -> KVLayout:
    """The global groups projected onto one pipeline stage's layers (vLLM 0.17+, §7.1).

    ``stage_layers`` are indices into ``ModelSpec.layers`` (state entries, see
    :func:`stage_state_indices`). Bytes per block is the largest per-group sum of member pages
    on this stage. Without PP (all layers on the stage) the layout is returned unchanged.
    """
    if not global_layout.groups:
        return global_layout
    everything = {i for g in global_layout.groups for i in g.layers}
    stage_set = set(stage_layers)
    if everything <= stage_set:
        return global_layout
    stage_layers = stage_set
    groups = []
    for g in global_layout.groups:
        mine = tuple(i for i in g.layers if i in stage_layers)
        spec = g.spec
        if isinstance(spec, UniformType) and mine:
            pos = {layer: k for k, layer in enumerate(g.layers)}
            spec = replace(spec, members=tuple(spec.members[pos[i]] for i in mine))
        groups.append(KVGroup(spec, mine))
    if len(groups) == 1 and isinstance(groups[0].spec, UniformType):
        bpb = groups[0].spec.page_size_bytes
    else:
        page = max(g.spec.page_size_bytes for g in groups)
        bpb = page * max(g.num_layers for g in groups)
    return KVLayout(tuple(groups), bpb, global_layout.padding_warnings)


# --------------------------------------------------------------------------------------------
# Capacity (§5.2, §6) and the fit check (§7)
# --------------------------------------------------------------------------------------------


def num_blocks(available_bytes: int, layout: KVLayout, override: int | None = None) -> int:
    """Blocks the pool gets: ``available // bytes_per_block`` (floored at 0), or the override."""
    if not layout.groups:
        return 1  # attention-free: the null block only
    if override is not None:
        return override
    return max(0, available_bytes // layout.bytes_per_block)


def max_concurrency(blocks: int, layout: KVLayout, bound: RequestBound) -> float:
    """``B / Σ_g n_g``: how many maximal requests fit (float, logged with ``%.2f``)."""
    n = layout.blocks_per_request(bound)
    return blocks / n if n else 0.0


def kv_cache_tokens(blocks: int, layout: KVLayout, bound: RequestBound, era: VllmEra) -> int:
    """The "KV cache size: N tokens" number of this era (§6).

    ≤0.20: ``(B // num_groups) × min_block_size``; 0.21+: ``int(B / n × L)`` in IEEE doubles.
    """
    if not layout.groups:
        return 0
    if era.tokens_formula == "blocks_per_group":
        return (blocks // layout.num_groups) * layout.min_block_size * bound.log_tokens_factor
    n = layout.blocks_per_request(bound)
    return int(blocks / n * bound.max_model_len) if n else 0


def needed_bytes(
    layout: KVLayout, bound: RequestBound, era: VllmEra, specs: list[KVLayerSpec]
) -> int:
    """KV bytes one request at ``bound.max_model_len`` needs, as this era's fit check counts."""
    if era.fit_check_groups == "layers":
        return sum(s.max_memory_usage_bytes(bound) for s in specs)
    return layout.needed_bytes(bound)


def estimate_max_model_len(
    layout: KVLayout,
    bound: RequestBound,
    available_bytes: int,
    era: VllmEra,
    specs: list[KVLayerSpec],
) -> int:
    """Binary search for the largest length in [1, L] whose needed bytes fit (0: not even 1)."""

    def fits(length: int) -> bool:
        return (
            needed_bytes(layout, replace(bound, max_model_len=length), era, specs)
            <= available_bytes
        )

    if not fits(1):
        return 0
    left, right, result = 1, bound.max_model_len, 1
    while left <= right:
        mid = (left + right) // 2
        if fits(mid):
            result, left = mid, mid + 1
        else:
            right = mid - 1
    return result


def check_memory_bytes(available_bytes: int, layout: KVLayout, era: VllmEra) -> int:
    """Memory the fit check compares against: minus the null block from 0.29 (§7.1)."""
    if era.fit_check_null_block and layout.groups:
        return available_bytes - layout.bytes_per_block
    return available_bytes


def v0_cache_block_bytes(
    model: ModelSpec,
    *,
    tp: int,
    model_dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    num_layers: int,
) -> int:
    """V0 engine block: ``bs × layers × 2 × kv_heads_per_rank × head × dtype`` (§5.4)."""
    mbytes = dtype_bytes(model_dtype)
    attn = [
        layer
        for layer in model.layers
        if layer.kind not in (AttentionKind.NONE, AttentionKind.MAMBA)
    ]
    if attn and attn[0].kind is AttentionKind.MLA:
        per_token = head_token_bytes(kv_cache_dtype, mbytes, attn[0].head_size)
        return block_size * num_layers * per_token
    heads = kv_heads_per_rank(model.num_kv_heads, tp)
    per_head = head_token_bytes(kv_cache_dtype, mbytes, model.head_size)
    return block_size * num_layers * 2 * heads * per_head
