"""Readers for the architectures of 2025–2026: Gemma 3n and Gemma 4, EXAONE 4, GLM-4.5/4.6
(``glm4_moe``), LLaVA-NeXT, and the Qwen3-VL / Qwen3.5 vision tower.

Each reader counts the parameters of the modules vLLM builds for the model
(``vllm/model_executor/models/<family>.py`` of vLLM 0.33) and lists each decoder layer's KV
state the way the model's ``get_kv_cache_spec`` does: per-layer head sizes and KV heads,
sliding windows, and layers that share another layer's KV (no state of their own). The
building blocks (:class:`Cfg`, :class:`Acc`, linear and MLP counts) are :mod:`config_parts`'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.facts.config_core import vision_clip_llava
from oomguard.facts.config_parts import (
    Acc,
    Cfg,
    add_attention,
    attn_layer,
    dense_core,
    gated_mlp,
    linear,
    vision_cfg,
)
from oomguard.memory.spec import AttentionKind, LayerSpec, MoESpec, VisionSpec

# --------------------------------------------------------------------------------------------
# Gemma 3n


def _gemma3n_kv_layers(c: Cfg, n_layers: int, kv_heads: int, hd: int) -> list[LayerSpec]:
    """Sliding/full layers; the last ``num_kv_shared_layers`` reuse an earlier layer's KV.

    vllm gemma3n.py / gemma4.py: a shared layer's attention names the last non-shared layer of
    its type as ``kv_sharing_target_layer_name``; vLLM gives it no KV spec (§4.5).
    """
    layer_types = list(c.get("layer_types") or [])
    if not layer_types:
        every = c.int("sliding_window_pattern", 5)
        layer_types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    if len(layer_types) < n_layers:
        raise MalformedConfig(
            f"{c.arch}: layer_types lists {len(layer_types)} layers, "
            f"num_hidden_layers is {n_layers}",
            "fix layer_types in config.json",
        )
    first_shared = n_layers - c.int("num_kv_shared_layers", 0)
    window = c.get("sliding_window")
    out: list[LayerSpec] = []
    for i in range(n_layers):
        if i >= first_shared:
            out.append(LayerSpec(kind=AttentionKind.NONE))
        elif layer_types[i] == "sliding_attention" and window:
            out.append(attn_layer(AttentionKind.SLIDING, kv_heads, hd, sliding_window=int(window)))
        else:
            out.append(attn_layer(AttentionKind.FULL, kv_heads, hd))
    return out


def read_gemma3n_text(c: Cfg, acc: Acc, model_type: str) -> None:
    """Gemma 3n text model: AltUp, LAuReL and per-layer embeddings around Gemma attention."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    inter = c.get("intermediate_size")
    inters = [int(x) for x in inter] if isinstance(inter, list) else [int(inter)] * n_layers
    if len(inters) != n_layers:
        raise MalformedConfig(
            f"{c.arch}: intermediate_size lists {len(inters)} layers",
            "give one size per layer or one for all",
        )
    n_alt = c.int("altup_num_inputs", 4)
    rank = c.int("laurel_rank", 64)
    hpl = c.int("hidden_size_per_layer_input", 0)
    acc.layers = _gemma3n_kv_layers(c, n_layers, kv_heads, hd)
    for i in range(n_layers):
        shared = acc.layers[i].kind is AttentionKind.NONE
        acc.add("attn_qo", 2 * hidden * heads * hd)  # q_proj, o_proj
        acc.add("norm", hd)  # q_norm
        if not shared:
            acc.add("attn_kv", 2 * hidden * kv_heads * hd)
            acc.add("norm", hd)  # k_norm
        acc.add("mlp", gated_mlp(hidden, inters[i]))
        acc.add("norm", 4 * hidden)
        acc.add("norm", 6 * hidden + n_alt * n_alt + n_alt**3)  # AltUp scales, coefs, router
        acc.add("mlp", 2 * rank * hidden)  # LAuReL left/right
        acc.add("norm", hidden)  # post-LAuReL norm
        if hpl:
            acc.add("mlp", 2 * hidden * hpl)  # per-layer input gate and projection
            acc.add("norm", hidden)
    acc.add("norm", hidden)
    if hpl:
        per_layer_vocab = c.int("vocab_size_per_layer_input", c.int("vocab_size"))
        acc.add("embed_per_layer", per_layer_vocab * n_layers * hpl)
        acc.add("mlp", hidden * n_layers * hpl)  # per_layer_model_projection
        acc.add("norm", hpl)
    acc.add("mlp", 2 * (n_alt - 1) * hidden * hidden)  # AltUp (un)embed projections


