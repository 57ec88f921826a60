"""The generic reader: a decoder of a ``model_type`` the reader table does not know.

When the config carries the standard fields (layers, hidden size, heads, KV heads, head size,
layer types, sliding window, optionally a plain MoE) and nothing else that could change the
cache, the model is read as a standard decoder: Llama-style attention (optional biases and
QK-norm) and a gated MLP per layer. The result is labelled "architecture not verified" and its
estimates carry wider ranges. A field that may change the cache and is not understood (a latent
KV rank, a state size, a sharing or pattern rule, an unknown layer type) fails closed, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomguard.errors import UnsupportedArchitecture
from oomguard.facts.config_parts import (
    Acc,
    Cfg,
    add_attention,
    attn_layer,
    dense_core,
    gated_mlp,
)
from oomguard.memory.spec import AttentionKind, MoESpec

# fields whose meaning is the same in every Hugging Face decoder config (bookkeeping, token
# ids, dropout, norms, RoPE, activation, router settings that do not size anything)
_NEUTRAL = frozenset(
    """architectures model_type torch_dtype dtype transformers_version _name_or_path auto_map
    bos_token_id eos_token_id pad_token_id sep_token_id unk_token_id decoder_start_token_id
    hidden_act hidden_activation activation_function initializer_range init_std
    rms_norm_eps layer_norm_eps layer_norm_epsilon norm_eps use_cache tie_word_embeddings
    attention_dropout hidden_dropout dropout embd_pdrop resid_pdrop attn_pdrop
    residual_dropout embedding_dropout rope_theta rope_scaling rope_parameters rope_type
    partial_rotary_factor max_position_embeddings original_max_position_embeddings
    pretraining_tp logits_scaling logit_scale final_logit_softcapping
    embedding_multiplier residual_multiplier output_router_logits router_aux_loss_coef
    router_z_loss_coef norm_topk_prob routed_scaling_factor scoring_func topk_method
    n_group topk_group is_decoder output_attentions output_hidden_states return_dict
    problem_type id2label label2id chunk_size_feed_forward is_encoder_decoder
    tokenizer_class prefix task_specific_params torchscript quantization_config
    attn_implementation _attn_implementation use_return_dict tie_encoder_decoder
    add_cross_attention""".split()
)
# fields the generic reader reads
_READ = frozenset(
    """num_hidden_layers hidden_size intermediate_size num_attention_heads num_key_value_heads
    head_dim vocab_size attention_bias mlp_bias use_qk_norm qk_norm qk_layernorm
    layer_types sliding_window use_sliding_window num_experts num_local_experts
    n_routed_experts num_experts_per_tok moe_intermediate_size n_shared_experts
    shared_expert_intermediate_size first_k_dense_replace decoder_sparse_step mlp_only_layers
    attention_multiplier""".split()
)
# name fragments of fields that may change what the KV cache holds per token or per layer
_CACHE_HINTS = (
    "kv", "head", "attn", "attention", "window", "layer", "lora", "latent", "mamba", "ssm",
    "state", "conv", "chunk", "linear", "global", "local", "share", "cross", "rank", "group",
    "sparse", "index", "block", "pattern", "query", "key", "value", "nope", "compress", "cache",
    "recurrent", "delta", "retention", "mixer", "mtp", "nextn",
)  # fmt: skip
_LAYER_KINDS = {"full_attention": AttentionKind.FULL, "attention": AttentionKind.FULL,
                "sliding_attention": AttentionKind.SLIDING}  # fmt: skip


def _refuse(arch: str, model_type: str, why: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(
        f"architecture {arch} (model_type {model_type!r}) is not supported: {why}",
        "give a config of a supported model type, or plan with a supported model of the "
        "same shape (see `oomguard models`)",
    )


def generic_caveats(
    text: Mapping[str, Any], config: Mapping[str, Any], arch: str, model_type: str
) -> list[str]:
    """Check that ``text`` can be read generically; the caveats to show with the plan.

    Raises :class:`UnsupportedArchitecture` (naming the field) when a field that may change the
    cache is not understood, when the config is multimodal, or when it is not a decoder.
    """
    if not (arch.endswith("ForCausalLM") or arch == model_type):
        raise _refuse(
            arch,
            model_type,
            "only decoder-only language models (…ForCausalLM) "
            "are read without an architecture-specific reader",
        )
    for key in ("vision_config", "audio_config", "encoder_config", "vision_tower"):
        if config.get(key) is not None:
            raise _refuse(arch, model_type, f"its {key} is a tower no reader accounts for")
    ignored: list[str] = []
    for key, value in text.items():
        if key in _NEUTRAL or key in _READ or value is None or value is False:
            continue
        if any(hint in key.lower() for hint in _CACHE_HINTS):
            raise _refuse(
                arch,
                model_type,
                f"its config field {key!r} may change the KV cache and is not understood",
            )
        ignored.append(key)
    for kind in text.get("layer_types") or ():
        if kind not in _LAYER_KINDS:
            raise _refuse(arch, model_type, f"layer type {kind!r} is not understood")
    if (
        text.get("sliding_window")
        and not text.get("layer_types")
        and text.get("use_sliding_window", True)
    ):
        raise _refuse(
            arch,
            model_type,
            "sliding_window without layer_types: which layers slide is model-specific",
        )
    note = (
        f"architecture not verified: {arch} (model_type {model_type!r}) has no reader of its "
        "own; read as a standard decoder (attention per layer_types, gated MLP"
        f"{', MoE' if _experts(Cfg(text, arch, None)) else ''}) with wider ranges"
    )
    if ignored:
        shown = ", ".join(sorted(ignored)[:6]) + (", …" if len(ignored) > 6 else "")
        note += f"; fields ignored: {shown}"
    return [note]


def _experts(c: Cfg) -> int:
    return c.int("num_experts", c.int("num_local_experts", c.int("n_routed_experts", 0)))


def _is_moe_layer(c: Cfg, i: int) -> bool:
    if i < c.int("first_k_dense_replace", 0) or i in (c.get("mlp_only_layers") or ()):
        return False
    step = c.int("decoder_sparse_step", 1)
    return step <= 1 or (i + 1) % step == 0


def read_generic(c: Cfg, acc: Acc, model_type: str) -> None:
    """A standard decoder: attention per ``layer_types`` (all full without it), a gated MLP or a
    plain MoE (routed experts of ``moe_intermediate_size``, optional shared experts)."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    bias = bool(c.get("attention_bias", False))
    qk_norm = bool(c.get("use_qk_norm") or c.get("qk_norm") or c.get("qk_layernorm"))
    kinds = [str(k) for k in c.get("layer_types") or ["full_attention"] * n_layers]
    window = c.get("sliding_window")
    n_exp = _experts(c)
    moe_inter = c.int("moe_intermediate_size", c.int("intermediate_size"))
    shared = c.int("shared_expert_intermediate_size", moe_inter * c.int("n_shared_experts", 0))
    moe_layers = 0
    for i in range(n_layers):
        add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=bias,
            kv_bias=bias,
            o_bias=bias,
            qk_norm=qk_norm,
        )
        if n_exp and _is_moe_layer(c, i):
            moe_layers += 1
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * gated_mlp(hidden, moe_inter))
            if shared:
                acc.add("shared_experts", gated_mlp(hidden, shared))
        else:
            acc.add("mlp", gated_mlp(hidden, c.int("intermediate_size")))
        acc.add("norm", 2 * hidden)
        if _LAYER_KINDS[kinds[i]] is AttentionKind.SLIDING and window:
            acc.layers.append(
                attn_layer(AttentionKind.SLIDING, kv_heads, hd, sliding_window=int(window))
            )
        else:
            acc.layers.append(attn_layer(AttentionKind.FULL, kv_heads, hd))
    acc.add("norm", hidden)
    if n_exp:
        acc.moe = MoESpec(
            n_exp, c.int("num_experts_per_tok"), moe_inter, 1 if shared else 0, shared, moe_layers
        )
