"""Turn a Hugging Face ``config.json`` (a dict) into a :class:`ModelSpec`.

One reader serves every source (catalogue entry, local directory, hub, GGUF-derived config).
Parameter counts follow the module layouts vLLM builds for each architecture
(``vllm/model_executor/models/*.py``); per-layer state kinds follow
``vllm/v1/kv_cache_interface.py``. An architecture whose memory cannot be accounted for
raises :class:`UnsupportedArchitecture` naming what is missing: nothing is guessed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.memory.spec import (
    AttentionKind,
    LayerSpec,
    MambaStateSpec,
    MambaVariant,
    ModelSpec,
    MoESpec,
    ParamGroup,
    ParamSharding,
    VisionSpec,
)

# Keys vLLM reads for the default max_model_len (docs/memory-model.md §3.5).
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose ``factor`` vLLM does not multiply into the derived length (vLLM 0.32).
_ROPE_TYPES_NOT_SCALED = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)

# transformers' defaults for tie_word_embeddings when config.json omits it, by model_type.
_TIE_DEFAULT_BY_MODEL_TYPE: dict[str, bool] = {
    "opt": True,
    "gemma": True,
    "gemma2": True,
    "gemma3": True,
    "gemma3_text": True,
    "granite": False,
    "granitemoehybrid": True,
}


@dataclass(frozen=True)
class ConfigDefaults:
    """transformers' class defaults for one ``model_type``: what a sparse config.json omits.

    Hub files are written by ``PretrainedConfig.to_diff_dict()`` and list only the keys that
    differ from the class defaults (Gemma 3 is the common case), so the reader must apply
    them exactly as ``<Model>Config(**config)`` would. ``sub_configs`` names the default
    ``model_type`` of nested configs a wrapper builds (``text_config`` → ``gemma3_text``).
    """

    values: Mapping[str, Any]
    source: str
    sub_configs: Mapping[str, str] = field(default_factory=dict)


_TRANSFORMERS_AT = "https://github.com/huggingface/transformers/blob/008f5c8c29be84d4721dc6d1e0fcd72300580be4/src/transformers/models"

# Only fields that size memory or its derived length are listed. An explicit ``null`` in
# config.json stays null (as in transformers, where the argument is passed through).
CONFIG_DEFAULTS: dict[str, ConfigDefaults] = {
    "gemma3_text": ConfigDefaults(
        {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 256, "max_position_embeddings": 131_072, "tie_word_embeddings": True,
         "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "attention_bias": False,
         "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6},
        f"{_TRANSFORMERS_AT}/gemma3/configuration_gemma3.py Gemma3TextConfig.__init__",
    ),
    "gemma3": ConfigDefaults(
        {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
         "image_token_index": 262_144},
        f"{_TRANSFORMERS_AT}/gemma3/configuration_gemma3.py Gemma3Config.__init__ "
        "(text_config is built as Gemma3TextConfig, vision_config as SiglipVisionConfig)",
        {"text_config": "gemma3_text", "vision_config": "siglip_vision_model"},
    ),
    "siglip_vision_model": ConfigDefaults(
        {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16},
        f"{_TRANSFORMERS_AT}/siglip/configuration_siglip.py SiglipVisionConfig",
    ),
    "gemma2": ConfigDefaults(
        {"vocab_size": 256_000, "head_dim": 256, "max_position_embeddings": 8192,
         "sliding_window": 4096, "query_pre_attn_scalar": 256, "tie_word_embeddings": True},
        f"{_TRANSFORMERS_AT}/gemma2/configuration_gemma2.py Gemma2Config.__init__",
    ),
    "mistral": ConfigDefaults(
        {"sliding_window": 4096},
        f"{_TRANSFORMERS_AT}/mistral/configuration_mistral.py MistralConfig.__init__",
    ),
}  # fmt: skip


def apply_config_defaults(
    config: Mapping[str, Any], model_type: str | None = None
) -> dict[str, Any]:
    """``config`` with transformers' class defaults filled in, nested configs included.

    ``model_type`` overrides the config's own (a wrapper's ``text_config`` often has none).
    Keys present in ``config`` win, explicit ``null`` included; types without an entry in
    :data:`CONFIG_DEFAULTS` come back unchanged (as a shallow copy).
    """
    mtype = str(model_type or config.get("model_type") or "")
    entry = CONFIG_DEFAULTS.get(mtype)
    out: dict[str, Any] = dict(entry.values) if entry else {}
    out.update(config)
    for key in ("text_config", "vision_config", "llm_config", "language_config"):
        sub = out.get(key)
        if isinstance(sub, Mapping):
            sub_type = str(
                sub.get("model_type") or (entry.sub_configs.get(key, "") if entry else "")
            )
            out[key] = apply_config_defaults(sub, sub_type)
    return out


# (group name) -> (sharding, quantizable, per_layer, stage)
_GROUP_LAYOUT: dict[str, tuple[ParamSharding, bool, bool, str]] = {
    "embed": (ParamSharding.VOCAB, False, False, "first"),
    "pos_embed": (ParamSharding.REPLICATED, False, False, "first"),
    "lm_head": (ParamSharding.VOCAB, False, False, "last"),
    "attn_qo": (ParamSharding.TP, True, True, "layers"),
    "attn_kv": (ParamSharding.KV_REPLICATED, True, True, "layers"),
    "mlp": (ParamSharding.TP, True, True, "layers"),
    "experts": (ParamSharding.EXPERTS, True, True, "layers"),
    "shared_experts": (ParamSharding.TP, True, True, "layers"),
    "router": (ParamSharding.REPLICATED, False, True, "layers"),
    "norm": (ParamSharding.REPLICATED, False, True, "layers"),
    "mamba": (ParamSharding.TP, True, True, "layers"),
    "indexer": (ParamSharding.REPLICATED, True, True, "layers"),
    # per-layer embedding table (Gemma 3n / Gemma 4 E-models): vocab-parallel, first stage
    "embed_per_layer": (ParamSharding.VOCAB, False, False, "first"),
    # weights vLLM allocates that the checkpoint does not store (Gemma 4's V slot of
    # attention_k_eq_v layers): memory, but not in the published parameter count
    "runtime_copy": (ParamSharding.KV_REPLICATED, True, True, "layers"),
    "vision": (ParamSharding.TP, False, False, "first"),
    "mtp": (ParamSharding.TP, True, False, "last"),
}
_GROUP_ORDER = tuple(_GROUP_LAYOUT)


class _Cfg:
    """Read access to one config dict that records which required fields are missing."""

    def __init__(
        self, data: Mapping[str, Any], arch: str, fallback: Mapping[str, Any] | None
    ) -> None:
        self.data = data
        self.arch = arch
        self.fallback = fallback or {}

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        if value is None:
            value = self.fallback.get(key)
        return default if value is None else value

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None or self.fallback.get(key) is not None

    def req(self, *keys: str) -> list[Any]:
        missing = [k for k in keys if not self.has(k)]
        if missing:
            raise UnsupportedArchitecture(
                f"{self.arch}: config.json lacks {', '.join(missing)}",
                "these fields size the model's memory; use the model's original config.json",
            )
        return [self.get(k) for k in keys]

    def int(self, key: str, default: int | None = None) -> int:
        value = self.get(key, default)
        if value is None:
            self.req(key)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise MalformedConfig(
                f"{self.arch}: config field {key!r} is {value!r}, not an integer",
                "fix the value in config.json",
            ) from None


@dataclass
class _Acc:
    """Parameter counts by group, plus the layer state list, built up by a family reader."""

    counts: dict[str, int] = field(default_factory=dict)
    layers: list[LayerSpec] = field(default_factory=list)
    moe: MoESpec | None = None
    vision: VisionSpec | None = None
    num_mtp_layers: int = 0

    def add(self, group: str, n: int) -> None:
        if n:
            self.counts[group] = self.counts.get(group, 0) + int(n)


# --------------------------------------------------------------------------------------------
# building blocks


def _linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def _add_attention(
    acc: _Acc,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_bias: bool = False,
    kv_bias: bool = False,
    o_bias: bool = False,
    qk_norm: bool = False,
    q_gate: bool = False,
    sinks: bool = False,
) -> None:
    q_out = heads * head_dim * (2 if q_gate else 1)
    acc.add("attn_qo", _linear(hidden, q_out, q_bias) + _linear(heads * head_dim, hidden, o_bias))
    acc.add("attn_kv", 2 * _linear(hidden, kv_heads * head_dim, kv_bias))
    if qk_norm:
        acc.add("norm", 2 * head_dim)
    if sinks:
        acc.add("attn_qo", heads)


def _add_full_attention(
    acc: _Acc, *, hidden: int, heads: int, kv_heads: int, head_dim: int, **flags: bool
) -> None:
    """Count one full-attention layer's parameters (``flags`` as for ``_add_attention``) and
    append its KV layer."""
    _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **flags)
    acc.layers.append(_attn_layer(AttentionKind.FULL, kv_heads, head_dim))


def _gated_mlp(hidden: int, inter: int, bias: bool = False) -> int:
    return 2 * _linear(hidden, inter, bias) + _linear(inter, hidden, bias)


def _plain_mlp(hidden: int, inter: int, bias: bool = False) -> int:
    return _linear(hidden, inter, bias) + _linear(inter, hidden, bias)


def _attn_layer(kind: AttentionKind, kv_heads: int, head_dim: int, **kw: Any) -> LayerSpec:
    return LayerSpec(kind=kind, num_kv_heads=kv_heads, head_size=head_dim, **kw)


def _sliding_layers(
    c: _Cfg,
    n_layers: int,
    kv_heads: int,
    head_dim: int,
    default_pattern: Callable[[int], bool] | None,
) -> list[LayerSpec]:
    """Full / sliding-window layers from ``layer_types`` or the model's fixed pattern.

    Mirrors vLLM: with ``layer_types`` each sliding layer carries the window; without it a
    model-level ``sliding_window`` applies to every layer (Mistral v0.1, Phi-3-mini-4k).
    """
    window = c.get("sliding_window")
    if c.data.get("use_sliding_window") is False or c.fallback.get("use_sliding_window") is False:
        window = None
    if window == 0:
        window = None
    layer_types = c.get("layer_types")
    if layer_types is None and default_pattern is not None and window is not None:
        layer_types = [
            "sliding_attention" if default_pattern(i) else "full_attention" for i in range(n_layers)
        ]
    if layer_types is not None:
        if len(layer_types) < n_layers:
            raise MalformedConfig(
                f"{c.arch}: layer_types lists {len(layer_types)} layers, num_hidden_layers is {n_layers}",
                "fix layer_types in config.json",
            )
        out = []
        for i in range(n_layers):
            if layer_types[i] == "sliding_attention" and window is not None:
                out.append(
                    _attn_layer(
                        AttentionKind.SLIDING, kv_heads, head_dim, sliding_window=int(window)
                    )
                )
            else:
                out.append(_attn_layer(AttentionKind.FULL, kv_heads, head_dim))
        return out
    if window is not None:
        return [
            _attn_layer(AttentionKind.SLIDING, kv_heads, head_dim, sliding_window=int(window))
            for _ in range(n_layers)
        ]
    return [_attn_layer(AttentionKind.FULL, kv_heads, head_dim) for _ in range(n_layers)]


def _head_dim(c: _Cfg, hidden: int, heads: int) -> int:
    hd = c.get("head_dim")
    if hd is not None:
        return int(hd)
    if hidden % heads:
        raise MalformedConfig(
            f"{c.arch}: hidden_size {hidden} is not divisible by num_attention_heads {heads}",
            "set head_dim in config.json",
        )
    return hidden // heads


def _dense_core(c: _Cfg) -> tuple[int, int, int, int, int]:
    hidden, n_layers, heads = (
        int(v) for v in c.req("hidden_size", "num_hidden_layers", "num_attention_heads")
    )
    kv_heads = int(c.get("num_key_value_heads", heads))
    return hidden, n_layers, heads, kv_heads, _head_dim(c, hidden, heads)


# --------------------------------------------------------------------------------------------
# dense families


def _read_llama_like(c: _Cfg, acc: _Acc, model_type: str) -> None:
    """Llama, Mistral, Qwen2/3, Granite, Gemma 1/2/3, Phi-3/4, InternLM-style dense decoders."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
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
        _add_attention(
            acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
            q_bias=qkv_bias, kv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
        )  # fmt: skip
        acc.add("mlp", _gated_mlp(hidden, inter, mlp_bias))
        acc.add("norm", norms_per_layer * hidden)
    acc.add("norm", hidden)
    pattern: Callable[[int], bool] | None = None
    if model_type == "gemma2":
        pattern = lambda i: (i + 1) % 2 != 0  # noqa: E731  even layers slide
    elif model_type in ("gemma3", "gemma3_text"):
        every = c.int("sliding_window_pattern", 6)
        pattern = lambda i: (i + 1) % every != 0  # noqa: E731
    acc.layers = _sliding_layers(c, n_layers, kv_heads, hd, pattern)


