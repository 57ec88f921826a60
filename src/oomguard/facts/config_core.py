"""Readers for the established families: Llama-style dense decoders, OPT and Phi, the MoE
families (Mixtral, Qwen-MoE, DeepSeek V2/V3/V3.2, gpt-oss, Llama 4, Granite-MoE, PhiMoE), the
hybrids (Jamba, Nemotron-H, Falcon-H1, Granite 4, Qwen3-Next, Kimi Linear), their vision towers
and the mllama text model.

Each reader counts the parameters of the modules vLLM builds for the model
(``vllm/model_executor/models/*.py``) into an :class:`~oomguard.facts.config_parts.Acc` and
lists each decoder layer's state (``vllm/v1/kv_cache_interface.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from oomguard.errors import UnsupportedArchitecture
from oomguard.facts.config_parts import (
    Acc,
    Cfg,
    add_attention,
    add_full_attention,
    attn_layer,
    dense_core,
    gated_mlp,
    head_dim_of,
    linear,
    plain_mlp,
    sliding_layers,
    vision_cfg,
    vit_block,
    vit_dims,
)
from oomguard.memory.spec import (
    AttentionKind,
    LayerSpec,
    MambaStateSpec,
    MambaVariant,
    MoESpec,
    VisionSpec,
)

# --------------------------------------------------------------------------------------------
# dense families


def read_llama_like(c: Cfg, acc: Acc, model_type: str) -> None:
    """Llama, Mistral, Qwen2/3, Granite, Gemma 1/2/3, Phi-3/4, InternLM-style dense decoders."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    inter = c.int("intermediate_size")
    attention_bias = bool(c.get("attention_bias", False))
    qkv_bias = model_type in ("qwen2", "qwen2_vl", "qwen2_5_vl") or attention_bias
    o_bias = attention_bias and model_type not in ("qwen2",)
    qk_norm = model_type in ("qwen3", "gemma3", "gemma3_text")
    if model_type == "olmo2":  # q_norm / k_norm span the whole projection, not one head
        acc.add("norm", n_layers * (heads + kv_heads) * hd)
    norms_per_layer = 4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2
    mlp_bias = bool(c.get("mlp_bias", False))
    for _ in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=qkv_bias,
            kv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
        )
        acc.add("mlp", gated_mlp(hidden, inter, mlp_bias))
        acc.add("norm", norms_per_layer * hidden)
    acc.add("norm", hidden)
    pattern: Callable[[int], bool] | None = None
    if model_type == "gemma2":
        pattern = lambda i: (i + 1) % 2 != 0  # noqa: E731  even layers slide
    elif model_type in ("gemma3", "gemma3_text"):
        every = c.int("sliding_window_pattern", 6)
        pattern = lambda i: (i + 1) % every != 0  # noqa: E731
    acc.layers = sliding_layers(c, n_layers, kv_heads, hd, pattern)


def read_phi(c: Cfg, acc: Acc) -> None:
    """Phi-1/1.5/2: parallel attention + MLP block, biases everywhere, one LayerNorm per layer."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    inter = c.int("intermediate_size")
    for _ in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=True,
            kv_bias=True,
            o_bias=True,
        )
        acc.add("mlp", plain_mlp(hidden, inter, True))
        acc.add("norm", 2 * hidden)
    acc.add("norm", 2 * hidden)
    acc.add("lm_head", c.int("vocab_size"))  # lm_head bias
    acc.layers = [attn_layer(AttentionKind.FULL, kv_heads, hd) for _ in range(n_layers)]


def read_opt(c: Cfg, acc: Acc) -> None:
    """OPT: learned positions (+2 offset), biases, LayerNorms; optional 350m-style projections."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    inter = c.int("ffn_dim")
    bias = bool(c.get("enable_bias", True))
    for _ in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=bias,
            kv_bias=bias,
            o_bias=bias,
        )
        acc.add("mlp", plain_mlp(hidden, inter, bias))
        acc.add("norm", 4 * hidden if c.get("layer_norm_elementwise_affine", True) else 0)
    acc.add("pos_embed", (c.int("max_position_embeddings") + 2) * hidden)
    proj = c.int("word_embed_proj_dim", hidden)
    acc.embed_cols = proj  # the embedding and lm_head are vocab x word_embed_proj_dim
    if proj != hidden:
        acc.add("mlp", 2 * proj * hidden)  # project_in / project_out
    if c.get("do_layer_norm_before", True) and proj == hidden:
        acc.add("norm", 2 * hidden)
    acc.layers = [attn_layer(AttentionKind.FULL, kv_heads, hd) for _ in range(n_layers)]


# --------------------------------------------------------------------------------------------
# MoE families


def _moe_layer_indices(c: Cfg, n_layers: int) -> list[bool]:
    """Which layers are sparse for Qwen-MoE style configs (decoder_sparse_step, mlp_only_layers)."""
    step = c.int("decoder_sparse_step", 1)
    mlp_only = set(c.get("mlp_only_layers", []) or [])
    n_exp = c.int("num_experts")
    return [
        (i not in mlp_only) and n_exp > 0 and step > 0 and (i + 1) % step == 0
        for i in range(n_layers)
    ]


