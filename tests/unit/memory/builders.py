"""ModelSpec values for the memory tests, written from the models' published config.json."""

from __future__ import annotations

from typing import Any

from oomguard.memory.spec import (
    AttentionKind,
    LayerSpec,
    MambaStateSpec,
    MambaVariant,
    ModelSpec,
    MoESpec,
    ParamGroup,
    ParamSharding,
    QuantSpec,
)

GIB = 2**30


def params_dense(
    layers: int,
    hidden: int,
    inter: int,
    heads: int,
    kv: int,
    head: int,
    vocab: int,
    tie: bool,
    mlp_count: int | None = None,
) -> tuple[ParamGroup, ...]:
    """Parameter groups of a Llama-style decoder (gated MLP, untied or tied embeddings)."""
    groups = [
        ParamGroup(
            "embed",
            vocab * hidden,
            ParamSharding.VOCAB,
            False,
            per_layer=False,
            stage="first",
            rows=vocab,
            cols=hidden,
        ),
        ParamGroup("attn_qo", layers * 2 * hidden * heads * head, ParamSharding.TP, True),
        ParamGroup("attn_kv", layers * 2 * hidden * kv * head, ParamSharding.KV_REPLICATED, True),
        ParamGroup(
            "mlp",
            mlp_count if mlp_count is not None else layers * 3 * hidden * inter,
            ParamSharding.TP,
            True,
        ),
        ParamGroup("norm", layers * 2 * hidden, ParamSharding.REPLICATED, False),
        ParamGroup(
            "final_norm", hidden, ParamSharding.REPLICATED, False, per_layer=False, stage="last"
        ),
    ]
    if not tie:
        groups.append(
            ParamGroup(
                "lm_head",
                vocab * hidden,
                ParamSharding.VOCAB,
                True,
                per_layer=False,
                stage="last",
                rows=vocab,
                cols=hidden,
            )
        )
    return tuple(groups)


def dense(
    name: str,
    *,
    layers: int,
    hidden: int,
    inter: int,
    heads: int,
    kv: int,
    head: int,
    vocab: int,
    tie: bool = False,
    max_len: int = 131072,
    dtype: str = "bfloat16",
    layer_specs: tuple[LayerSpec, ...] | None = None,
    quant: QuantSpec | None = None,
    moe: MoESpec | None = None,
    params: tuple[ParamGroup, ...] | None = None,
    model_type: str = "llama",
) -> ModelSpec:
    specs = layer_specs or tuple(LayerSpec(AttentionKind.FULL, kv, head) for _ in range(layers))
    return ModelSpec(
        name=name,
        architecture="LlamaForCausalLM",
        model_type=model_type,
        dtype=dtype,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_size=head,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        derived_max_model_len=max_len,
        layers=specs,
        params=params or params_dense(layers, hidden, inter, heads, kv, head, vocab, tie),
        quant=quant or QuantSpec(),
        moe=moe,
    )


def llama_3_1_8b(**kw: Any) -> ModelSpec:
    """meta-llama/Llama-3.1-8B-Instruct config.json."""
    return dense(
        "meta-llama/Llama-3.1-8B-Instruct",
        layers=32,
        hidden=4096,
        inter=14336,
        heads=32,
        kv=8,
        head=128,
        vocab=128256,
        max_len=131072,
        **kw,
    )  # type: ignore[arg-type]


def llama_3_70b() -> ModelSpec:
    """meta-llama/Meta-Llama-3-70B config.json."""
    return dense(
        "meta-llama/Meta-Llama-3-70B",
        layers=80,
        hidden=8192,
        inter=28672,
        heads=64,
        kv=8,
        head=128,
        vocab=128256,
        max_len=8192,
    )


def gpt_oss_120b() -> ModelSpec:
    """openai/gpt-oss-120b: 36 layers alternating sliding-128 / full, 8 KV heads × 64."""
    specs = tuple(
        LayerSpec(AttentionKind.SLIDING, 8, 64, sliding_window=128)
        if i % 2 == 0
        else LayerSpec(AttentionKind.FULL, 8, 64)
        for i in range(36)
    )
    params = params_dense(36, 2880, 2880, 64, 8, 64, 201088, False, mlp_count=0) + (
        ParamGroup("experts", 36 * 128 * (2880 * 5760 + 2880 * 2880), ParamSharding.EXPERTS, True),
    )
    return dense(
        "openai/gpt-oss-120b",
        layers=36,
        hidden=2880,
        inter=2880,
        heads=64,
        kv=8,
        head=64,
        vocab=201088,
        layer_specs=specs,
        model_type="gpt_oss",
        params=params,
        moe=MoESpec(128, 4, 2880, num_moe_layers=36),
    )


def gemma_3_27b() -> ModelSpec:
    """google/gemma-3-27b-it text config: 62 layers, pattern 5 sliding (1024) : 1 full."""
    specs = tuple(
        LayerSpec(AttentionKind.FULL, 16, 128)
        if (i + 1) % 6 == 0
        else LayerSpec(AttentionKind.SLIDING, 16, 128, sliding_window=1024)
        for i in range(62)
    )
    return dense(
        "google/gemma-3-27b-it",
        layers=62,
        hidden=5376,
        inter=21504,
        heads=32,
        kv=16,
        head=128,
        vocab=262208,
        tie=True,
        layer_specs=specs,
        model_type="gemma3",
    )


def deepseek_v3() -> ModelSpec:
    """deepseek-ai/DeepSeek-V3: 61 MLA layers, kv_lora_rank 512 + rope 64."""
    specs = tuple(LayerSpec(AttentionKind.MLA, 1, 576) for _ in range(61))
    return dense(
        "deepseek-ai/DeepSeek-V3",
        layers=61,
        hidden=7168,
        inter=18432,
        heads=128,
        kv=128,
        head=192,
        vocab=129280,
        layer_specs=specs,
        max_len=163840,
        model_type="deepseek_v3",
        moe=MoESpec(256, 8, 2048, 1, 2048, 58),
    )


def qwen3_next_80b() -> ModelSpec:
    """Qwen/Qwen3-Next-80B-A3B: 48 layers, every 4th full attention (2 KV heads × 256), GDN else."""
    gdn = MambaStateSpec(
        MambaVariant.GATED_DELTA_NET,
        conv_kernel=4,
        num_k_heads=16,
        head_k_dim=128,
        num_v_heads=32,
        head_v_dim=128,
    )
    specs = tuple(
        LayerSpec(AttentionKind.FULL, 2, 256)
        if (i + 1) % 4 == 0
        else LayerSpec(AttentionKind.MAMBA, mamba=gdn)
        for i in range(48)
    )
    return dense(
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        layers=48,
        hidden=2048,
        inter=5120,
        heads=16,
        kv=2,
        head=256,
        vocab=151936,
        layer_specs=specs,
        max_len=262144,
        model_type="qwen3_next",
        moe=MoESpec(512, 10, 512, 1, 512, 48),
    )