def _read_phi(c: _Cfg, acc: _Acc) -> None:
    """Phi-1/1.5/2: parallel attention + MLP block, biases everywhere, one LayerNorm per layer."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    inter = c.int("intermediate_size")
    for _ in range(n_layers):
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                       q_bias=True, kv_bias=True, o_bias=True)  # fmt: skip
        acc.add("mlp", _plain_mlp(hidden, inter, True))
        acc.add("norm", 2 * hidden)
    acc.add("norm", 2 * hidden)
    acc.add("lm_head", c.int("vocab_size"))  # lm_head bias
    acc.layers = [_attn_layer(AttentionKind.FULL, kv_heads, hd) for _ in range(n_layers)]


def _read_opt(c: _Cfg, acc: _Acc) -> None:
    """OPT: learned positions (+2 offset), biases, LayerNorms; optional 350m-style projections."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    inter = c.int("ffn_dim")
    bias = bool(c.get("enable_bias", True))
    for _ in range(n_layers):
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                       q_bias=bias, kv_bias=bias, o_bias=bias)  # fmt: skip
        acc.add("mlp", _plain_mlp(hidden, inter, bias))
        acc.add("norm", 4 * hidden if c.get("layer_norm_elementwise_affine", True) else 0)
    acc.add("pos_embed", (c.int("max_position_embeddings") + 2) * hidden)
    proj = c.int("word_embed_proj_dim", hidden)
    if proj != hidden:
        acc.add("mlp", 2 * proj * hidden)  # project_in / project_out
    if c.get("do_layer_norm_before", True) and proj == hidden:
        acc.add("norm", 2 * hidden)
    acc.layers = [_attn_layer(AttentionKind.FULL, kv_heads, hd) for _ in range(n_layers)]