def read_mixtral(c: Cfg, acc: Acc) -> None:
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    n_exp, topk, inter = (
        int(v) for v in c.req("num_local_experts", "num_experts_per_tok", "intermediate_size")
    )
    for _ in range(n_layers):
        add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd)
        acc.add("router", hidden * n_exp)
        acc.add("experts", n_exp * gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_layers)
    acc.layers = sliding_layers(c, n_layers, kv_heads, hd, None)


def read_qwen_moe(c: Cfg, acc: Acc, model_type: str) -> None:
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    n_exp, topk, moe_inter = (
        int(v) for v in c.req("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    )
    inter = c.int("intermediate_size", 0)
    shared_inter = c.int("shared_expert_intermediate_size", 0)
    is_q2 = model_type == "qwen2_moe"
    sparse = _moe_layer_indices(c, n_layers)
    for i in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=is_q2 or bool(c.get("attention_bias")),
            kv_bias=is_q2 or bool(c.get("attention_bias")),
            qk_norm=not is_q2,
        )
        if sparse[i]:
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * gated_mlp(hidden, moe_inter))
            if shared_inter:
                acc.add("shared_experts", gated_mlp(hidden, shared_inter))
                acc.add("router", hidden)  # shared_expert_gate
        else:
            acc.add("mlp", gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, moe_inter, 1 if shared_inter else 0, shared_inter, sum(sparse))
    acc.layers = sliding_layers(c, n_layers, kv_heads, hd, None)


