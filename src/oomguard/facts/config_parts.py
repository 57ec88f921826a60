"""The config reader's building blocks: config access, the parameter accumulator and the
parameter counts of the modules every family reader shares (attention, MLPs, ViT blocks).

The family readers (:mod:`oomguard.facts.config_core`, :mod:`oomguard.facts.config_families`,
:mod:`oomguard.facts.config_generic`) count into an :class:`Acc` through these helpers;
:mod:`oomguard.facts.config_reader` turns the counts into a :class:`ModelSpec`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.memory.spec import (
    AttentionKind,
    LayerSpec,
    MoESpec,
    ParamSharding,
    VisionSpec,
)

# (group name) -> (sharding, quantizable, per_layer, stage)
GROUP_LAYOUT: dict[str, tuple[ParamSharding, bool, bool, str]] = {
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
GROUP_ORDER = tuple(GROUP_LAYOUT)


class Cfg:
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
class Acc:
    """Parameter counts by group, plus the layer state list, built up by a family reader."""

    counts: dict[str, int] = field(default_factory=dict)
    layers: list[LayerSpec] = field(default_factory=list)
    moe: MoESpec | None = None
    vision: VisionSpec | None = None
    num_mtp_layers: int = 0
    # family quirks the generic assembly reads: the embedding's width where it differs from
    # hidden_size (OPT's word_embed_proj_dim), the decoder's block count where it is not
    # num_hidden_layers (Nemotron-H's pattern), and embedding rows beyond vocab_size (mllama)
    embed_cols: int | None = None
    num_layers: int | None = None
    extra_vocab_rows: int = 0
    # rotary embeddings where they differ from one per distinct rope parameters at the
    # attention head size: the head size get_rope is given (MLA: qk_rope_head_dim), instances
    # per parameter set (0: no RoPE; DeepSeek-V3.2's indexer adds one), a dtype of their own
    rope_head: int | None = None
    rope_instances: int = 1
    rope_dtype: str | None = None

    def add(self, group: str, n: int) -> None:
        if n:
            self.counts[group] = self.counts.get(group, 0) + int(n)


# --------------------------------------------------------------------------------------------
# building blocks


def linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def add_attention(
    acc: Acc,
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
    acc.add("attn_qo", linear(hidden, q_out, q_bias) + linear(heads * head_dim, hidden, o_bias))
    acc.add("attn_kv", 2 * linear(hidden, kv_heads * head_dim, kv_bias))
    if qk_norm:
        acc.add("norm", 2 * head_dim)
    if sinks:
        acc.add("attn_qo", heads)


def add_full_attention(
    acc: Acc, *, hidden: int, heads: int, kv_heads: int, head_dim: int, **flags: bool
) -> None:
    """Count one full-attention layer's parameters (``flags`` as for ``add_attention``) and
    append its KV layer."""
    add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **flags)
    acc.layers.append(attn_layer(AttentionKind.FULL, kv_heads, head_dim))


def gated_mlp(hidden: int, inter: int, bias: bool = False) -> int:
    return 2 * linear(hidden, inter, bias) + linear(inter, hidden, bias)


def plain_mlp(hidden: int, inter: int, bias: bool = False) -> int:
    return linear(hidden, inter, bias) + linear(inter, hidden, bias)


def attn_layer(kind: AttentionKind, kv_heads: int, head_dim: int, **kw: Any) -> LayerSpec:
    return LayerSpec(kind=kind, num_kv_heads=kv_heads, head_size=head_dim, **kw)


def sliding_layers(
    c: Cfg,
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
                f"{c.arch}: layer_types lists {len(layer_types)} layers, "
                f"num_hidden_layers is {n_layers}",
                "fix layer_types in config.json",
            )
        out = []
        for i in range(n_layers):
            if layer_types[i] == "sliding_attention" and window is not None:
                out.append(
                    attn_layer(
                        AttentionKind.SLIDING, kv_heads, head_dim, sliding_window=int(window)
                    )
                )
            else:
                out.append(attn_layer(AttentionKind.FULL, kv_heads, head_dim))
        return out
    if window is not None:
        return [
            attn_layer(AttentionKind.SLIDING, kv_heads, head_dim, sliding_window=int(window))
            for _ in range(n_layers)
        ]
    return [attn_layer(AttentionKind.FULL, kv_heads, head_dim) for _ in range(n_layers)]


def head_dim_of(c: Cfg, hidden: int, heads: int) -> int:
    hd = c.get("head_dim")
    if hd is not None:
        return int(hd)
    if hidden % heads:
        raise MalformedConfig(
            f"{c.arch}: hidden_size {hidden} is not divisible by num_attention_heads {heads}",
            "set head_dim in config.json",
        )
    return hidden // heads


def dense_core(c: Cfg) -> tuple[int, int, int, int, int]:
    hidden, n_layers, heads = (
        int(v) for v in c.req("hidden_size", "num_hidden_layers", "num_attention_heads")
    )
    kv_heads = int(c.get("num_key_value_heads", heads))
    return hidden, n_layers, heads, kv_heads, head_dim_of(c, hidden, heads)


# --------------------------------------------------------------------------------------------
# vision towers


def vit_block(
    hv: int, iv: int, *, bias: bool = True, gated: bool = False, layernorm: bool = True
) -> int:
    attn = 4 * linear(hv, hv, bias)
    mlp = (2 * linear(hv, iv, bias) + linear(iv, hv, bias)) if gated else plain_mlp(hv, iv, bias)
    return attn + mlp + 2 * (2 * hv if layernorm else hv)


def vision_cfg(config: Mapping[str, Any], arch: str) -> Cfg:
    vc = config.get("vision_config")
    if not isinstance(vc, Mapping):
        raise UnsupportedArchitecture(
            f"{arch}: multimodal config without vision_config",
            "use the model's original config.json",
        )
    return Cfg(vc, f"{arch} vision_config", None)


def vit_dims(v: Cfg) -> tuple[int, int, int, int, int]:
    """A ViT tower's hidden, intermediate, layers, patch and image sizes (all required)."""
    hv, iv, n, p, img = (
        int(x)
        for x in v.req(
            "hidden_size", "intermediate_size", "num_hidden_layers", "patch_size", "image_size"
        )
    )
    return hv, iv, n, p, img