# --------------------------------------------------------------------------------------------
# MoE families


def _moe_layer_indices(c: _Cfg, n_layers: int) -> list[bool]:
    """Which layers are sparse for Qwen-MoE style configs (decoder_sparse_step, mlp_only_layers)."""
    step = c.int("decoder_sparse_step", 1)
    mlp_only = set(c.get("mlp_only_layers", []) or [])
    n_exp = c.int("num_experts")
    return [
        (i not in mlp_only) and n_exp > 0 and step > 0 and (i + 1) % step == 0
        for i in range(n_layers)
    ]


def _read_mixtral(c: _Cfg, acc: _Acc) -> None:
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    n_exp, topk, inter = (
        int(v) for v in c.req("num_local_experts", "num_experts_per_tok", "intermediate_size")
    )
    for _ in range(n_layers):
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd)
        acc.add("router", hidden * n_exp)
        acc.add("experts", n_exp * _gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_layers)
    acc.layers = _sliding_layers(c, n_layers, kv_heads, hd, None)


def _read_qwen_moe(c: _Cfg, acc: _Acc, model_type: str) -> None:
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    n_exp, topk, moe_inter = (
        int(v) for v in c.req("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    )
    inter = c.int("intermediate_size", 0)
    shared_inter = c.int("shared_expert_intermediate_size", 0)
    is_q2 = model_type == "qwen2_moe"
    sparse = _moe_layer_indices(c, n_layers)
    for i in range(n_layers):
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                       q_bias=is_q2 or bool(c.get("attention_bias")), kv_bias=is_q2 or bool(c.get("attention_bias")),
                       qk_norm=not is_q2)  # fmt: skip
        if sparse[i]:
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * _gated_mlp(hidden, moe_inter))
            if shared_inter:
                acc.add("shared_experts", _gated_mlp(hidden, shared_inter))
                acc.add("router", hidden)  # shared_expert_gate
        else:
            acc.add("mlp", _gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, moe_inter, 1 if shared_inter else 0, shared_inter, sum(sparse))
    acc.layers = _sliding_layers(c, n_layers, kv_heads, hd, None)


def _mla_dims(c: _Cfg) -> tuple[int | None, int, int, int, int]:
    kv_lora, nope, rope, v_dim = (
        int(v) for v in c.req("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    q_lora = c.get("q_lora_rank")
    return (int(q_lora) if q_lora else None), kv_lora, nope, rope, v_dim


def _add_mla(acc: _Acc, c: _Cfg, hidden: int, heads: int) -> LayerSpec:
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
    return LayerSpec(kind=AttentionKind.MLA, num_kv_heads=1, head_size=kv_lora + rope)


def _deepseek_moe_layer(c: _Cfg, i: int) -> bool:
    n_exp = c.get("n_routed_experts") or c.get("num_experts")
    if not n_exp:
        return False
    first_dense = c.int("first_k_dense_replace", 0)
    freq = c.int("moe_layer_freq", 1)
    return i >= first_dense and i % freq == 0


def _add_deepseek_ffn(acc: _Acc, c: _Cfg, hidden: int, i: int, *, into: str | None = None) -> None:
    def put(group: str, n: int) -> None:
        acc.add(into or group, n)

    if _deepseek_moe_layer(c, i):
        n_exp = int(c.get("n_routed_experts") or c.get("num_experts"))
        moe_inter = c.int("moe_intermediate_size")
        n_shared = c.int("n_shared_experts", c.int("num_shared_experts", 0))
        put("router", hidden * n_exp)
        if c.get("topk_method") == "noaux_tc" or c.get("moe_router_activation_func") == "sigmoid":
            put("router", n_exp)  # e_score_correction_bias
        put("experts", n_exp * _gated_mlp(hidden, moe_inter))
        if n_shared:
            put("shared_experts", _gated_mlp(hidden, moe_inter * n_shared))
    else:
        put("mlp", _gated_mlp(hidden, c.int("intermediate_size")))


def _read_deepseek(c: _Cfg, acc: _Acc, vocab: int) -> None:
    """DeepSeek V2/V2.5/V3/R1, Kimi-K2 (MLA + MoE, optional MTP layers)."""
    hidden, n_layers, heads = (
        int(v) for v in c.req("hidden_size", "num_hidden_layers", "num_attention_heads")
    )
    n_exp = int(c.get("n_routed_experts") or 0)
    if not c.has("kv_lora_rank"):
        raise UnsupportedArchitecture(
            f"{c.arch}: DeepSeek config without kv_lora_rank (DeepSeek-V1 style MHA) is not supported",
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
        scratch = _Acc()
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
            n_exp, c.int("num_experts_per_tok"), moe_inter, n_shared, moe_inter * n_shared,
            sum(_deepseek_moe_layer(c, i) for i in range(n_layers)),
        )  # fmt: skip


# vLLM's DeepSeek-V3.2 indexer keeps one fp8 key per token plus an fp32 scale per 128 elements
# (model_executor/models/deepseek_v2.py DeepseekV32IndexerCache: head_dim + head_dim // 128 * 4
# bytes, uint8), as an MLA-type cache of its own in every layer.
V32_INDEXER_QUANT_BLOCK = 128


def _add_v32_indexer(acc: _Acc, c: _Cfg, hidden: int) -> LayerSpec:
    """Count one layer's indexer (wq_b, wk, k_norm, weights_proj) and return its K-cache entry."""
    n_heads, head = c.int("index_n_heads"), c.int("index_head_dim")
    q_lora = c.int("q_lora_rank", hidden)
    # wq_b is replicated (not split by TP) and quantized with the checkpoint; the fused
    # wk + weights_proj is replicated and kept in model dtype (vllm deepseek_v2.py Indexer)
    acc.add("indexer", q_lora * n_heads * head)
    acc.add("router", hidden * head + hidden * n_heads)
    acc.add("norm", 2 * head)
    cache_bytes = head + head // V32_INDEXER_QUANT_BLOCK * 4
    return LayerSpec(kind=AttentionKind.MLA, num_kv_heads=1, head_size=cache_bytes, indexer=True)


def _read_gpt_oss(c: _Cfg, acc: _Acc) -> None:
    """gpt-oss: biased attention with sinks, alternating sliding/full, MXFP4 experts with biases."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    n_exp, inter = c.int("num_local_experts"), c.int("intermediate_size")
    topk = c.int("num_experts_per_tok", c.int("experts_per_token", 4))
    for _ in range(n_layers):
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                       q_bias=True, kv_bias=True, o_bias=True, sinks=True)  # fmt: skip
        acc.add("router", _linear(hidden, n_exp, True))
        acc.add(
            "experts", n_exp * (_linear(hidden, 2 * inter, True) + _linear(inter, hidden, True))
        )
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_layers)
    if c.get("layer_types") is None:
        raise UnsupportedArchitecture(
            f"{c.arch}: gpt-oss config lacks layer_types", "use the model's original config.json"
        )
    acc.layers = _sliding_layers(c, n_layers, kv_heads, hd, None)


def _read_llama4_text(c: _Cfg, acc: _Acc) -> None:
    """Llama-4: MoE every ``interleave_moe_layer_step`` layers with a shared expert; chunked local
    attention on RoPE layers, global NoPE full attention on the others (every 4th by default)."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
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
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                       q_bias=bool(c.get("attention_bias")), kv_bias=bool(c.get("attention_bias")),
                       o_bias=bool(c.get("attention_bias")))  # fmt: skip
        if i in moe_set:
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * _gated_mlp(hidden, inter))
            acc.add("shared_experts", _gated_mlp(hidden, inter))
        else:
            acc.add("mlp", _gated_mlp(hidden, inter_mlp))
        acc.add("norm", 2 * hidden)
        uses_rope = bool(no_rope[i]) if i < len(no_rope) else True
        if uses_rope and chunk:
            acc.layers.append(
                _attn_layer(AttentionKind.CHUNKED, kv_heads, hd, attention_chunk_size=int(chunk))
            )
        else:
            acc.layers.append(_attn_layer(AttentionKind.FULL, kv_heads, hd))
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, 1, inter, len(moe_set))