def _mla_dims(c: Cfg) -> tuple[int | None, int, int, int, int]:
    kv_lora, nope, rope, v_dim = (
        int(v) for v in c.req("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    q_lora = c.get("q_lora_rank")
    return (int(q_lora) if q_lora else None), kv_lora, nope, rope, v_dim


def _add_mla(acc: Acc, c: Cfg, hidden: int, heads: int) -> LayerSpec:
    """DeepSeek MLA projections; returns the layer's latent-cache state (576 for V3)."""
    q_lora, kv_lora, nope, rope, v_dim = _mla_dims(c)
    qk = nope + rope
    if q_lora:
        acc.add("attn_qo", hidden * q_lora + q_lora * heads * qk)
        acc.add("norm", q_lora)
    else:
        acc.add("attn_qo", hidden * heads * qk)
    acc.add("attn_qo", hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim))
    acc.add("attn_qo", heads * v_dim * hidden)
    acc.add("norm", kv_lora)
    acc.rope_head = rope  # get_rope(qk_rope_head_dim, ...) (vllm models/deepseek_v2.py)
    return LayerSpec(kind=AttentionKind.MLA, num_kv_heads=1, head_size=kv_lora + rope)


def _deepseek_moe_layer(c: Cfg, i: int) -> bool:
    n_exp = c.get("n_routed_experts") or c.get("num_experts")
    if not n_exp:
        return False
    first_dense = c.int("first_k_dense_replace", 0)
    freq = c.int("moe_layer_freq", 1)
    return i >= first_dense and i % freq == 0


def _add_deepseek_ffn(acc: Acc, c: Cfg, hidden: int, i: int, *, into: str | None = None) -> None:
    def put(group: str, n: int) -> None:
        acc.add(into or group, n)

    if _deepseek_moe_layer(c, i):
        n_exp = int(c.get("n_routed_experts") or c.get("num_experts"))
        moe_inter = c.int("moe_intermediate_size")
        n_shared = c.int("n_shared_experts", c.int("num_shared_experts", 0))
        put("router", hidden * n_exp)
        if c.get("topk_method") == "noaux_tc" or c.get("moe_router_activation_func") == "sigmoid":
            put("router", n_exp)  # e_score_correction_bias
        put("experts", n_exp * gated_mlp(hidden, moe_inter))
        if n_shared:
            put("shared_experts", gated_mlp(hidden, moe_inter * n_shared))
    else:
        put("mlp", gated_mlp(hidden, c.int("intermediate_size")))


def read_deepseek(c: Cfg, acc: Acc, vocab: int) -> None:
    """DeepSeek V2/V2.5/V3/R1, Kimi-K2 (MLA + MoE, optional MTP layers)."""
    hidden, n_layers, heads = (
        int(v) for v in c.req("hidden_size", "num_hidden_layers", "num_attention_heads")
    )
    n_exp = int(c.get("n_routed_experts") or 0)
    if not c.has("kv_lora_rank"):
        raise UnsupportedArchitecture(
            f"{c.arch}: DeepSeek config without kv_lora_rank (DeepSeek-V1 style "
            "MHA) is not supported",
            "use a DeepSeek V2/V3 config (kv_lora_rank, qk_rope_head_dim, ...)",
        )
    sparse = c.has("index_topk")  # DeepSeek-V3.2: sparse MLA plus a lightning indexer
    state: LayerSpec | None = None
    for i in range(n_layers):
        state = _add_mla(acc, c, hidden, heads)
        _add_deepseek_ffn(acc, c, hidden, i)
        acc.add("norm", 2 * hidden)
        if sparse:
            acc.layers.append(replace(state, ds_sparse=True))
            acc.layers.append(_add_v32_indexer(acc, c, hidden))
        else:
            acc.layers.append(state)
    acc.add("norm", hidden)
    n_mtp = c.int("num_nextn_predict_layers", 0)
    if n_mtp:
        # each MTP module: a full MoE decoder layer + enorm, hnorm, eh_proj (2H -> H),
        # shared_head norm and its own copies of embed_tokens and the LM head in the checkpoint
        scratch = Acc()
        for _ in range(n_mtp):
            _add_mla(scratch, c, hidden, heads)
            _add_deepseek_ffn(scratch, c, hidden, n_layers)
            scratch.add("norm", 2 * hidden)
        per_module_extra = 2 * hidden + 2 * hidden * hidden + hidden + 2 * vocab * hidden
        acc.add("mtp", sum(scratch.counts.values()) + n_mtp * per_module_extra)
        acc.num_mtp_layers = n_mtp
    if n_exp:
        moe_inter = c.int("moe_intermediate_size")
        n_shared = c.int("n_shared_experts", 0)
        acc.moe = MoESpec(
            n_exp,
            c.int("num_experts_per_tok"),
            moe_inter,
            n_shared,
            moe_inter * n_shared,
            sum(_deepseek_moe_layer(c, i) for i in range(n_layers)),
        )


# vLLM's DeepSeek-V3.2 indexer keeps one fp8 key per token plus an fp32 scale per 128 elements
# (model_executor/models/deepseek_v2.py DeepseekV32IndexerCache: head_dim + head_dim // 128 * 4
# bytes, uint8), as an MLA-type cache of its own in every layer.
V32_INDEXER_QUANT_BLOCK = 128


def _add_v32_indexer(acc: Acc, c: Cfg, hidden: int) -> LayerSpec:
    """Count one layer's indexer (wq_b, wk, k_norm, weights_proj) and return its K-cache entry."""
    n_heads, head = c.int("index_n_heads"), c.int("index_head_dim")
    q_lora = c.int("q_lora_rank", hidden)
    # wq_b is replicated (not split by TP) and quantized with the checkpoint; the fused
    # wk + weights_proj is replicated and kept in model dtype (vllm deepseek_v2.py Indexer)
    acc.add("indexer", q_lora * n_heads * head)
    acc.add("router", hidden * head + hidden * n_heads)
    acc.add("norm", 2 * head)
    cache_bytes = head + head // V32_INDEXER_QUANT_BLOCK * 4
    # the indexer's rope differs from the attention's in is_neox_style: a second instance
    acc.rope_instances = 2
    return LayerSpec(kind=AttentionKind.MLA, num_kv_heads=1, head_size=cache_bytes, indexer=True)


def read_gpt_oss(c: Cfg, acc: Acc) -> None:
    """gpt-oss: biased attention with sinks, alternating sliding/full, MXFP4 experts with biases."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    n_exp, inter = c.int("num_local_experts"), c.int("intermediate_size")
    topk = c.int("num_experts_per_tok", c.int("experts_per_token", 4))
    for _ in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=True,
            kv_bias=True,
            o_bias=True,
            sinks=True,
        )
        acc.add("router", linear(hidden, n_exp, True))
        acc.add("experts", n_exp * (linear(hidden, 2 * inter, True) + linear(inter, hidden, True)))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_layers)
    acc.rope_dtype = "float32"  # get_rope(..., dtype=torch.float32) (vllm models/gpt_oss.py)
    if c.get("layer_types") is None:
        raise UnsupportedArchitecture(
            f"{c.arch}: gpt-oss config lacks layer_types", "use the model's original config.json"
        )
    acc.layers = sliding_layers(c, n_layers, kv_heads, hd, None)


def read_llama4_text(c: Cfg, acc: Acc) -> None:
    """Llama-4: MoE every ``interleave_moe_layer_step`` layers with a shared expert; chunked local
    attention on RoPE layers, global NoPE full attention on the others (every 4th by default)."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    n_exp, topk, inter = (
        c.int("num_local_experts"),
        c.int("num_experts_per_tok", 1),
        c.int("intermediate_size"),
    )
    inter_mlp = c.int("intermediate_size_mlp", inter)
    step = c.int("interleave_moe_layer_step", 1)
    moe_layers = c.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, n_layers, step)) if step > 0 else []
    moe_set = set(moe_layers)
    no_rope = c.get("no_rope_layers")
    if not no_rope:
        interval = c.int("no_rope_layer_interval", 4)
        no_rope = [int((i + 1) % interval != 0) for i in range(n_layers)]
    chunk = c.get("attention_chunk_size")
    for i in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=bool(c.get("attention_bias")),
            kv_bias=bool(c.get("attention_bias")),
            o_bias=bool(c.get("attention_bias")),
        )
        if i in moe_set:
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * gated_mlp(hidden, inter))
            acc.add("shared_experts", gated_mlp(hidden, inter))
        else:
            acc.add("mlp", gated_mlp(hidden, inter_mlp))
        acc.add("norm", 2 * hidden)
        uses_rope = bool(no_rope[i]) if i < len(no_rope) else True
        if uses_rope and chunk:
            acc.layers.append(
                attn_layer(AttentionKind.CHUNKED, kv_heads, hd, attention_chunk_size=int(chunk))
            )
        else:
            acc.layers.append(attn_layer(AttentionKind.FULL, kv_heads, hd))
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, 1, inter, len(moe_set))


