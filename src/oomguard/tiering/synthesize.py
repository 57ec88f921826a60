"""The GGUF tensor table a model would have after ``llama-quantize``, for a model without a file.

Shapes follow llama.cpp's tensor layout for llama-style decoders (``token_embd``,
``blk.N.attn_{q,k,v,output}``, ``blk.N.ffn_{gate,up,down}`` or the ``*_exps`` expert
tensors, norms in f32, ``output`` unless the embeddings are tied). Types follow
``llama-quant.cpp`` ``llama_tensor_get_type_impl`` for the recipes named here: the output
matrix in Q6_K (Q8_0 in a Q8_0 file), ``attn_v`` and ``ffn_down`` in Q6_K on the layers
``use_more_bits`` picks (the first and last eighth and every third between) for Q4_K_M and
Q5_K_M, ``attn_v`` in Q5_K instead of Q4_K for 80-layer Llama (``LLM_TYPE_70B``), Q8_0
``attn_k``/``attn_v`` and Q5_K ``attn_output`` for 8-expert models, and the block-size
fallbacks (Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0) for rows that 256 does not divide.
"""

from __future__ import annotations

from oomguard.errors import UnsupportedArchitecture
from oomguard.memory.spec import AttentionKind, ModelSpec
from oomguard.tiering.ggml_types import type_sizes
from oomguard.tiering.model import GGUFModel, GGUFTensor

RECIPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")  # best quality first
_DEFAULT_TYPE = {"Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q4_K_M": "Q4_K"}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fit(type_name: str, ne0: int) -> str:
    if ne0 % type_sizes(type_name)[0] == 0:
        return type_name
    fallback = _FALLBACK.get(type_name, "F16")
    return fallback if ne0 % type_sizes(fallback)[0] == 0 else "F16"


def _layer_types(recipe: str, spec: ModelSpec, i: int) -> dict[str, str]:
    base = _DEFAULT_TYPE[recipe]
    n = spec.num_layers
    experts = spec.moe.num_experts if spec.moe else 0
    more = recipe in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n)
    v = "Q6_K" if more else base
    if spec.num_layers == 80 and spec.model_type == "llama" and v in ("Q3_K", "Q4_K"):
        v = "Q5_K"  # LLM_TYPE_70B
    k, o, down = base, base, ("Q6_K" if more else base)
    if experts == 8 and recipe != "Q8_0":
        v, k = "Q8_0", "Q8_0"
        o = "Q5_K" if recipe == "Q4_K_M" else o
    return {"q": base, "k": k, "v": v, "o": o, "gate": base, "up": base, "down": down}


def _ffn_tensors(spec: ModelSpec, i: int, t: dict[str, str], b: str) -> list[GGUFTensor]:
    """Layer ``i``'s feed-forward tensors: routed (and shared) experts, or a dense MLP."""
    e, moe = spec.hidden_size, spec.moe
    if moe is not None and (moe.num_moe_layers == 0 or i >= spec.num_layers - moe.num_moe_layers):
        ff, n_exp = moe.expert_intermediate_size, moe.num_experts
        tensors = [
            GGUFTensor(b + "ffn_gate_inp.weight", "F32", (e, n_exp)),
            GGUFTensor(b + "ffn_gate_exps.weight", _fit(t["gate"], e), (e, ff, n_exp)),
            GGUFTensor(b + "ffn_up_exps.weight", _fit(t["up"], e), (e, ff, n_exp)),
            GGUFTensor(b + "ffn_down_exps.weight", _fit(t["down"], ff), (ff, e, n_exp)),
        ]
        if moe.shared_expert_intermediate_size:
            sff = moe.shared_expert_intermediate_size * max(1, moe.num_shared_experts)
            tensors += [
                GGUFTensor(b + "ffn_gate_shexp.weight", _fit(t["gate"], e), (e, sff)),
                GGUFTensor(b + "ffn_up_shexp.weight", _fit(t["up"], e), (e, sff)),
                GGUFTensor(b + "ffn_down_shexp.weight", _fit(t["down"], sff), (sff, e)),
            ]
        return tensors
    ff = spec.intermediate_size
    return [
        GGUFTensor(b + "ffn_gate.weight", _fit(t["gate"], e), (e, ff)),
        GGUFTensor(b + "ffn_up.weight", _fit(t["up"], e), (e, ff)),
        GGUFTensor(b + "ffn_down.weight", _fit(t["down"], ff), (ff, e)),
    ]