def _read_granite_moe(c: _Cfg, acc: _Acc, model_type: str) -> None:
    """GraniteMoE / GraniteMoeShared (Granite 3.x MoE)."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    n_exp, topk, inter = (
        c.int("num_local_experts"),
        c.int("num_experts_per_tok"),
        c.int("intermediate_size"),
    )
    shared = c.int("shared_intermediate_size", 0) if model_type == "granitemoeshared" else 0
    for _ in range(n_layers):
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                       q_bias=bool(c.get("attention_bias")), kv_bias=bool(c.get("attention_bias")),
                       o_bias=bool(c.get("attention_bias")))  # fmt: skip
        acc.add("router", hidden * n_exp)
        acc.add("experts", n_exp * _gated_mlp(hidden, inter))
        if shared:
            acc.add("shared_experts", _gated_mlp(hidden, shared))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    acc.moe = MoESpec(n_exp, topk, inter, 1 if shared else 0, shared, n_layers)
    acc.layers = _sliding_layers(c, n_layers, kv_heads, hd, None)


def _read_phimoe(c: _Cfg, acc: _Acc) -> None:
    """Phi-3.5-MoE: Mixtral-like with biased attention and LayerNorms."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    n_exp, topk, inter = (
        c.int("num_local_experts"),
        c.int("num_experts_per_tok"),
        c.int("intermediate_size"),
    )
    bias = bool(c.get("attention_bias", True))
    for _ in range(n_layers):
        _add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                       q_bias=bias, kv_bias=bias, o_bias=bias)  # fmt: skip
        acc.add("router", hidden * n_exp)
        acc.add("experts", n_exp * _gated_mlp(hidden, inter))
        acc.add("norm", 4 * hidden)
    acc.add("norm", 2 * hidden)
    acc.add("lm_head", c.int("vocab_size") if c.get("lm_head_bias") else 0)
    acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_layers)
    acc.layers = _sliding_layers(c, n_layers, kv_heads, hd, None)


# --------------------------------------------------------------------------------------------
# hybrid (Mamba / linear attention) families


def _mamba2_params(hidden: int, inter: int, n_groups: int, state: int, n_heads: int, conv_k: int,
                   conv_bias: bool, proj_bias: bool, gated_norm: bool = True) -> int:  # fmt: skip
    conv_dim = inter + 2 * n_groups * state
    in_proj = _linear(hidden, inter + conv_dim + n_heads, proj_bias)
    conv = conv_dim * conv_k + (conv_dim if conv_bias else 0)
    out = _linear(inter, hidden, proj_bias)
    return in_proj + conv + 3 * n_heads + (inter if gated_norm else 0) + out


def _mamba2_state(inter: int, n_groups: int, state: int, n_heads: int, head_dim: int, conv_k: int,
                  ssm_dtype: str | None = None) -> LayerSpec:  # fmt: skip
    return LayerSpec(
        kind=AttentionKind.MAMBA,
        mamba=MambaStateSpec(
            variant=MambaVariant.MAMBA2, conv_kernel=conv_k, intermediate_size=inter,
            state_size=state, n_groups=n_groups, num_heads=n_heads, head_dim=head_dim,
            ssm_dtype=ssm_dtype,
        ),
    )  # fmt: skip


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


def _read_jamba(c: _Cfg, acc: _Acc) -> None:
    """Jamba: Mamba1 layers with attention every ``attn_layer_period`` (at ``attn_layer_offset``)
    and MoE every ``expert_layer_period`` (at ``expert_layer_offset``)."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
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
            _add_full_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd)
        else:
            acc.add("mamba", _linear(hidden, 2 * m_inter, proj_bias) + m_inter * d_conv
                    + (m_inter if conv_bias else 0) + _linear(m_inter, dt_rank + 2 * d_state)
                    + _linear(dt_rank, m_inter, True) + m_inter * d_state + m_inter
                    + _linear(m_inter, hidden, proj_bias) + dt_rank + 2 * d_state)  # fmt: skip
            acc.layers.append(
                LayerSpec(
                    kind=AttentionKind.MAMBA,
                    mamba=MambaStateSpec(
                        variant=MambaVariant.MAMBA1,
                        conv_kernel=d_conv,
                        intermediate_size=m_inter,
                        state_size=d_state,
                    ),
                )  # fmt: skip
            )
        if n_exp > 1 and i % e_period == e_off:
            acc.add("router", hidden * n_exp)
            acc.add("experts", n_exp * _gated_mlp(hidden, inter))
            n_moe += 1
        else:
            acc.add("mlp", _gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    if n_moe:
        acc.moe = MoESpec(n_exp, topk, inter, num_moe_layers=n_moe)


def _read_nemotron_h(c: _Cfg, acc: _Acc) -> None:
    """Nemotron-H: one block per ``hybrid_override_pattern`` character
    (M = Mamba2, * = attention, - = MLP, E = MoE), each with one RMSNorm."""
    (pattern,) = c.req("hybrid_override_pattern")
    hidden, heads = c.int("hidden_size"), c.int("num_attention_heads")
    kv_heads = c.int("num_key_value_heads", heads)
    hd = _head_dim(c, hidden, heads) if c.get("head_dim") is None else c.int("head_dim")
    m_heads, m_hd = c.int("mamba_num_heads"), c.int("mamba_head_dim")
    n_groups, d_state = c.int("n_groups", 1), c.int("ssm_state_size")
    conv_k = c.int("conv_kernel", 4)
    m_inter = m_heads * m_hd
    inter = c.int("intermediate_size", 0)
    mlp_bias = bool(c.get("mlp_bias", False))
    n_moe = 0
    for ch in str(pattern):
        if ch == "M":
            acc.add("mamba", _mamba2_params(hidden, m_inter, n_groups, d_state, m_heads, conv_k,
                                            bool(c.get("use_conv_bias", True)), bool(c.get("use_bias", False))))  # fmt: skip
            acc.layers.append(_mamba2_state(m_inter, n_groups, d_state, m_heads, m_hd, conv_k,
                                            c.get("mamba_ssm_cache_dtype") or "float32"))  # fmt: skip
        elif ch == "*":
            b = bool(c.get("attention_bias", False))
            _add_full_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd,
                                q_bias=b, kv_bias=b, o_bias=b)  # fmt: skip
        elif ch == "-":
            acc.add("mlp", _plain_mlp(hidden, inter, mlp_bias))
            acc.layers.append(LayerSpec(kind=AttentionKind.NONE))
        elif ch == "E":
            n_exp = c.int("n_routed_experts")
            moe_inter = c.int("moe_intermediate_size")
            shared_inter = c.int("moe_shared_expert_intermediate_size", 0) * c.int(
                "n_shared_experts", 1
            )
            acc.add("router", hidden * n_exp + n_exp)
            acc.add("experts", n_exp * _plain_mlp(hidden, moe_inter, mlp_bias))
            acc.add(
                "shared_experts", _plain_mlp(hidden, shared_inter, mlp_bias) if shared_inter else 0
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
        acc.moe = MoESpec(c.int("n_routed_experts"), c.int("num_experts_per_tok"), c.int("moe_intermediate_size"),
                          c.int("n_shared_experts", 1), c.int("moe_shared_expert_intermediate_size", 0), n_moe)  # fmt: skip


def _read_falcon_h1(c: _Cfg, acc: _Acc) -> None:
    """Falcon-H1: attention and Mamba2 side by side in every layer (two state entries per layer)."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
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
        _add_attention(
            acc,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=b,
            kv_bias=b,
            o_bias=b,
        )
        acc.add("mamba", _mamba2_params(hidden, m_inter, n_groups, d_state, m_heads, conv_k,
                                        bool(c.get("mamba_conv_bias", True)), bool(c.get("mamba_proj_bias", False)),
                                        gated_norm=bool(c.get("mamba_rms_norm", False))))  # fmt: skip
        acc.add("mlp", _gated_mlp(hidden, inter, bool(c.get("mlp_bias", False))))
        acc.add("norm", 2 * hidden)
        acc.layers.append(_attn_layer(AttentionKind.FULL, kv_heads, hd))
        acc.layers.append(_mamba2_state(m_inter, n_groups, d_state, m_heads, m_hd, conv_k))
    acc.add("norm", hidden)