def read_granite_moe(c: Cfg, acc: Acc, model_type: str) -> None:
    """GraniteMoE / GraniteMoeShared (Granite 3.x MoE)."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    n_exp, topk, inter = (
        c.int("num_local_experts"),
        c.int("num_experts_per_tok"),
        c.int("intermediate_size"),
    )
    shared = c.int("shared_intermediate_size", 0) if model_type == "granitemoeshared" else 0
    for _ in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=bool(c.get("attention_bias")),
            kv_bias=bool(c.get("attention_bias")),
            o_bias=bool(c.get("attention_bias")),
        )
        acc.add("router", hidden * n_exp)
        acc.add("experts", n_exp * gated_mlp(hidden, inter))
        if shared:
            acc.add("shared_experts", gated_mlp(hidden, shared))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, 1 if shared else 0, shared, n_layers)
    acc.layers = sliding_layers(c, n_layers, kv_heads, hd, None)


def read_phimoe(c: Cfg, acc: Acc) -> None:
    """Phi-3.5-MoE: Mixtral-like with biased attention and LayerNorms."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    n_exp, topk, inter = (
        c.int("num_local_experts"),
        c.int("num_experts_per_tok"),
        c.int("intermediate_size"),
    )
    bias = bool(c.get("attention_bias", True))
    for _ in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=bias,
            kv_bias=bias,
            o_bias=bias,
        )
        acc.add("router", hidden * n_exp)
        acc.add("experts", n_exp * gated_mlp(hidden, inter))
        acc.add("norm", 4 * hidden)
    acc.add("norm", 2 * hidden)
    acc.add("lm_head", c.int("vocab_size") if c.get("lm_head_bias") else 0)
    acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_layers)
    acc.layers = sliding_layers(c, n_layers, kv_heads, hd, None)


# --------------------------------------------------------------------------------------------
# hybrid (Mamba / linear attention) families


def _mamba2_params(
    hidden: int,
    inter: int,
    n_groups: int,
    state: int,
    n_heads: int,
    conv_k: int,
    conv_bias: bool,
    proj_bias: bool,
    gated_norm: bool = True,
) -> int:
    conv_dim = inter + 2 * n_groups * state
    in_proj = linear(hidden, inter + conv_dim + n_heads, proj_bias)
    conv = conv_dim * conv_k + (conv_dim if conv_bias else 0)
    out = linear(inter, hidden, proj_bias)
    return in_proj + conv + 3 * n_heads + (inter if gated_norm else 0) + out


def _mamba2_state(
    inter: int,
    n_groups: int,
    state: int,
    n_heads: int,
    head_dim: int,
    conv_k: int,
    ssm_dtype: str | None = None,
) -> LayerSpec:
    return LayerSpec(
        kind=AttentionKind.MAMBA,
        mamba=MambaStateSpec(
            variant=MambaVariant.MAMBA2,
            conv_kernel=conv_k,
            intermediate_size=inter,
            state_size=state,
            n_groups=n_groups,
            num_heads=n_heads,
            head_dim=head_dim,
            ssm_dtype=ssm_dtype,
        ),
    )


def _gdn_state(
    conv_k: int, nk: int, dk: int, nv: int, dv: int, ssm_dtype: str | None = None
) -> LayerSpec:
    """State layer of a Gated DeltaNet (or KDA) linear-attention layer."""
    return LayerSpec(
        kind=AttentionKind.MAMBA,
        mamba=MambaStateSpec(
            variant=MambaVariant.GATED_DELTA_NET,
            conv_kernel=conv_k,
            num_k_heads=nk,
            head_k_dim=dk,
            num_v_heads=nv,
            head_v_dim=dv,
            ssm_dtype=str(ssm_dtype) if ssm_dtype else None,
        ),
    )