def synthesize_gguf(spec: ModelSpec, recipe: str = "Q4_K_M") -> GGUFModel:
    """A :class:`GGUFModel` for ``spec`` quantized with ``recipe`` (no file: offsets unknown).

    Raises :class:`UnsupportedArchitecture` for layers whose llama.cpp state is not plain
    K/V (MLA, recurrent, cross-attention) or a vision tower (a separate mmproj file).
    """
    if recipe not in RECIPES:
        raise UnsupportedArchitecture(
            f"unknown GGUF recipe {recipe!r}", f"use one of {', '.join(RECIPES)}"
        )
    kinds = {layer.kind for layer in spec.layers}
    if kinds - {AttentionKind.FULL, AttentionKind.SLIDING}:
        odd = ", ".join(
            sorted(k.value for k in kinds - {AttentionKind.FULL, AttentionKind.SLIDING})
        )
        raise UnsupportedArchitecture(
            f"{spec.name} has {odd} layers, whose llama.cpp memory is not modelled",
            "plan llama.cpp from the model's GGUF file instead",
        )
    e, hd, n_vocab = spec.hidden_size, spec.head_size, spec.vocab_size
    q_dim = spec.num_attention_heads * hd
    kv_heads = tuple(layer.num_kv_heads or spec.num_kv_heads for layer in spec.layers)
    out_type = "Q8_0" if recipe == "Q8_0" else "Q6_K"
    tensors = [
        GGUFTensor(
            "token_embd.weight",
            _fit(out_type if spec.tie_word_embeddings else _DEFAULT_TYPE[recipe], e),
            (e, n_vocab),
        )
    ]
    moe = spec.moe
    for i in range(spec.num_layers):
        t = _layer_types(recipe, spec, i)
        kv_dim = kv_heads[i] * hd
        b = f"blk.{i}."
        tensors += [
            GGUFTensor(b + "attn_norm.weight", "F32", (e,)),
            GGUFTensor(b + "attn_q.weight", _fit(t["q"], e), (e, q_dim)),
            GGUFTensor(b + "attn_k.weight", _fit(t["k"], e), (e, kv_dim)),
            GGUFTensor(b + "attn_v.weight", _fit(t["v"], e), (e, kv_dim)),
            GGUFTensor(b + "attn_output.weight", _fit(t["o"], q_dim), (q_dim, e)),
            GGUFTensor(b + "ffn_norm.weight", "F32", (e,)),
        ]
        tensors += _ffn_tensors(spec, i, t, b)
    tensors.append(GGUFTensor("output_norm.weight", "F32", (e,)))
    if not spec.tie_word_embeddings:
        tensors.append(GGUFTensor("output.weight", _fit(out_type, e), (e, n_vocab)))
    windows = [layer.sliding_window or 0 for layer in spec.layers]
    swa = tuple(layer.kind == AttentionKind.SLIDING for layer in spec.layers)
    return GGUFModel(
        name=f"{spec.name}-{recipe}",
        architecture=spec.model_type,
        n_layer=spec.num_layers,
        n_embd=e,
        n_head=spec.num_attention_heads,
        n_head_kv=kv_heads,
        head_dim_k=hd,
        head_dim_v=hd,
        n_vocab=n_vocab,
        n_ctx_train=spec.derived_max_model_len,
        tensors=tuple(tensors),
        n_expert=moe.num_experts if moe else 0,
        n_expert_used=moe.experts_per_token if moe else 0,
        n_ff=spec.intermediate_size,
        sliding_window=max(windows) if any(swa) else 0,
        swa_layers=swa if any(swa) else (),
        file_type=recipe,
        source=(
            f"tensor table synthesized from {spec.name}'s config with "
            f"llama-quantize's {recipe} recipe"
        ),
    )
