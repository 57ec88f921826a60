"""Weight bytes per rank: what "Model loading took X GiB" will say (§2.2, §8).

Parameters come as :class:`~oomguard.memory.spec.ParamGroup` values; each group is split by its
sharding (TP, vocab-parallel padded to 64, replicated, experts by TP or EP, K/V replicated when
tp > KV heads), placed on pipeline stages, and priced by the checkpoint's quantization format.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.errors import BadInput
from oomguard.memory.dtypes import SAFETENSORS_DTYPE_BYTES, dtype_bytes
from oomguard.memory.spec import ModelSpec, ParamGroup, ParamSharding, QuantSpec, RopeCache

VOCAB_PADDING = 64  # vLLM DEFAULT_VOCAB_PADDING_SIZE


def resolve_model_dtype(model: ModelSpec, dtype: str, compute_capability: str = "") -> str:
    """The dtype vLLM loads the model in: ``auto`` keeps bf16/fp16, turns fp32 into bf16.

    GPUs without bf16 (compute capability < 8.0, e.g. T4/V100) fall back to float16.
    """
    if dtype != "auto":
        name = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32"}.get(
            dtype, dtype
        )
        dtype_bytes(name)
        return name
    resolved = model.dtype if model.dtype in ("bfloat16", "float16") else "bfloat16"
    if resolved == "bfloat16" and compute_capability:
        try:
            if float(compute_capability) < 8.0:
                return "float16"
        except ValueError:
            pass
    return resolved


def pp_layer_ranges(num_layers: int, pp: int) -> list[range]:
    """Decoder layers of each pipeline stage, split like vLLM's ``get_pp_indices``.

    Remainder layers go to the stages before the last, counted from the back.
    """
    if pp < 1:
        raise BadInput(f"pipeline parallel size {pp} is not positive", "use 1 or more")
    if pp > num_layers:
        raise BadInput(
            f"pipeline parallel size {pp} exceeds the model's {num_layers} layers",
            "use a smaller --pipeline-parallel-size",
        )
    per = num_layers // pp
    parts = [per] * pp
    remaining = num_layers % pp
    for i in range(2, remaining + 2):
        parts[-i] += 1
    ranges, start = [], 0
    for n in parts:
        ranges.append(range(start, start + n))
        start += n
    return ranges


def quantized_bytes_per_element(quant: QuantSpec, hidden_size: int) -> float:
    """Bytes per weight element of a linear layer in this format, scales and zeros included (§8)."""
    method = (quant.method or "").lower().replace("-", "_")
    g = quant.group_size or 128
    bits = quant.weight_bits
    if method in ("fp8", "fbgemm_fp8", "modelopt", "modelopt_fp8", "ptpc_fp8") or (
        method == "compressed_tensors" and bits == 8 and quant.scale_granularity != "group"
    ):
        if quant.scale_granularity == "channel":
            return 1 + 4 / hidden_size
        if quant.scale_granularity == "block":
            return 1 + 4 / (128 * 128)
        return 1.0
    if method in ("awq", "awq_marlin"):
        return bits / 8 + (bits / 8) / g + 2 / g  # qweight + qzeros + fp16 scales
    if method in ("gptq", "gptq_marlin", "auto_round", "autoround"):
        zeros = (bits / 8) / g if quant.zero_point or method == "gptq" else 0.0
        g_idx = 4 / hidden_size if quant.desc_act else 0.0
        return bits / 8 + 2 / g + zeros + g_idx
    if method == "compressed_tensors":
        if bits == 4:
            return 0.5 + 2 / g + (0.5 / g if quant.zero_point else 0.0)
        return bits / 8 + 4 / hidden_size
    if method in ("bitsandbytes", "bnb"):
        if bits == 8:
            return 1 + 4 / hidden_size
        return 0.5 + 1 / 64 + 4 / (64 * 256)  # nf4 with double-quantised absmax
    if method == "mxfp4":
        return 0.5 + 1 / 32
    if method in ("nvfp4", "modelopt_fp4"):
        return 0.5 + 1 / 16
    if method == "gguf":
        bpw = quant.gguf_bits_per_weight or 4.5
        return bpw / 8
    if method in ("int8", "w8a8", "smoothquant"):
        return 1 + 4 / hidden_size
    if bits < 16:
        return bits / 8
    raise BadInput(
        f"quantization {quant.method!r} is not known to the weight model",
        "use fp8, awq, gptq, compressed-tensors, bitsandbytes, mxfp4, nvfp4 or gguf",
    )


def mxfp4_expert_padding(
    hidden_size: int,
    intermediate_size: int,
    *,
    shards: int = 1,
    pad_intermediate: bool = True,
    expert_parallel: bool = False,
) -> float:
    """Factor by which the mxfp4 MoE kernels' padding grows one rank's expert bytes (§8).

    vLLM rounds the *per-partition* intermediate size (``intermediate / tp``) and the hidden
    size before creating the expert tensors (vllm 0.32
    ``model_executor/layers/quantization/mxfp4.py`` ``maybe_roundup_sizes`` →
    ``fused_moe/oracle/mxfp4.py`` ``mxfp4_round_up_hidden_size_and_intermediate_size``). The
    Marlin / TRT-LLM rule (intermediate to 128, hidden to 256) is used: it matches the logged
    loads of gpt-oss on A100 (Marlin) and H100 at TP=1; 0.11 and older did not round the
    intermediate size (the logged 0.11 load fits hidden-only padding). With expert
    parallelism each rank holds whole experts, so the intermediate size is not split.
    """
    h2 = -(-hidden_size // 256) * 256
    per_rank = intermediate_size if expert_parallel else intermediate_size / shards
    i_rank = int(per_rank)
    i2 = -(-i_rank // 128) * 128 if pad_intermediate else i_rank
    return (h2 / hidden_size) * (i2 / per_rank) if per_rank else 1.0


@dataclass(frozen=True)
class WeightBreakdown:
    """Weight bytes of each pipeline stage (per TP rank) and how they were computed."""

    per_stage_bytes: tuple[int, ...]
    basis: str

    @property
    def max_bytes(self) -> int:
        """The most loaded rank's weights."""
        return max(self.per_stage_bytes)