def read_jamba(c: Cfg, acc: Acc) -> None:
    """Jamba: Mamba1 layers with attention every ``attn_layer_period`` (at ``attn_layer_offset``)
    and MoE every ``expert_layer_period`` (at ``expert_layer_offset``)."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    acc.rope_instances = 0  # Jamba's attention has no positional embedding (vllm models/jamba.py)
    a_period, a_off, e_period, e_off = (
        int(v)
        for v in c.req(
            "attn_layer_period", "attn_layer_offset", "expert_layer_period", "expert_layer_offset"
        )
    )
    n_exp, topk, inter = (
        c.int("num_experts"),
        c.int("num_experts_per_tok"),
        c.int("intermediate_size"),
    )
    expand, d_state, d_conv = (
        c.int("mamba_expand", 2),
        c.int("mamba_d_state", 16),
        c.int("mamba_d_conv", 4),
    )
    m_inter = expand * hidden
    dt_rank = c.get("mamba_dt_rank", "auto")
    dt_rank = math.ceil(hidden / 16) if dt_rank == "auto" else int(dt_rank)
    conv_bias, proj_bias = (
        bool(c.get("mamba_conv_bias", True)),
        bool(c.get("mamba_proj_bias", False)),
    )
    n_moe = 0
    for i in range(n_layers):
        if i % a_period == a_off:
            add_full_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd)
        else:
            acc.add(
                "mamba",
                linear(hidden, 2 * m_inter, proj_bias)
                + m_inter * d_conv
                + (m_inter if conv_bias else 0)
                + linear(m_inter, dt_rank + 2 * d_state)
                + linear(dt_rank, m_inter, True)
                + m_inter * d_state
                + m_inter
                + linear(m_inter, hidden, proj_bias)
                + dt_rank
                + 2 * d_state,
            )
            acc.layers.append(
                LayerSpec(
                    kind=AttentionKind.MAMBA,
                    mamba=MambaStateSpec(
                        variant=MambaVariant.MAMBA1,
                        conv_kernel=d_conv,
                        intermediate_size=m_inter,
                        state_size=d_state,
                    ),
                )
            )
        if n_exp > 1 and i % e_period == e_off:
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * gated_mlp(hidden, inter))
            n_moe += 1
        else:
            acc.add("mlp", gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    if n_moe:
        acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_moe)


def read_nemotron_h(c: Cfg, acc: Acc) -> None:
    """Nemotron-H: one block per ``hybrid_override_pattern`` character
    (M = Mamba2, * = attention, - = MLP, E = MoE), each with one RMSNorm."""
    (pattern,) = c.req("hybrid_override_pattern")
    acc.num_layers = len(str(pattern))
    acc.rope_instances = 0  # no rotary embedding in vllm models/nemotron_h.py
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", heads)
    hd = head_dim_of(c, hidden, heads) if c.get("head_dim") is None else c.int("head_dim")
    m_heads, m_hd = c.int("mamba_num_heads"), c.int("mamba_head_dim")
    n_groups, d_state = c.int("n_groups", 1), c.int("ssm_state_size")
    conv_k = c.int("conv_kernel", 4)
    m_inter = m_heads * m_hd
    inter = c.int("intermediate_size", 0)
    mlp_bias = bool(c.get("mlp_bias", False))
    biases = bool(c.get("use_conv_bias", True)), bool(c.get("use_bias", False))
    ssm = c.get("mamba_ssm_cache_dtype") or "float32"
    n_moe = 0
    for ch in str(pattern):
        if ch == "M":
            params = _mamba2_params(hidden, m_inter, n_groups, d_state, m_heads, conv_k, *biases)
            acc.add("mamba", params)
            acc.layers.append(_mamba2_state(m_inter, n_groups, d_state, m_heads, m_hd, conv_k, ssm))
        elif ch == "*":
            b = bool(c.get("attention_bias", False))
            add_full_attention(
                acc,
                hidden=hidden,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=hd,
                q_bias=b,
                kv_bias=b,
                o_bias=b,
            )
        elif ch == "-":
            acc.add("mlp", plain_mlp(hidden, inter, mlp_bias))
            acc.layers.append(LayerSpec(kind=AttentionKind.NONE))
        elif ch == "E":
            n_exp = c.int("n_routed_experts")
            moe_inter = c.int("moe_intermediate_size")
            shared_inter = c.int("moe_shared_expert_intermediate_size", 0) * c.int(
                "n_shared_experts", 1
            )
            acc.add("router", hidden * n_exp + n_exp)
            acc.add("experts", n_exp * plain_mlp(hidden, moe_inter, mlp_bias))
            acc.add(
                "shared_experts", plain_mlp(hidden, shared_inter, mlp_bias) if shared_inter else 0
            )
            acc.layers.append(LayerSpec(kind=AttentionKind.NONE))
            n_moe += 1
        else:
            raise UnsupportedArchitecture(
                f"{c.arch}: unknown block {ch!r} in hybrid_override_pattern",
                "only M, *, - and E blocks are understood",
            )
        acc.add("norm", hidden)
    acc.add("norm", hidden)
    if n_moe:
        acc.moe = MoESpec(
            c.int("n_routed_experts"),
            c.int("num_experts_per_tok"),
            c.int("moe_intermediate_size"),
            c.int("n_shared_experts", 1),
            c.int("moe_shared_expert_intermediate_size", 0),
            n_moe,
        )


def read_falcon_h1(c: Cfg, acc: Acc) -> None:
    """Falcon-H1: attention and Mamba2 side by side in every layer (two state entries per layer)."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    inter = c.int("intermediate_size")
    m_heads, m_hd = c.int("mamba_n_heads"), c.int("mamba_d_head")
    m_inter = c.int("mamba_d_ssm", m_heads * m_hd)
    n_groups, d_state, conv_k = (
        c.int("mamba_n_groups", 1),
        c.int("mamba_d_state"),
        c.int("mamba_d_conv", 4),
    )
    b = bool(c.get("attention_bias", False))
    for _ in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=b,
            kv_bias=b,
            o_bias=b,
        )
        acc.add(
            "mamba",
            _mamba2_params(
                hidden,
                m_inter,
                n_groups,
                d_state,
                m_heads,
                conv_k,
                bool(c.get("mamba_conv_bias", True)),
                bool(c.get("mamba_proj_bias", False)),
                gated_norm=bool(c.get("mamba_rms_norm", False)),
            ),
        )
        acc.add("mlp", gated_mlp(hidden, inter, bool(c.get("mlp_bias", False))))
        acc.add("norm", 2 * hidden)
        acc.layers.append(attn_layer(AttentionKind.FULL, kv_heads, hd))
        acc.layers.append(_mamba2_state(m_inter, n_groups, d_state, m_heads, m_hd, conv_k))
    acc.add("norm", hidden)