def _read_granite_hybrid(c: _Cfg, acc: _Acc) -> None:
    """Granite-4.0-H (GraniteMoeHybrid): Mamba2/attention per ``layer_types``, MoE + shared MLP."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
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
            acc.add("mamba", _mamba2_params(hidden, m_inter, n_groups, d_state, m_heads, conv_k,
                                            bool(c.get("mamba_conv_bias", True)), bool(c.get("mamba_proj_bias", False))))  # fmt: skip
            acc.layers.append(_mamba2_state(m_inter, n_groups, d_state, m_heads, m_hd, conv_k))
        elif layer_types[i] == "attention":
            b = bool(c.get("attention_bias", False))
            _add_full_attention(
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
            acc.add("experts", n_exp * _gated_mlp(hidden, inter))
        if shared:
            acc.add("shared_experts" if n_exp else "mlp", _gated_mlp(hidden, shared))
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    if n_exp:
        acc.moe = MoESpec(
            n_exp, c.int("num_experts_per_tok"), inter, 1 if shared else 0, shared, n_layers
        )


def _read_qwen3_next(c: _Cfg, acc: _Acc, model_type: str = "qwen3_next") -> None:
    """Qwen3-Next and Qwen3.5: Gated DeltaNet layers with gated full attention every
    ``full_attention_interval`` (or per ``layer_types``); MoE with a gated shared expert
    (Qwen3.5 dense: a plain MLP per layer); optional MTP layers (``num_nextn_predict_layers``,
    Qwen3.5 ``mtp_num_hidden_layers``). Qwen3.5 pins its SSM state dtype (``mamba_ssm_dtype``,
    float32), which vLLM adopts for ``mamba_ssm_cache_dtype`` (model_executor/models/config.py
    Qwen3_5ForConditionalGenerationConfig)."""
    dense = model_type == "qwen3_5_text"
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    nk, dk, nv, dv = (
        int(v)
        for v in c.req(
            "linear_num_key_heads",
            "linear_key_head_dim",
            "linear_num_value_heads",
            "linear_value_head_dim",
        )
    )
    conv_k = c.int("linear_conv_kernel_dim", 4)
    layer_types = c.get("layer_types")
    if layer_types is None:
        interval = c.int("full_attention_interval", 4)
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n_layers)
        ]
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

    def add_ffn(i: int, target: _Acc) -> None:
        if not dense and (sparse[i] if i < n_layers else True):
            target.add("router", hidden * n_exp)
            target.add("experts", n_exp * _gated_mlp(hidden, moe_inter))
            if shared_inter:
                target.add("shared_experts", _gated_mlp(hidden, shared_inter))
                target.add("router", hidden)
        else:
            target.add("mlp", _gated_mlp(hidden, c.int("intermediate_size")))

    for i in range(n_layers):
        if layer_types[i] == "full_attention":
            _add_full_attention(
                acc,
                hidden=hidden,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=hd,
                qk_norm=True,
                q_gate=True,
            )
        else:
            qkvz = 2 * nk * dk + 2 * nv * dv
            conv_dim = 2 * nk * dk + nv * dv
            acc.add(
                "mamba",
                hidden * qkvz
                + hidden * 2 * nv
                + conv_dim * conv_k
                + 2 * nv
                + dv
                + nv * dv * hidden,
            )
            acc.layers.append(_gdn_state(conv_k, nk, dk, nv, dv, ssm_dtype))
        add_ffn(i, acc)
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    n_mtp = c.int("num_nextn_predict_layers", c.int("mtp_num_hidden_layers", 0))
    if n_mtp:
        scratch = _Acc()
        for _ in range(n_mtp):
            _add_attention(
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


def _read_kimi_linear(c: _Cfg, acc: _Acc) -> None:
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
        raise UnsupportedArchitecture(f"{c.arch}: linear_attn_config lacks {', '.join(missing)}",
                                      "use the model's original config.json")  # fmt: skip
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
            # q/k/v projections, their short convs, decay (f_a/f_b, A_log, dt_bias), beta, output gate
            acc.add("mamba", 3 * hidden * proj + 3 * proj * conv_k + hidden * hd + hd * proj + nh
                    + proj + hidden * nh + hidden * hd + hd * proj + hd + proj * hidden)  # fmt: skip
            acc.layers.append(_gdn_state(conv_k, nh, hd, nh, hd))
        _add_deepseek_ffn(acc, c, hidden, i)
        acc.add("norm", 2 * hidden)
    acc.add("norm", hidden)
    n_exp = int(c.get("num_experts") or c.get("n_routed_experts") or 0)
    if n_exp:
        moe_inter = c.int("moe_intermediate_size")
        n_shared = c.int("num_shared_experts", c.int("n_shared_experts", 0))
        topk = c.int("num_experts_per_token", c.int("num_experts_per_tok", 0))
        acc.moe = MoESpec(n_exp, topk, moe_inter, n_shared, moe_inter * n_shared,
                          sum(_deepseek_moe_layer(c, i) for i in range(n_layers)))  # fmt: skip


# --------------------------------------------------------------------------------------------
# multimodal: vision towers (counted into the "vision" group) and the mllama text model


def _vit_block(
    hv: int, iv: int, *, bias: bool = True, gated: bool = False, layernorm: bool = True
) -> int:
    attn = 4 * _linear(hv, hv, bias)
    mlp = (2 * _linear(hv, iv, bias) + _linear(iv, hv, bias)) if gated else _plain_mlp(hv, iv, bias)
    return attn + mlp + 2 * (2 * hv if layernorm else hv)


def _vision_cfg(config: Mapping[str, Any], arch: str) -> _Cfg:
    vc = config.get("vision_config")
    if not isinstance(vc, Mapping):
        raise UnsupportedArchitecture(f"{arch}: multimodal config without vision_config",
                                      "use the model's original config.json")  # fmt: skip
    return _Cfg(vc, f"{arch} vision_config", None)


def _vit_dims(v: _Cfg) -> tuple[int, int, int, int, int]:
    """A ViT tower's hidden, intermediate, layers, patch and image sizes (all required)."""
    hv, iv, n, p, img = (
        int(x)
        for x in v.req(
            "hidden_size", "intermediate_size", "num_hidden_layers", "patch_size", "image_size"
        )
    )
    return hv, iv, n, p, img