def _gemma3n_audio_params(audio: Mapping[str, Any]) -> int:
    """Gemma 3n's conformer audio encoder (USM): sub-sampling convs, then per layer two
    feed-forward halves, relative-position attention, a light convolution and a norm."""
    h = int(audio.get("hidden_size") or 1536)
    layers = int(audio.get("conf_num_hidden_layers") or 12)
    heads = int(audio.get("conf_num_attention_heads") or 8)
    kernel = int(audio.get("conf_conv_kernel_size") or 5)
    channels = [int(x) for x in audio.get("sscp_conv_channel_size") or [128, 32]]
    feats = int(audio.get("input_feat_size") or 128)
    sub = channels[0] * 9 + channels[0] + channels[1] * channels[0] * 9 + channels[1]
    sub += h * channels[1] * (feats // 4)
    per_layer = 24 * h * h + 9 * h + h // heads + h * kernel
    return sub + layers * per_layer


def _multimodal_embedder(vocab: int, tower_hidden: int, text_hidden: int) -> int:
    """Gemma 3n's embed_vision / embed_audio: soft-token table, two norms, a projection."""
    return vocab * tower_hidden + 2 * tower_hidden + tower_hidden * text_hidden


def vision_gemma3n(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    """MobileNet-V5 vision tower (timm; its architecture name states its size) and the
    conformer audio tower, with their embedders."""
    v = vision_cfg(config, arch)
    name = str(v.get("architecture") or "")
    size = re.search(r"_(\d+)m_", name + "_")
    if not size:
        raise UnsupportedArchitecture(
            f"{arch}: vision tower {name!r} does not state its size",
            "use the model's original config.json (vision_config.architecture)",
        )
    params = int(size.group(1)) * 10**6
    hv = int(v.get("hidden_size") or 2048)
    params += _multimodal_embedder(int(v.get("vocab_size") or 128), hv, text_hidden)
    audio = config.get("audio_config")
    if isinstance(audio, Mapping):
        params += _gemma3n_audio_params(audio)
        params += _multimodal_embedder(
            int(audio.get("vocab_size") or 128), int(audio.get("hidden_size") or 1536), text_hidden
        )
    tokens = int(config.get("vision_soft_tokens_per_image") or 256)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv)


# --------------------------------------------------------------------------------------------
# Gemma 4


def _gemma4_layer_dims(c: Cfg, layer_type: str) -> tuple[int, int]:
    """(KV heads, head size) of one layer: full-attention layers use the global figures."""
    kv, hd = c.int("num_key_value_heads"), c.int("head_dim")
    if layer_type == "full_attention":
        hd = c.int("global_head_dim", hd)
        kv = c.int("num_global_key_value_heads", kv)
    return kv, hd


def read_gemma4_text(c: Cfg, acc: Acc, model_type: str) -> None:
    """Gemma 4: sliding and full layers with their own head sizes and KV heads, optional MoE
    beside the dense MLP, per-layer embeddings and KV sharing (E2B/E4B).

    ``attention_k_eq_v`` full layers ship only ``k_proj``; vLLM loads it into both K and V
    slots of its QKV layer (vllm gemma4.py), so the V copy costs memory, not checkpoint bytes.
    """
    hidden, n_layers, heads = (
        int(v) for v in c.req("hidden_size", "num_hidden_layers", "num_attention_heads")
    )
    layer_types = list(c.req("layer_types")[0])
    first_shared = n_layers - c.int("num_kv_shared_layers", 0)
    k_eq_v = bool(c.get("attention_k_eq_v", False))
    inter = c.int("intermediate_size")
    n_exp = int(c.get("num_experts") or 0)
    hpl = c.int("hidden_size_per_layer_input", 0)
    window = c.get("sliding_window")
    for i in range(n_layers):
        kv, hd = _gemma4_layer_dims(c, layer_types[i])
        shared = i >= first_shared
        acc.add("attn_qo", 2 * hidden * heads * hd)
        acc.add("norm", hd)
        if shared:
            acc.layers.append(LayerSpec(kind=AttentionKind.NONE))
        else:
            acc.add("norm", hd)  # k_norm (v_norm has no weight)
            same_kv = k_eq_v and layer_types[i] == "full_attention"
            acc.add("attn_kv", hidden * kv * hd * (1 if same_kv else 2))
            if same_kv:
                acc.add("runtime_copy", hidden * kv * hd)
            sliding = layer_types[i] == "sliding_attention" and window
            acc.layers.append(
                attn_layer(AttentionKind.SLIDING, kv, hd, sliding_window=int(window))
                if sliding
                else attn_layer(AttentionKind.FULL, kv, hd)
            )
        wide = 2 if (shared and c.get("use_double_wide_mlp")) else 1
        acc.add("mlp", gated_mlp(hidden, inter * wide))
        acc.add("norm", 4 * hidden)
        if n_exp:
            moe_inter = c.int("moe_intermediate_size")
            acc.add("router", hidden + n_exp + hidden * n_exp)
            acc.add("experts", n_exp * gated_mlp(hidden, moe_inter))
            acc.add("norm", 3 * hidden)
        if hpl:
            acc.add("mlp", 2 * hidden * hpl)
            acc.add("norm", hidden)
    acc.add("norm", hidden)
    if hpl:
        per_layer_vocab = c.int("vocab_size_per_layer_input", c.int("vocab_size"))
        acc.add("embed_per_layer", per_layer_vocab * n_layers * hpl)
        acc.add("mlp", hidden * n_layers * hpl)
        acc.add("norm", hpl)
    if n_exp:
        topk = c.int("top_k_experts", c.int("num_experts_per_tok", 8))
        acc.moe = MoESpec(n_exp, topk, c.int("moe_intermediate_size"), num_moe_layers=n_layers)


def _gemma4_audio_params(audio: Mapping[str, Any], text_hidden: int) -> int:
    """Gemma 4's conformer audio tower (E2B/E4B): Gemma 3n's conformer layers, an output
    projection to ``output_proj_dims`` with bias, and the embedder's projection into the text
    model (transformers Gemma4AudioModel / embed_audio; clipped linears add buffers only)."""
    h = int(audio.get("hidden_size") or 1024)
    out = int(audio.get("output_proj_dims") or h)
    tower = _gemma3n_audio_params(
        {
            "hidden_size": h,
            "conf_num_hidden_layers": audio.get("num_hidden_layers") or 12,
            "conf_num_attention_heads": audio.get("num_attention_heads") or 8,
            "conf_conv_kernel_size": audio.get("conv_kernel_size") or 5,
            "sscp_conv_channel_size": audio.get("subsampling_conv_channels") or [128, 32],
            "input_feat_size": audio.get("num_mel_bins") or 128,
        }
    )
    return tower + h * out + out + out * text_hidden


def vision_gemma4(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    """Gemma 4's vision tower: a linear patch embedder with a 2-D position table, Gemma-style
    encoder layers (q/k/v/o, q/k norms, gated MLP, four norms), and the projection into the
    text model; plus the audio tower of the E2B/E4B models when the config has one."""
    v = vision_cfg(config, arch)
    hv, iv, n, p = (
        int(x) for x in v.req("hidden_size", "intermediate_size", "num_hidden_layers", "patch_size")
    )
    heads = v.int("num_attention_heads")
    hd = v.int("head_dim", hv // heads)
    positions = v.int("position_embedding_size", 10240)
    params = 3 * p * p * hv + 2 * positions * hv
    params += n * (4 * hv * heads * hd + 2 * hd + 3 * hv * iv + 4 * hv)
    params += hv * text_hidden
    audio = config.get("audio_config")
    if isinstance(audio, Mapping):
        params += _gemma4_audio_params(audio, text_hidden)
    tokens = int(
        config.get("vision_soft_tokens_per_image") or v.get("default_output_length") or 280
    )
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=n)


# --------------------------------------------------------------------------------------------
# EXAONE 4 and GLM-4.5


def exaone4_layer_types(c: Cfg, n_layers: int) -> list[str]:
    """``layer_types``, or transformers' rule from ``sliding_window_pattern`` ("LLLG" or 4)."""
    layer_types = c.get("layer_types")
    if layer_types:
        return [str(t) for t in layer_types]
    if c.get("sliding_window") is None:
        return ["full_attention"] * n_layers
    pattern = c.get("sliding_window_pattern", 4)
    if isinstance(pattern, str):
        letters = pattern.upper()
        return [
            "full_attention" if letters[i % len(letters)] == "G" else "sliding_attention"
            for i in range(n_layers)
        ]
    every = int(pattern)
    return [
        "sliding_attention" if every and (i + 1) % every != 0 else "full_attention"
        for i in range(n_layers)
    ]


def read_exaone4(c: Cfg, acc: Acc, model_type: str) -> None:
    """EXAONE 4: QK-norm attention, post-attention and post-feed-forward norms only, local
    (sliding) and global layers per ``sliding_window_pattern``."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    inter = c.int("intermediate_size")
    window = c.get("sliding_window")
    for kind in exaone4_layer_types(c, n_layers):
        add_attention(acc, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hd, qk_norm=True)
        acc.add("mlp", gated_mlp(hidden, inter))
        acc.add("norm", 2 * hidden)
        if kind == "sliding_attention" and window:
            acc.layers.append(
                attn_layer(AttentionKind.SLIDING, kv_heads, hd, sliding_window=int(window))
            )
        else:
            acc.layers.append(attn_layer(AttentionKind.FULL, kv_heads, hd))
    acc.add("norm", hidden)


def read_glm4_moe(c: Cfg, acc: Acc, model_type: str) -> None:
    """GLM-4.5 / 4.6 (``glm4_moe``): GQA attention with QKV bias and optional QK-norm, dense MLP
    for the first ``first_k_dense_replace`` layers, then sigmoid-routed MoE with one shared
    expert; MTP layers (``num_nextn_predict_layers``) in the checkpoint."""
    hidden, n_layers, heads, kv_heads, hd = dense_core(c)
    bias = bool(c.get("attention_bias", False))
    qk_norm = bool(c.get("use_qk_norm", False))
    first_dense = c.int("first_k_dense_replace", 0)
    n_exp, topk, moe_inter = (
        c.int("n_routed_experts"),
        c.int("num_experts_per_tok"),
        c.int("moe_intermediate_size"),
    )
    n_shared = c.int("n_shared_experts", 0)
    vocab = c.int("vocab_size")

    def layer(target: Acc, i: int) -> None:
        add_attention(
            target,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=hd,
            q_bias=bias,
            kv_bias=bias,
            qk_norm=qk_norm,
        )
        if i < first_dense:
            target.add("mlp", gated_mlp(hidden, c.int("intermediate_size")))
        else:
            target.add("router", hidden * n_exp + n_exp)  # gate and e_score_correction_bias
            target.add("experts", n_exp * gated_mlp(hidden, moe_inter))
            if n_shared:
                target.add("shared_experts", gated_mlp(hidden, moe_inter * n_shared))
        target.add("norm", 2 * hidden)

    for i in range(n_layers):
        layer(acc, i)
        acc.layers.append(attn_layer(AttentionKind.FULL, kv_heads, hd))
    acc.add("norm", hidden)
    n_mtp = c.int("num_nextn_predict_layers", 0)
    if n_mtp:
        scratch = Acc()
        for _ in range(n_mtp):
            layer(scratch, n_layers)
        # enorm, hnorm, eh_proj (2H → H), shared_head norm and its own embedding and head
        extra = 2 * hidden + 2 * hidden * hidden + hidden + 2 * vocab * hidden
        acc.add("mtp", sum(scratch.counts.values()) + n_mtp * extra)
        acc.num_mtp_layers = n_mtp
    acc.moe = MoESpec(
        n_exp, topk, moe_inter, n_shared, moe_inter * n_shared, n_layers - first_dense
    )


# --------------------------------------------------------------------------------------------
# vision towers: LLaVA-NeXT (CLIP + anyres) and Qwen3-VL / Qwen3.5


def llava_next_max_tokens(config: Mapping[str, Any], image: int, patch: int) -> int:
    """Placeholder tokens of the largest image LLaVA-NeXT's anyres grid takes (vllm
    llava_next.py ``get_image_size_with_most_features``): the base view plus every tile's
    features and one newline per feature row, at each grid pinpoint."""
    side = image // patch
    strategy = str(config.get("vision_feature_select_strategy") or "default")
    base = side * side + (1 if strategy == "full" else 0)
    best = base
    for pin in config.get("image_grid_pinpoints") or [[image, image]]:
        height, width = int(pin[0]), int(pin[1])
        rows, cols = height // image * side, width // image * side
        best = max(best, base + rows * cols + rows)
    return best


def vision_llava_next(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    """LLaVA-NeXT: the LLaVA CLIP tower and projector plus ``image_newline`` (one text-width
    vector); anyres images cost up to :func:`llava_next_max_tokens` placeholder tokens."""
    spec = vision_clip_llava(config, arch, text_hidden)
    v = vision_cfg(config, arch)
    tokens = llava_next_max_tokens(config, v.int("image_size"), v.int("patch_size"))
    return VisionSpec(
        params=spec.params + text_hidden,
        max_tokens_per_item=tokens,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
    )


def vision_qwen3_vl(config: Mapping[str, Any], arch: str, text_hidden: int) -> VisionSpec:
    """Qwen3-VL / Qwen3.5 vision tower: 3-D patch conv, learned position table, pre-norm ViT
    blocks with biases, a 2×2 patch merger and one more merger per DeepStack level."""
    v = vision_cfg(config, arch)
    hv, iv, depth = (int(x) for x in v.req("hidden_size", "intermediate_size", "depth"))
    p, tp, merge = (
        v.int("patch_size", 16),
        v.int("temporal_patch_size", 2),
        v.int("spatial_merge_size", 2),
    )
    channels = v.int("in_channels", 3)
    out = v.int("out_hidden_size", text_hidden)
    mh = hv * merge * merge
    block = (
        4 * hv
        + linear(hv, 3 * hv, True)
        + linear(hv, hv, True)
        + linear(hv, iv, True)
        + linear(iv, hv, True)
    )
    params = linear(channels * tp * p * p, hv, True) + v.int("num_position_embeddings", 2304) * hv
    params += depth * block
    merger = linear(mh, mh, True) + linear(mh, out, True)
    params += 2 * hv + merger
    params += len(v.get("deepstack_visual_indexes") or []) * (2 * mh + merger)
    # the default processor caps an image at 16,777,216 pixels: 16,384 merged tokens at patch 16
    tokens = 16_777_216 // (p * p * merge * merge)
    return VisionSpec(params=params, max_tokens_per_item=tokens, hidden_size=hv, num_layers=depth)