def read_granite_hybrid(c: Cfg, acc: Acc) -> None:
    """Granite-4.0-H (GraniteMoeHybrid): Mamba2/attention per ``layer_types``, MoE + shared MLP."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    (layer_types,) = c.req("layer_types")
    # granite-4.0-micro: the hybrid family's config with attention in every layer (no Mamba)
    has_mamba = "mamba" in layer_types
    m_heads, m_hd = (c.int("mamba_n_heads"), c.int("mamba_d_head")) if has_mamba else (0, 0)
    m_inter = m_heads * m_hd
    n_groups, d_state, conv_k = (
        c.int("mamba_n_groups", 1),
        c.int("mamba_d_state") if has_mamba else 0,
        c.int("mamba_d_conv", 4),
    )
    n_exp = c.int("num_local_experts", 0)
    inter = c.int("intermediate_size")
    shared = c.int("shared_intermediate_size", 0)
    for i in range(n_layers):
        if layer_types[i] == "mamba":
            acc.add(
                "mamba",
                _mamba2_params(
                    hidden,
                    m_inter,
                    n_groups,
                    d_state,
                    m_heads,
                    conv_k,
                    bool(c.get("mamba_conv_bias", True)),
                    bool(c.get("mamba_proj_bias", False)),
                ),
            )
            acc.layers.append(_mamba2_state(m_inter, n_groups, d_state, m_heads, m_hd, conv_k))
        elif layer_types[i] == "attention":
            b = bool(c.get("attention_bias", False))
            add_full_attention(
                acc,
                hidden=hidden,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=hd,
                q_bias=b,
                kv_bias=b,
                o_bias=b,
            )
        else:
            raise UnsupportedArchitecture(
                f"{c.arch}: unknown layer type {layer_types[i]!r}", "expected mamba or attention"
            )
        if n_exp:
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * gated_mlp(hidden, inter))
        if shared:
            acc.add("shared_experts" if n_exp else "mlp", gated_mlp(hidden, shared))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    if n_exp:
        acc.moe = MoESpec(
            n_exp, c.int("num_experts_per_tok"), inter, 1 if shared else 0, shared, n_layers
        )


def _qwen3_next_layer_types(c: Cfg, n_layers: int) -> list[str]:
    """``layer_types``, else full attention every ``full_attention_interval`` layers."""
    layer_types = c.get("layer_types")
    if layer_types is not None:
        return list(layer_types)
    interval = c.int("full_attention_interval", 4)
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ]


def _gdn_params(hidden: int, nk: int, dk: int, nv: int, dv: int, conv_k: int) -> int:
    """Parameters of one Gated DeltaNet layer: in-projections (qkvz, ba), conv, A/dt, norm, out."""
    qkvz = 2 * nk * dk + 2 * nv * dv
    conv_dim = 2 * nk * dk + nv * dv
    return hidden * qkvz + hidden * 2 * nv + conv_dim * conv_k + 2 * nv + dv + nv * dv * hidden


_GDN_HEAD_KEYS = (
    "linear_num_key_heads",
    "linear_key_head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
)


def read_qwen3_next(c: Cfg, acc: Acc, model_type: str = "qwen3_next") -> None:
    """Qwen3-Next and Qwen3.5: Gated DeltaNet layers with gated full attention every
    ``full_attention_interval`` (or per ``layer_types``); MoE with a gated shared expert
    (Qwen3.5 dense: a plain MLP per layer); optional MTP layers (``num_nextn_predict_layers``,
    Qwen3.5 ``mtp_num_hidden_layers``). Qwen3.5 pins its SSM state dtype (``mamba_ssm_dtype``,
    float32), which vLLM adopts for ``mamba_ssm_cache_dtype`` (model_executor/models/config.py
    Qwen3_5ForConditionalGenerationConfig)."""
    dense = model_type == "qwen3_5_text"
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    nk, dk, nv, dv = (int(v) for v in c.req(*_GDN_HEAD_KEYS))
    conv_k = c.int("linear_conv_kernel_dim", 4)
    layer_types = _qwen3_next_layer_types(c, n_layers)
    if dense:
        n_exp, topk, moe_inter = 0, 0, 0
        sparse = [False] * n_layers
    else:
        n_exp, topk, moe_inter = (
            c.int("num_experts"),
            c.int("num_experts_per_tok"),
            c.int("moe_intermediate_size"),
        )
        sparse = _moe_layer_indices(c, n_layers)
    shared_inter = c.int("shared_expert_intermediate_size", 0)
    ssm_dtype = c.get("mamba_ssm_dtype")

    def add_ffn(i: int, target: Acc) -> None:
        if not dense and (sparse[i] if i < n_layers else True):
            target.add("router", hidden * n_exp)
            target.add("experts", n_exp * gated_mlp(hidden, moe_inter))
            if shared_inter:
                target.add("shared_experts", gated_mlp(hidden, shared_inter))
                target.add("router", hidden)
        else:
            target.add("mlp", gated_mlp(hidden, c.int("intermediate_size")))

    for i in range(n_layers):
        if layer_types[i] == "full_attention":
            add_full_attention(
                acc,
                hidden=hidden,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=hd,
                qk_norm=True,
                q_gate=True,
            )
        else:
            acc.add("mamba", _gdn_params(hidden, nk, dk, nv, dv, conv_k))
            acc.layers.append(_gdn_state(conv_k, nk, dk, nv, dv, ssm_dtype))
        add_ffn(i, acc)
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    n_mtp = c.int("num_nextn_predict_layers", c.int("mtp_num_hidden_layers", 0))
    if n_mtp:
        scratch = Acc()
        for _ in range(n_mtp):
            add_attention(
                scratch,
                hidden=hidden,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=hd,
                qk_norm=True,
                q_gate=True,
            )
            add_ffn(n_layers, scratch)
            scratch.add("norm", 2 * hidden)
        # fc (2H -> H), two pre-fc norms, final norm
        acc.add("mtp", sum(scratch.counts.values()) + n_mtp * (2 * hidden * hidden + 3 * hidden))
        acc.num_mtp_layers = n_mtp
    if not dense:
        acc.moe = MoESpec(
            n_exp, topk, moe_inter, 1 if shared_inter else 0, shared_inter, sum(sparse)
        )


def read_kimi_linear(c: Cfg, acc: Acc) -> None:
    """Kimi-Linear: KDA (Kimi Delta Attention) layers and MLA full-attention layers per
    ``linear_attn_config``; DeepSeek-style MoE."""
    hidden, n_layers, heads = (
        c.int("hidden_size"),
        c.int("num_hidden_layers"),
        c.int("num_attention_heads"),
    )
    (lac,) = c.req("linear_attn_config")
    missing = [
        k for k in ("kda_layers", "full_attn_layers", "num_heads", "head_dim") if k not in lac
    ]
    if missing:
        raise UnsupportedArchitecture(
            f"{c.arch}: linear_attn_config lacks {', '.join(missing)}",
            "use the model's original config.json",
        )
    full = [int(x) for x in lac["full_attn_layers"]]
    one_based = bool(full) and (
        max(full) >= n_layers or 0 not in full and 0 not in lac["kda_layers"]
    )
    full_set = {x - 1 if one_based else x for x in full}
    nh, hd = int(lac["num_heads"]), int(lac["head_dim"])
    conv_k = int(lac.get("short_conv_kernel_size", 4))
    proj = nh * hd
    for i in range(n_layers):
        if i in full_set:
            acc.layers.append(_add_mla(acc, c, hidden, heads))
        else:
            # q/k/v projections, their short convs, decay (f_a/f_b, A_log, dt_bias), beta, output
            # gate
            acc.add(
                "mamba",
                3 * hidden * proj
                + 3 * proj * conv_k
                + hidden * hd
                + hd * proj
                + nh
                + proj
                + hidden * nh
                + hidden * hd
                + hd * proj
                + hd
                + proj * hidden,
            )
            acc.layers.append(_gdn_state(conv_k, nh, hd, nh, hd))
        _add_deepseek_ffn(acc, c, hidden, i)
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    n_exp = int(c.get("num_experts") or c.get("n_routed_experts") or 0)
    if n_exp:
        moe_inter = c.int("moe_intermediate_size")
        n_shared = c.int("num_shared_experts", c.int("n_shared_experts", 0))
        topk = c.int("num_experts_per_token", c.int("num_experts_per_tok", 0))
        acc.moe = MoESpec(
            n_exp,
            topk,
            moe_inter,
            n_shared,
            moe_inter * n_shared,
            sum(_deepseek_moe_layer(c, i) for i in range(n_layers)),
        )


# --------------------------------------------------------------------------------------------
# multimodal: vision towers (counted into the "vision" group) and the mllama text model


def vision_siglip_gemma3(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    hv, iv, n, p, img = vit_dims(v)
    params = 3 * p * p * hv + hv + (img // p) ** 2 * hv + n * vit_block(hv, iv) + 2 * hv
    params += hv * text_hidden + hv  # mm_input_projection_weight, mm_soft_emb_norm
    tokens = int(config.get("mm_tokens_per_image") or 256)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=n)


def vision_clip_llava(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    hv, iv, n, p, img = vit_dims(v)
    vtype = str(v.get("model_type", "clip_vision_model"))
    positions = (img // p) ** 2 + (1 if "clip" in vtype else 0)
    params = 3 * p * p * hv + positions * hv + n * vit_block(hv, iv)
    params += hv if "clip" in vtype else hv  # class embedding (CLIP) / conv bias (SigLIP)
    params += 4 * hv  # pre/post layernorm
    bias = bool(config.get("multimodal_projector_bias", True))
    params += linear(hv, text_hidden, bias) + linear(text_hidden, text_hidden, bias)
    tokens = (img // p) ** 2
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=n)


def vision_qwen2_5_vl(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    hv, iv, depth = (int(x) for x in v.req("hidden_size", "intermediate_size", "depth"))
    p, tp, merge = (
        v.int("patch_size", 14),
        v.int("temporal_patch_size", 2),
        v.int("spatial_merge_size", 2),
    )
    out = v.int("out_hidden_size", text_hidden)
    block = (
        2 * hv
        + linear(hv, 3 * hv, True)
        + linear(hv, hv, True)
        + 2 * linear(hv, iv, True)
        + linear(iv, hv, True)
    )
    mh = hv * merge * merge
    params = 3 * tp * p * p * hv + depth * block + hv + linear(mh, mh, True) + linear(mh, out, True)
    # default processor max_pixels 12845056 → 16384 merged tokens for the largest image
    tokens = 12845056 // (p * p * merge * merge)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=depth)


def vision_qwen2_vl(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    ed, depth = (int(x) for x in v.req("embed_dim", "depth"))
    iv = int(ed * float(v.get("mlp_ratio", 4)))
    p, tp, merge = (
        v.int("patch_size", 14),
        v.int("temporal_patch_size", 2),
        v.int("spatial_merge_size", 2),
    )
    out = v.int("hidden_size", text_hidden)
    mh = ed * merge * merge
    params = 3 * tp * p * p * ed + depth * vit_block(ed, iv)
    params += 2 * ed + linear(mh, mh, True) + linear(mh, out, True)
    tokens = 12845056 // (p * p * merge * merge)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=ed, num_layers=depth)


def vision_pixtral(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    hv, iv, n, p, img = vit_dims(v)
    merge = int(config.get("spatial_merge_size") or 2)
    params = 3 * p * p * hv + hv + n * vit_block(hv, iv, bias=False, gated=True, layernorm=False)
    bias = bool(config.get("multimodal_projector_bias", False))
    params += (
        hv
        + hv * merge * merge * hv
        + linear(hv, text_hidden, bias)
        + linear(text_hidden, text_hidden, bias)
    )
    side = img // p // merge
    return VisionSpec(
        params=params, max_tokens_per_item=side * (side + 1), hidden_size=hv, num_layers=n
    )


def vision_mllama(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    hv, iv, n, n_global, p, img = (
        int(x)
        for x in v.req(
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_global_layers",
            "patch_size",
            "image_size",
        )
    )
    tiles = v.int("max_num_tiles", 4)
    n_ratios = len(v.get("supported_aspect_ratios") or [[1, 1]] * 8) + 1
    positions = (img // p) ** 2 + 1
    out_dim = v.int("vision_output_dim", hv * (len(v.get("intermediate_layers_indices") or []) + 1))
    params = 3 * p * p * hv + hv  # patch conv (no bias) + class embedding
    # gated + tile position embeddings
    params += positions * hv + 1 + n_ratios * tiles * positions * hv
    params += 2 * (n_ratios * tiles * hv + 1)  # pre/post tile positional embeddings with gates
    params += 4 * hv  # layernorm_pre / layernorm_post
    # q/k/v/o without bias, fc with bias
    params += n * vit_block(hv, iv, bias=False) + n * (hv + iv)
    params += n_global * (vit_block(hv, iv, bias=False) + hv + iv + 2)
    params += linear(out_dim, text_hidden, True)
    return VisionSpec(
        params=params,
        max_tokens_per_item=tiles * positions,
        hidden_size=hv,
        num_layers=n + n_global,
    )


def vision_llama4(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    hv, iv, n, p, img = vit_dims(v)
    ratio = float(v.get("pixel_shuffle_ratio", 0.5))
    pin, pout = v.int("projector_input_dim", 4096), v.int("projector_output_dim", 4096)
    vout = v.int("vision_output_dim", pout)
    patches = (img // p) ** 2
    params = 3 * p * p * hv + hv + (patches + 1) * hv + 4 * hv + n * vit_block(hv, iv)
    params += int(hv / (ratio * ratio)) * pin + pin * pout + vout * text_hidden
    per_tile = int(patches * ratio * ratio)
    return VisionSpec(
        params=params, max_tokens_per_item=17 * per_tile, hidden_size=hv, num_layers=n
    )


def vision_moonvit(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = vision_cfg(config, arch)
    hv, iv, n = (int(x) for x in v.req("hidden_size", "intermediate_size", "num_hidden_layers"))
    p = v.int("patch_size", 14)
    pos = v.int("init_pos_emb_height", 64) * v.int("init_pos_emb_width", 64)
    mk = v.get("merge_kernel_size") or [2, 2]
    mh = hv * int(mk[0]) * int(mk[1])
    params = 3 * p * p * hv + hv + pos * hv + n * vit_block(hv, iv) + 2 * hv
    params += 2 * hv + linear(mh, mh, True) + linear(mh, text_hidden, True)
    # the media processor caps one image at 4096 patches (in_token_limit) before the 2×2 merge
    return VisionSpec(
        params=params,
        max_tokens_per_item=4096 // (int(mk[0]) * int(mk[1])),
        hidden_size=hv,
        num_layers=n,
    )


def read_mllama_text(c: Cfg, acc: Acc) -> None:
    """Llama-3.2-Vision text model: Llama self-attention layers plus gated cross-attention layers
    (``cross_attention_layers``) whose K/V come from the image encoder tokens of the request."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    inter = c.int("intermediate_size")
    cross = set(int(i) for i in (c.get("cross_attention_layers") or []))
    for i in range(n_layers):
        add_attention(
            acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd, qk_norm=i in cross
        )
        acc.add("mlp", gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
        if i in cross:
            acc.add("norm", 2)  # cross_attn_attn_gate, cross_attn_mlp_gate
            acc.layers.append(attn_layer(AttentionKind.CROSS, kv_heads, hd))
        else:
            acc.layers.append(attn_layer(AttentionKind.FULL, kv_heads, hd))
    acc.add("norm", hidden)
    acc.add("embed", 8 * hidden)  # 8 extra rows for the image special tokens
    acc.extra_vocab_rows = 8