def _vision_siglip_gemma3(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
    hv, iv, n, p, img = _vit_dims(v)
    params = 3 * p * p * hv + hv + (img // p) ** 2 * hv + n * _vit_block(hv, iv) + 2 * hv
    params += hv * text_hidden + hv  # mm_input_projection_weight, mm_soft_emb_norm
    tokens = int(config.get("mm_tokens_per_image") or 256)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=n)


def _vision_clip_llava(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
    hv, iv, n, p, img = _vit_dims(v)
    vtype = str(v.get("model_type", "clip_vision_model"))
    positions = (img // p) ** 2 + (1 if "clip" in vtype else 0)
    params = 3 * p * p * hv + positions * hv + n * _vit_block(hv, iv)
    params += hv if "clip" in vtype else hv  # class embedding (CLIP) / conv bias (SigLIP)
    params += 4 * hv  # pre/post layernorm
    bias = bool(config.get("multimodal_projector_bias", True))
    params += _linear(hv, text_hidden, bias) + _linear(text_hidden, text_hidden, bias)
    tokens = (img // p) ** 2
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=n)


def _vision_qwen2_5_vl(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
    hv, iv, depth = (int(x) for x in v.req("hidden_size", "intermediate_size", "depth"))
    p, tp, merge = (
        v.int("patch_size", 14),
        v.int("temporal_patch_size", 2),
        v.int("spatial_merge_size", 2),
    )
    out = v.int("out_hidden_size", text_hidden)
    block = (
        2 * hv
        + _linear(hv, 3 * hv, True)
        + _linear(hv, hv, True)
        + 2 * _linear(hv, iv, True)
        + _linear(iv, hv, True)
    )
    mh = hv * merge * merge
    params = (
        3 * tp * p * p * hv + depth * block + hv + _linear(mh, mh, True) + _linear(mh, out, True)
    )
    # default processor max_pixels 12845056 → 16384 merged tokens for the largest image
    tokens = 12845056 // (p * p * merge * merge)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=depth)


def _vision_qwen2_vl(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
    ed, depth = (int(x) for x in v.req("embed_dim", "depth"))
    iv = int(ed * float(v.get("mlp_ratio", 4)))
    p, tp, merge = (
        v.int("patch_size", 14),
        v.int("temporal_patch_size", 2),
        v.int("spatial_merge_size", 2),
    )
    out = v.int("hidden_size", text_hidden)
    mh = ed * merge * merge
    params = 3 * tp * p * p * ed + depth * _vit_block(ed, iv)
    params += 2 * ed + _linear(mh, mh, True) + _linear(mh, out, True)
    tokens = 12845056 // (p * p * merge * merge)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=ed, num_layers=depth)


def _vision_pixtral(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
    hv, iv, n, p, img = _vit_dims(v)
    merge = int(config.get("spatial_merge_size") or 2)
    params = 3 * p * p * hv + hv + n * _vit_block(hv, iv, bias=False, gated=True, layernorm=False)
    bias = bool(config.get("multimodal_projector_bias", False))
    params += (
        hv
        + hv * merge * merge * hv
        + _linear(hv, text_hidden, bias)
        + _linear(text_hidden, text_hidden, bias)
    )
    side = img // p // merge
    return VisionSpec(
        params=params, max_tokens_per_item=side * (side + 1), hidden_size=hv, num_layers=n
    )


def _vision_mllama(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
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
    params += (
        positions * hv + 1 + n_ratios * tiles * positions * hv
    )  # gated + tile position embeddings
    params += 2 * (n_ratios * tiles * hv + 1)  # pre/post tile positional embeddings with gates
    params += 4 * hv  # layernorm_pre / layernorm_post
    params += n * _vit_block(hv, iv, bias=False) + n * (
        hv + iv
    )  # q/k/v/o without bias, fc with bias
    params += n_global * (_vit_block(hv, iv, bias=False) + hv + iv + 2)
    params += _linear(out_dim, text_hidden, True)
    return VisionSpec(
        params=params,
        max_tokens_per_item=tiles * positions,
        hidden_size=hv,
        num_layers=n + n_global,
    )


def _vision_llama4(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
    hv, iv, n, p, img = _vit_dims(v)
    ratio = float(v.get("pixel_shuffle_ratio", 0.5))
    pin, pout = v.int("projector_input_dim", 4096), v.int("projector_output_dim", 4096)
    vout = v.int("vision_output_dim", pout)
    patches = (img // p) ** 2
    params = 3 * p * p * hv + hv + (patches + 1) * hv + 4 * hv + n * _vit_block(hv, iv)
    params += int(hv / (ratio * ratio)) * pin + pin * pout + vout * text_hidden
    per_tile = int(patches * ratio * ratio)
    return VisionSpec(
        params=params, max_tokens_per_item=17 * per_tile, hidden_size=hv, num_layers=n
    )


def _vision_moonvit(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    v = _vision_cfg(config, arch)
    hv, iv, n = (int(x) for x in v.req("hidden_size", "intermediate_size", "num_hidden_layers"))
    p = v.int("patch_size", 14)
    pos = v.int("init_pos_emb_height", 64) * v.int("init_pos_emb_width", 64)
    mk = v.get("merge_kernel_size") or [2, 2]
    mh = hv * int(mk[0]) * int(mk[1])
    params = 3 * p * p * hv + hv + pos * hv + n * _vit_block(hv, iv) + 2 * hv
    params += 2 * hv + _linear(mh, mh, True) + _linear(mh, text_hidden, True)
    # the media processor caps one image at 4096 patches (in_token_limit) before the 2×2 merge
    return VisionSpec(
        params=params,
        max_tokens_per_item=4096 // (int(mk[0]) * int(mk[1])),
        hidden_size=hv,
        num_layers=n,
    )


_VisionReader = Callable[[Mapping[str, Any], str, int], VisionSpec]
_VISION_BY_MODEL_TYPE: dict[str, _VisionReader] = {  # completed by _register_families()
    "gemma3": _vision_siglip_gemma3,
    "qwen2_5_vl": _vision_qwen2_5_vl,
    "qwen2_vl": _vision_qwen2_vl,
    "mistral3": _vision_pixtral,
    "mllama": _vision_mllama,
    "llama4": _vision_llama4,
    "kimi_vl": _vision_moonvit,
    "llava": _vision_clip_llava,
}


def _read_mllama_text(c: _Cfg, acc: _Acc) -> None:
    """Llama-3.2-Vision text model: Llama self-attention layers plus gated cross-attention layers
    (``cross_attention_layers``) whose K/V come from the image encoder tokens of the request."""
    hidden, n_layers, heads, kv_heads, hd = _dense_core(c)
    inter = c.int("intermediate_size")
    cross = set(int(i) for i in (c.get("cross_attention_layers") or []))
    for i in range(n_layers):
        _add_attention(
            acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd, qk_norm=i in cross
        )
        acc.add("mlp", _gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
        if i in cross:
            acc.add("norm", 2)  # cross_attn_attn_gate, cross_attn_mlp_gate
            acc.layers.append(_attn_layer(AttentionKind.CROSS, kv_heads, hd))
        else:
            acc.layers.append(_attn_layer(AttentionKind.FULL, kv_heads, hd))
    acc.add("norm", hidden)
    acc.add("embed", 8 * hidden)  # 8 extra rows for the image special tokens


# --------------------------------------------------------------------------------------------
# dispatch and the entry point

_TEXT_ALIASES = {
    "qwen2_5_vl": "qwen2",
    "qwen2_vl": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen2_vl_text": "qwen2",
    "mistral3": "mistral",
    "ministral": "mistral",
    "kimi_k2": "deepseek_v3",
    "mllama_text_model": "mllama_text",
}

_Reader = Callable[[_Cfg, _Acc, str], None]


def _readers() -> dict[str, _Reader]:
    llama_like = ("llama", "mistral", "qwen2", "qwen3", "granite", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3",
                  "olmo2")  # fmt: skip
    table: dict[str, _Reader] = {t: _read_llama_like for t in llama_like}
    table.update(
        {
            "phi": lambda c, a, t: _read_phi(c, a),
            "opt": lambda c, a, t: _read_opt(c, a),
            "mixtral": lambda c, a, t: _read_mixtral(c, a),
            "qwen2_moe": _read_qwen_moe,
            "qwen3_moe": _read_qwen_moe,
            "deepseek_v2": lambda c, a, t: _read_deepseek(c, a, c.int("vocab_size")),
            "deepseek_v3": lambda c, a, t: _read_deepseek(c, a, c.int("vocab_size")),
            "deepseek_v32": lambda c, a, t: _read_deepseek(c, a, c.int("vocab_size")),
            "gpt_oss": lambda c, a, t: _read_gpt_oss(c, a),
            "llama4_text": lambda c, a, t: _read_llama4_text(c, a),
            "llama4": lambda c, a, t: _read_llama4_text(c, a),
            "granitemoe": _read_granite_moe,
            "granitemoeshared": _read_granite_moe,
            "phimoe": lambda c, a, t: _read_phimoe(c, a),
            "jamba": lambda c, a, t: _read_jamba(c, a),
            "nemotron_h": lambda c, a, t: _read_nemotron_h(c, a),
            "falcon_h1": lambda c, a, t: _read_falcon_h1(c, a),
            "granitemoehybrid": lambda c, a, t: _read_granite_hybrid(c, a),
            "qwen3_next": _read_qwen3_next,
            "qwen3_5_text": _read_qwen3_next,
            "qwen3_5_moe_text": _read_qwen3_next,
            "kimi_linear": lambda c, a, t: _read_kimi_linear(c, a),
            "mllama_text": lambda c, a, t: _read_mllama_text(c, a),
        }
    )
    return table


def _register_families() -> None:
    """Add the 2025–2026 families (``config_families``) to the dispatch tables."""
    from oomguard.facts import config_families as fam

    _READERS.update({
        "gemma3n_text": fam.read_gemma3n_text,
        "gemma4_text": fam.read_gemma4_text,
        "exaone4": fam.read_exaone4,
        "glm4_moe": fam.read_glm4_moe,
    })  # fmt: skip
    _VISION_BY_MODEL_TYPE.update({
        "gemma3n": fam.vision_gemma3n,
        "gemma4": fam.vision_gemma4,
        "llava_next": fam.vision_llava_next,
        "qwen3_vl": fam.vision_qwen3_vl,
        "qwen3_vl_moe": fam.vision_qwen3_vl,
        "qwen3_5": fam.vision_qwen3_vl,
        "qwen3_5_moe": fam.vision_qwen3_vl,
    })  # fmt: skip
    _TEXT_ALIASES.update({
        "qwen3_vl_text": "qwen3",
        "qwen3_vl_moe_text": "qwen3_moe",
        "gemma3n": "gemma3n_text",
        "gemma4": "gemma4_text",
    })  # fmt: skip


_READERS = _readers()
_register_families()


def supported_model_types() -> list[str]:
    """model_type values this reader accounts for (text decoders and multimodal wrappers)."""
    return sorted(set(_READERS) | set(_VISION_BY_MODEL_TYPE) | set(_TEXT_ALIASES))


def _rope_params(text: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rp = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rp, Mapping):
        return []
    if all(isinstance(v, Mapping) for v in rp.values()) and rp:
        return [
            v for v in rp.values() if isinstance(v, Mapping)
        ]  # per layer type (transformers v5)
    return [rp]


def derive_max_model_len(text: Mapping[str, Any], model_type: str) -> int:
    """vLLM's default ``max_model_len`` for a (text) config (docs/memory-model.md §3.5, vLLM 0.32).

    Min over the length keys (``model_max_length`` overrides), 2048 when none is present, times
    the RoPE ``factor`` unless the rope type keeps the length (llama3/yarn/longrope/...) or the
    model is Gemma-3; LongRoPE models default to ``original_max_position_embeddings``.
    """
    derived: float = math.inf
    for key in _MAX_LEN_KEYS:
        value = text.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            derived = min(derived, value)
    if isinstance(text.get("model_max_length"), (int, float)) and text.get("model_max_length"):
        derived = text["model_max_length"]
    if derived == math.inf:
        derived = 2048
    rope = _rope_params(text)
    if rope and "gemma3" not in model_type:
        factor: float = 1.0
        for rp in rope:
            rope_type = rp.get("rope_type", rp.get("type", "default"))
            if rope_type not in _ROPE_TYPES_NOT_SCALED:
                f = rp.get("factor", factor)
                factor = 1.0 if f is None else float(f)
        derived *= factor
    if any(rp.get("rope_type", rp.get("type")) in ("longrope", "su") for rp in rope):
        original = text.get("original_max_position_embeddings")
        if original:
            return int(original)
    return int(derived)


def _text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], bool]:
    for key in ("text_config", "llm_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping) and sub:
            return sub, True
    return config, False


def spec_from_config(
    config: Mapping[str, Any],
    *,
    name: str,
    source: str,
    param_bytes_by_dtype: Mapping[str, int] | None = None,
) -> ModelSpec:
    """Build the :class:`ModelSpec` for one HF ``config.json`` dict.

    ``name`` is the model's id (used for quantization hints from the repo name), ``source``
    records where the config came from. Raises :class:`UnsupportedArchitecture` for a model type
    it cannot account for (or one missing the fields that size it) and :class:`MalformedConfig`
    for values of the wrong type. The quantization format comes from ``quantization_config``,
    else from the name (``-AWQ``, ``-FP8``…).
    """
    from oomguard.facts.quant import detect_quant  # local import: quant imports nothing from here

    if not isinstance(config, Mapping):
        raise MalformedConfig(f"{source}: config is a {type(config).__name__}, not a JSON object",
                              "point at the model's config.json")  # fmt: skip
    archs = config.get("architectures") or []
    top_type = str(config.get("model_type") or "")
    arch = str(archs[0]) if archs else (top_type or "unknown")
    if not top_type:
        raise UnsupportedArchitecture(f"{arch}: config.json has no model_type",
                                      "use the model's original config.json (it names model_type)")  # fmt: skip
    config = apply_config_defaults(config)
    text, nested = _text_config(config)
    text_type = str(text.get("model_type") or top_type) if nested else top_type
    if top_type == "mllama":
        text_type = "mllama_text"
    if top_type == "kimi_vl" and text_type not in _READERS:
        text_type = "deepseek_v3"
    text_type = _TEXT_ALIASES.get(text_type, text_type)
    reader, caveats = _pick_reader(text, config, arch, text_type)
    vision_reader = _VISION_BY_MODEL_TYPE.get(top_type)
    if nested and "vision_config" in config and vision_reader is None:
        raise UnsupportedArchitecture(
            f"architecture {arch}: vision tower of model_type {top_type!r} is not accounted for",
            f"supported multimodal model types: {', '.join(sorted(_VISION_BY_MODEL_TYPE))}",
        )
    c = _Cfg(text, arch, config if nested else None)
    acc = _Acc()
    try:
        reader(c, acc, text_type)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        # a field of the wrong type or shape (e.g. "hidden_size": "big", short layer list)
        raise MalformedConfig(
            f"{arch}: config.json has a field of the wrong type or length ({type(exc).__name__}: {exc})",
            "fix config.json or use the model's original one",
        ) from None

    hidden = c.int("hidden_size")
    vocab = c.int("vocab_size")
    acc.add(
        "embed",
        vocab * hidden if text_type != "opt" else vocab * c.int("word_embed_proj_dim", hidden),
    )
    tie = _tie_word_embeddings(text, config, text_type, top_type)
    if not tie:
        acc.add(
            "lm_head",
            vocab * (hidden if text_type != "opt" else c.int("word_embed_proj_dim", hidden)),
        )
    if vision_reader is not None and isinstance(config.get("vision_config"), Mapping):
        acc.vision = vision_reader(config, arch, hidden)
        acc.add("vision", acc.vision.params)

    groups = []
    embed_cols = hidden if text_type != "opt" else c.int("word_embed_proj_dim", hidden)
    for gname in sorted(
        acc.counts, key=lambda g: _GROUP_ORDER.index(g) if g in _GROUP_ORDER else 99
    ):
        sharding, quantizable, per_layer, stage = _GROUP_LAYOUT.get(
            gname, (ParamSharding.REPLICATED, False, True, "layers")
        )
        rows = (
            (vocab + (8 if text_type == "mllama_text" and gname == "embed" else 0))
            if sharding is ParamSharding.VOCAB
            else 0
        )
        cols = embed_cols if sharding is ParamSharding.VOCAB else 0
        if gname == "embed_per_layer":
            rows = c.int("vocab_size_per_layer_input", vocab)
            cols = acc.counts[gname] // rows
        groups.append(
            ParamGroup(
                name=gname,
                count=acc.counts[gname],
                sharding=sharding,
                quantizable=quantizable,
                per_layer=per_layer,
                stage=stage,
                rows=rows,
                cols=cols,
            )  # fmt: skip
        )

    attn_layers = [
        ly
        for ly in acc.layers
        if ly.kind
        in (AttentionKind.FULL, AttentionKind.SLIDING, AttentionKind.CHUNKED, AttentionKind.MLA)
    ]
    first_attn = attn_layers[0] if attn_layers else None
    heads = c.int("num_attention_heads", 0)
    n_layers = (
        len(str(c.get("hybrid_override_pattern")))
        if text_type == "nemotron_h"
        else c.int("num_hidden_layers")
    )
    dtype = str(
        text.get("torch_dtype")
        or text.get("dtype")
        or config.get("torch_dtype")
        or config.get("dtype")
        or "float32"
    )
    inter = c.get("intermediate_size") or c.get("moe_intermediate_size") or c.get("ffn_dim") or 0
    if isinstance(inter, list):  # per-layer sizes (Gemma 3n): the widest sets the peak
        inter = max(int(x) for x in inter)
    return ModelSpec(
        name=name,
        architecture=arch,
        model_type=top_type,
        dtype=dtype,
        hidden_size=hidden,
        intermediate_size=int(inter),
        num_layers=n_layers,
        num_attention_heads=heads,
        num_kv_heads=first_attn.num_kv_heads if first_attn else 0,
        head_size=first_attn.head_size if first_attn else 0,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        derived_max_model_len=derive_max_model_len(text, text_type),
        layers=tuple(acc.layers),
        params=tuple(groups),
        quant=detect_quant(config, name),
        moe=acc.moe,
        vision=acc.vision,
        num_mtp_layers=acc.num_mtp_layers,
        checkpoint_bytes_by_dtype=dict(param_bytes_by_dtype or {}),
        source=source,
        verified=not caveats,
        caveats=tuple(caveats),
    )


# model types known to need accounting the readers do not have (the generic reader must not
# guess them): what is missing
_NOT_MODELLED = {
    "deepseek_v4": "DeepSeek-V4's compressed sparse attention (per-layer compress_ratios, a "
    "separate sliding-window cache and compressor state per layer, hyper-connections) is not "
    "modelled",
}


def _pick_reader(
    text: Mapping[str, Any], config: Mapping[str, Any], arch: str, text_type: str
) -> tuple[_Reader, list[str]]:
    """The reader of ``text_type``, else the generic reader with its caveats (or a refusal)."""
    reader = _READERS.get(text_type)
    if reader is not None:
        return reader, []
    if text_type in _NOT_MODELLED:
        raise UnsupportedArchitecture(
            f"architecture {arch} (model_type {text_type!r}) is not supported: "
            f"{_NOT_MODELLED[text_type]}",
            "no workaround yet; plan a supported model of similar size for a rough figure",
        )
    from oomguard.facts import config_generic

    try:
        caveats = config_generic.generic_caveats(text, config, arch, text_type)
    except UnsupportedArchitecture as exc:
        raise UnsupportedArchitecture(
            exc.message, f"{exc.hint}; model types with their own reader: "
            f"{', '.join(supported_model_types())}",
        ) from None  # fmt: skip
    return config_generic.read_generic, caveats


def _tie_word_embeddings(
    text: Mapping[str, Any], top: Mapping[str, Any], text_type: str, top_type: str
) -> bool:
    for cfg in (text, top):
        value = cfg.get("tie_word_embeddings")
        if isinstance(value, bool):
            return value
    return _TIE_DEFAULT_BY_MODEL_TYPE.get(
        text_type, _TIE_DEFAULT_BY_MODEL_TYPE.get(top_type, False)
    )