def _elements_on_rank(group: ParamGroup, model: ModelSpec, tp: int, ep: int) -> float:
    s = group.sharding
    if s is ParamSharding.REPLICATED:
        return float(group.count)
    if s is ParamSharding.VOCAB:
        if group.rows and group.cols:
            padded = -(-group.rows // VOCAB_PADDING) * VOCAB_PADDING
            per_rank_rows = -(-padded // tp)
            return float(per_rank_rows * group.cols)
        return group.count / tp
    if s is ParamSharding.EXPERTS:
        return group.count / (ep if ep > 1 else tp)
    if s is ParamSharding.KV_REPLICATED:
        kv = max(1, model.num_kv_heads)
        per_rank_heads = max(1, kv // tp)
        return group.count * per_rank_heads / kv
    return group.count / tp


# Model types whose dense MLP layers come first and MoE layers after (config
# ``first_k_dense_replace``: DeepSeek V2/V3/R1, Kimi-K2/VL, GLM-4.5 MoE). Interleaved layouts
# (Llama-4 ``interleave_moe_layer_step``, Jamba ``expert_layer_period``) spread evenly.
FIRST_K_DENSE_MODEL_TYPES = frozenset(
    {"deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_vl", "glm4_moe", "deepseek_vl_v2"}
)
_MOE_GROUPS = frozenset({"experts", "shared_experts", "router"})


def _stage_share(model: ModelSpec, group_name: str, layers: range) -> float:
    """Fraction of a per-layer group's elements held by the stage owning ``layers``.

    Evenly spread, except for first-k-dense MoE models: their expert/router groups live on the
    last ``num_moe_layers`` layers and their dense ``mlp`` on the first ones, so with pipeline
    parallelism the first stage holds less and the later ones more (vLLM's ``get_pp_indices``
    splits by layer count, not by bytes).
    """
    moe = model.moe
    n = model.num_layers
    if (
        moe is None
        or model.model_type not in FIRST_K_DENSE_MODEL_TYPES
        or not 0 < moe.num_moe_layers < n
        or (group_name not in _MOE_GROUPS and group_name != "mlp")
        or not any(g.name == "experts" for g in model.params)  # "mlp" would hold every layer
    ):
        return len(layers) / n
    first_moe = n - moe.num_moe_layers
    moe_here = sum(1 for i in layers if i >= first_moe)
    if group_name in _MOE_GROUPS:
        return moe_here / moe.num_moe_layers
    return (len(layers) - moe_here) / first_moe


def _served_quant(model: ModelSpec, quantization: str | None) -> QuantSpec:
    """The checkpoint's format, or fp8 when an online fp8 method quantizes an unquantized one."""
    online = (quantization or "").lower()
    if model.quant.method is None and online in ("fp8", "ptpc_fp8", "fbgemm_fp8"):
        return QuantSpec(method="fp8", weight_bits=8, scale_granularity="tensor")
    return model.quant


def _expert_padding(
    model: ModelSpec, quant: QuantSpec, tp: int, ep: int, pad_intermediate: bool
) -> float:
    """gpt-oss's MXFP4 experts are padded per shard; every other model: 1."""
    mxfp4 = (quant.method or "").lower() == "mxfp4"
    if not mxfp4 or model.moe is None or model.model_type != "gpt_oss":
        return 1.0
    return mxfp4_expert_padding(
        model.hidden_size,
        model.moe.expert_intermediate_size,
        shards=ep if ep > 1 else tp,
        pad_intermediate=pad_intermediate,
        expert_parallel=ep > 1,
    )


def _on_stage(
    group: ParamGroup, model: ModelSpec, first: bool, last: bool, has_lm_head: bool
) -> bool:
    """Whether a first- or last-stage group is held by this stage (a tied embedding is held
    by the last stage too, as its LM head)."""
    if group.stage == "first" and not first:
        return last and group.name == "embed" and model.tie_word_embeddings and not has_lm_head
    return not (group.stage == "last" and not last)


def _is_quantized(group: ParamGroup, quant: QuantSpec) -> bool:
    method = (quant.method or "").lower()
    if group.name in ("lm_head", "embed") and method not in ("gguf",):
        return False  # vLLM keeps the (vocab-parallel) LM head and embedding in model dtype
    if method == "mxfp4" and group.name != "experts":
        return False
    quantizable = group.quantizable and quant.method is not None
    return quantizable and group.name not in quant.unquantized_groups


def _checkpoint_ratio(model: ModelSpec, quant: QuantSpec) -> float | None:
    """Checkpoint elements over counted parameters, for an unquantized model with byte counts."""
    ckpt = model.checkpoint_bytes_by_dtype
    if not ckpt or quant.method is not None or not model.total_params:
        return None
    # "ALL": total bytes without a dtype split (safetensors index); price it at the
    # checkpoint's own dtype (config torch_dtype, float32 when absent)
    ckpt_dtype_bytes = SAFETENSORS_DTYPE_BYTES.get(
        {"float32": "F32", "float16": "F16"}.get(model.dtype, "BF16"), 2
    )
    ckpt_elems = sum(
        v / SAFETENSORS_DTYPE_BYTES.get(k.upper(), ckpt_dtype_bytes) for k, v in ckpt.items()
    )
    return ckpt_elems / model.total_params


def rope_cache_bytes(model: ModelSpec, model_dtype: str) -> int:
    """Bytes of vLLM's rotary cos/sin caches on one rank: positions × rotary dim per instance.

    Each cache is a buffer of ``[positions, rotary_dim]`` in the dtype the rope was built with,
    the model dtype unless the model asks for another
    (vllm/model_executor/layers/rotary_embedding/base.py, ``cos_sin_cache``).
    """
    caches = model.rope_caches
    if caches is None:
        caches = (RopeCache(model.derived_max_model_len, model.head_size),)
    return sum(c.positions * c.rotary_dim * dtype_bytes(c.dtype or model_dtype) for c in caches)


def weight_bytes_per_stage(
    model: ModelSpec,
    *,
    model_dtype: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    quantization: str | None = None,
    cpu_offload_bytes: int = 0,
    pad_intermediate: bool = True,
    load_mtp: bool = False,
) -> WeightBreakdown:
    """Bytes of parameters and buffers one rank of each pipeline stage holds after loading.

    ``ep`` > 1 splits expert groups by ``ep`` instead of ``tp`` (expert parallelism spans
    TP × DP ranks). ``quantization`` names an online method (``fp8``) applied to an unquantized
    checkpoint. ``cpu_offload_bytes`` is subtracted per rank (``--cpu-offload-gb``). The
    checkpoint's multi-token-prediction layers (group ``mtp``) are skipped by vLLM's loader
    unless an MTP speculative method runs (``load_mtp``).
    """
    mbytes = dtype_bytes(model_dtype)
    quant = _served_quant(model, quantization)
    q_bytes = (
        quantized_bytes_per_element(quant, model.hidden_size) if quant.method else float(mbytes)
    )
    expert_pad = _expert_padding(model, quant, tp, ep, pad_intermediate)
    has_lm_head = any(g.name == "lm_head" for g in model.params)
    per_stage = []
    for stage, layers in enumerate(pp_layer_ranges(model.num_layers, pp)):
        total = 0.0
        first, last = stage == 0, stage == pp - 1
        for group in model.params:
            if group.name == "mtp" and not load_mtp:
                continue
            elems = _elements_on_rank(group, model, tp, ep)
            if group.per_layer and group.stage == "layers":
                elems *= _stage_share(model, group.name, layers)
            elif not _on_stage(group, model, first, last, has_lm_head):
                continue
            quantized = _is_quantized(group, quant)
            if quantized and group.name == "experts":
                elems *= expert_pad
            total += elems * (q_bytes if quantized else float(mbytes))
        if first or last:
            total += rope_cache_bytes(model, model_dtype)
        per_stage.append(max(0, int(total) - cpu_offload_bytes))
    basis = "parameters by group"
    if quant.method:
        basis += f", {quant.method} {q_bytes:.4f} B/elem"
    # Cross-check against the checkpoint's own bytes when the model is unquantized.
    ratio = _checkpoint_ratio(model, quant)
    if ratio is not None and 0.97 <= ratio <= 1.03:
        per_stage = [int(b * ratio) for b in per_stage]
        basis += f", scaled by checkpoint element count ({ratio:.4f})"
    elif ratio is not None:
        basis += f" (checkpoint elements differ by {100 * (ratio - 1):+.1f}%: not used)"
    return WeightBreakdown(tuple(per_stage), basis)
