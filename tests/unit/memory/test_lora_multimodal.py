"""LoRA adapter buffers and multimodal limits, byte-exact where vLLM 0.32's arithmetic is."""

from __future__ import annotations

import dataclasses

import pytest

from oomguard.errors import BadInput
from oomguard.memory import lora
from oomguard.memory import multimodal as mm
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import (
    AttentionKind,
    GPUSpec,
    LayerSpec,
    MoESpec,
    ParamGroup,
    ParamSharding,
    VisionSpec,
)
from oomguard.memory.weights import weight_bytes_per_stage

from .builders import dense, llama_3_1_8b

GIB = 2**30
H100 = GPUSpec(
    "H100 SXM", int(79.19 * GIB), 80, compute_capability="9.0", device_name="NVIDIA H100 80GB HBM3"
)
BF16 = lora.LoraShape(max_loras=1, rank=16, dtype_bytes=2)


def _layer_bytes_llama_8b(loras: int, rank: int, tp: int) -> int:
    """One Llama-3.1-8B layer's buffers, written out tensor by tensor (bf16, 512-B blocks)."""
    h, q, inter, b = 4096, 4096, 14336, 2

    def t(*dims: int) -> int:
        n = loras * b
        for d in dims:
            n *= d
        return -(-n // 512) * 512

    kv_rank = max(1, 8 // tp) * 128
    qkv = 3 * t(rank, h) + t(q // tp, rank) + 2 * t(kv_rank, rank)
    o_proj = t(rank, q // tp) + t(h, rank)
    gate_up = 2 * t(rank, h) + 2 * t(inter // tp, rank)
    down = t(rank, inter // tp) + t(h, rank)
    return qkv + o_proj + gate_up + down


def test_llama_buffers_are_counted_tensor_by_tensor() -> None:
    model = llama_3_1_8b()
    got = lora.lora_stage_bytes(
        model, BF16, range(32), first=True, last=True, tokens=8192, seqs=1024
    )
    vocab = 2 * (128256 * 16 * 2 + 4096 * 16 * 2)  # embedding and LM head: A and B each
    punica = 4 * 8 * 8192 + 3 * 8 * 1024 + 2 * (2 * 4 * 8192 + 2 * 512 + 512)
    assert got.exact
    assert got.bytes == 32 * _layer_bytes_llama_8b(1, 16, 1) + vocab + punica == 92_777_472


def test_tensor_parallel_splits_b_of_column_and_a_of_row_layers_only() -> None:
    model = llama_3_1_8b()
    shape = lora.LoraShape(max_loras=4, rank=64, dtype_bytes=2, tp=4)
    got = lora.lora_stage_bytes(
        model, shape, range(32), first=True, last=False, tokens=2048, seqs=256
    )
    embedding = 4 * 128256 * 64 * 2 + 4 * 4096 * 64 * 2  # not split by TP
    punica = lora.punica_metadata_bytes(2048, 256, 4)
    assert got.bytes == 32 * _layer_bytes_llama_8b(4, 64, 4) + embedding + punica


def test_fully_sharded_divides_column_rank_and_row_output() -> None:
    plain = lora.LoraShape(max_loras=2, rank=32, dtype_bytes=2, tp=2)
    sharded = dataclasses.replace(plain, fully_sharded=True)
    # column-parallel: A [L, 1, r/tp, in]; row-parallel: B [L, 1, out/tp, r]
    assert lora.column_parallel(sharded, 4096, (8192,)) == 2 * 16 * 4096 * 2 + 2 * 4096 * 32 * 2
    assert lora.row_parallel(sharded, 8192, 4096) == 2 * 32 * 4096 * 2 + 2 * 2048 * 32 * 2
    assert lora.column_parallel(plain, 4096, (8192,)) > lora.column_parallel(sharded, 4096, (8192,))


def test_moe_experts_get_per_expert_buffers_split_by_tp_or_ep() -> None:
    shape = lora.LoraShape(max_loras=1, rank=8, dtype_bytes=2, tp=2)
    per_tp = lora.moe_experts(shape, hidden=2048, intermediate=768, experts=128)
    # w1, w3: A [1, E, r, H] and B [1, E, I/tp, r]; w2: A [1, E, r, I/tp] and B [1, E, H, r]
    expected = 2 * (128 * 8 * 2048 * 2 + 128 * 384 * 8 * 2) + 128 * 8 * 384 * 2 + 128 * 2048 * 8 * 2
    assert per_tp == expected
    ep = lora.moe_experts(
        dataclasses.replace(shape, ep=2), hidden=2048, intermediate=768, experts=128
    )
    # expert parallelism: half the experts, the intermediate size whole
    assert ep == 2 * (64 * 8 * 2048 * 2 + 64 * 768 * 8 * 2) + 64 * 8 * 768 * 2 + 64 * 2048 * 8 * 2


def test_models_without_embedding_modules_get_no_vocab_buffers() -> None:
    model = dataclasses.replace(llama_3_1_8b(), architecture="MistralForCausalLM")
    assert lora.vocab_buffers(model, BF16, first=True, last=True) == 0
    gemma_like = dataclasses.replace(llama_3_1_8b(), vocab_size=262208)
    assert lora.head_refused(gemma_like) and not lora.head_refused(model)


def test_layers_of_other_kinds_are_an_estimate() -> None:
    mla = dense(
        "mla",
        layers=2,
        hidden=1024,
        inter=2048,
        heads=8,
        kv=1,
        head=576,
        vocab=1000,
        layer_specs=tuple(LayerSpec(AttentionKind.MLA, 1, 576) for _ in range(2)),
    )
    got = lora.lora_stage_bytes(mla, BF16, range(2), first=True, last=True, tokens=64, seqs=8)
    assert not got.exact and got.bytes > 0


def test_enable_lora_adds_its_buffers_to_the_weights_and_doubles_graphs() -> None:
    model = llama_3_1_8b()
    base = EngineSettings(vllm_version="0.32", max_model_len=8192)
    plain = predict(model, H100, base)
    with_lora = predict(model, H100, dataclasses.replace(base, enable_lora=True))
    added = with_lora.weights.value_bytes - plain.weights.value_bytes
    tokens, seqs = with_lora.settings.max_num_batched_tokens, with_lora.settings.max_num_seqs
    assert tokens is not None and seqs is not None
    expected = lora.lora_stage_bytes(
        model, BF16, range(32), first=True, last=True, tokens=tokens, seqs=seqs
    )
    assert added == expected.bytes
    assert with_lora.weights.high_bytes - plain.weights.high_bytes == expected.bytes
    assert with_lora.activation.value_bytes == plain.activation.value_bytes  # no active adapter
    assert with_lora.cudagraph.value_bytes > plain.cudagraph.value_bytes
    assert with_lora.kv_cache_bytes < plain.kv_cache_bytes


def test_lora_dtype_and_rank_scale_the_buffers() -> None:
    model = llama_3_1_8b()
    base = EngineSettings(vllm_version="0.32", max_model_len=8192, enable_lora=True)
    small = predict(model, H100, base).weights.value_bytes
    fp32_free = predict(model, H100, dataclasses.replace(base, lora_dtype="float16"))
    assert fp32_free.weights.value_bytes == small  # float16 and bfloat16 are both 2 bytes
    big = predict(model, H100, dataclasses.replace(base, max_lora_rank=64, max_loras=4))
    assert big.weights.value_bytes > small


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_loras": 4, "max_cpu_loras": 2}, "below --max-loras"),
        ({"max_lora_rank": 24}, "not a rank vLLM accepts"),
        ({"max_loras": 0}, "at least 1"),
    ],
)
def test_lora_settings_vllm_refuses_are_bad_input(changes: dict[str, int], message: str) -> None:
    settings = EngineSettings(vllm_version="0.32", enable_lora=True, **changes)
    with pytest.raises(BadInput, match=message):
        predict(llama_3_1_8b(), H100, settings)


def test_lora_on_a_vocabulary_above_the_limit_does_not_fit() -> None:
    model = dataclasses.replace(llama_3_1_8b(), vocab_size=262208)
    got = predict(model, H100, EngineSettings(vllm_version="0.32", enable_lora=True))
    assert not got.fits
    assert any(p.code == "lora_vocab_too_large" for p in got.problems)


# --------------------------------------------------------------------------------------------
# multimodal


def _vision_model(model_type: str = "qwen2_5_vl", item: int = 1000):
    model = llama_3_1_8b()
    tower = ParamGroup("vision", 600_000_000, ParamSharding.TP, False, False, stage="first")
    return dataclasses.replace(
        model,
        model_type=model_type,
        params=(*model.params, tower),
        vision=VisionSpec(params=600_000_000, max_tokens_per_item=item, hidden_size=1280),
    )


def test_encoder_profile_follows_the_budget_and_the_limits() -> None:
    model = _vision_model(item=1000)
    kw = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 32768}
    full = mm.encoder_profile(model, None, **kw)
    assert full == mm.EncoderProfile(8192, 8, "image", 8000)  # budget // item
    one = mm.encoder_profile(model, '{"image":{"count":1}}', **{**kw, "max_num_seqs": 3})
    assert one is not None and one.items == 3  # seqs × per prompt
    big = mm.encoder_profile(model, None, **{**kw, "max_num_batched_tokens": 512})
    assert big is not None and (big.budget_tokens, big.items) == (1000, 1)
    assert mm.encoder_profile(model, None, **kw, skip_profiling=True) is None
    assert mm.encoder_profile(model, '{"image":{"count":0},"video":{"count":0}}', **kw) is None
    line = mm.encoder_log_line(full)
    assert line.startswith("Encoder cache will be initialized with a budget of 8192 tokens")


def test_a_tower_with_every_limit_zero_is_not_loaded() -> None:
    model = _vision_model()
    both_off = '{"image":{"count":0},"video":{"count":0}}'
    assert mm.tower_loaded(model, '{"image":{"count":0}}')  # video still served
    assert not mm.tower_loaded(model, both_off)
    view = mm.weights_view(model, both_off, "weights", 1)
    full = weight_bytes_per_stage(model, model_dtype="bfloat16").max_bytes
    assert full - weight_bytes_per_stage(view, model_dtype="bfloat16").max_bytes == 1_200_000_000


def test_encoder_data_mode_replicates_the_tower_where_supported() -> None:
    model = _vision_model()
    split = weight_bytes_per_stage(model, model_dtype="bfloat16", tp=4).max_bytes
    view = mm.weights_view(model, None, "data", 4)
    whole = weight_bytes_per_stage(view, model_dtype="bfloat16", tp=4).max_bytes
    assert whole - split == 1_200_000_000 - 1_200_000_000 // 4
    unsupported = _vision_model("gemma3")
    assert mm.weights_view(unsupported, None, "data", 4) is unsupported


def test_limits_change_the_predicted_activation_and_weights() -> None:
    model = _vision_model(item=1000)
    base = EngineSettings(vllm_version="0.32", max_model_len=8192)
    plain = predict(model, H100, base)
    skip = predict(model, H100, dataclasses.replace(base, skip_mm_profiling=True))
    kept = 8 * 1000 * 4096 * 2  # 8 items of 1,000 tokens at the text width, bf16
    assert plain.activation.value_bytes - skip.activation.value_bytes == kept
    assert any(line.startswith("Encoder cache will be initialized") for line in plain.log_lines)
    off = dataclasses.replace(base, limit_mm_per_prompt='{"image":{"count":0},"video":{"count":0}}')
    text_only = predict(model, H100, off)
    assert text_only.weights.value_bytes < plain.weights.value_bytes
    assert not any("Encoder cache" in line for line in text_only.log_lines)


def test_processor_cache_host_memory() -> None:
    assert mm.processor_cache_host_bytes(None, "lru") == 8 * GIB  # 4 GiB × (1 API + 1 engine)
    assert mm.processor_cache_host_bytes(2.0, "lru", api_servers=2, data_parallel=2) == 8 * GIB
    assert mm.processor_cache_host_bytes(4.0, "shm") == 4 * GIB
    assert mm.processor_cache_host_bytes(0.0, "lru") == 0


def test_size_options_are_recognised() -> None:
    assert mm.has_size_options('{"image":{"count":2,"width":512}}')
    assert not mm.has_size_options('{"image":{"count":2}}')
    assert mm.limit_for('{"image":{"count":2}}', "video") == mm.DEFAULT_LIMIT


def test_moe_layers_use_expert_buffers() -> None:
    moe = dense(
        "moe",
        layers=2,
        hidden=1024,
        inter=512,
        heads=8,
        kv=8,
        head=128,
        vocab=1000,
        moe=MoESpec(8, 2, 512, num_moe_layers=2),
    )
    moe = dataclasses.replace(moe, architecture="Qwen3MoeForCausalLM")
    got = lora.lora_stage_bytes(moe, BF16, range(2), first=False, last=False, tokens=64, seqs=8)
    per_layer = (
        lora.column_parallel(BF16, 1024, (1024, 1024, 1024))
        + lora.row_parallel(BF16, 1024, 1024)
        + lora.replicated(BF16, 1024, 8)
        + lora.moe_experts(BF16, 1024, 512, 8)
    )
    assert got.bytes == 2 * per_layer + lora.punica_metadata_bytes(64, 8, 1)


def test_item_sizes_lower_the_activation_range_to_no_encoder_outputs() -> None:
    model = _vision_model(item=1000)
    base = EngineSettings(vllm_version="0.32", max_model_len=8192)
    plain = predict(model, H100, base)
    sized_limits = '{"image":{"count":2,"width":448}}'
    sized = predict(model, H100, dataclasses.replace(base, limit_mm_per_prompt=sized_limits))
    assert sized.activation.value_bytes == plain.activation.value_bytes
    assert plain.activation.low_bytes - sized.activation.low_bytes == 8 * 1000 * 4096 * 2
    assert sized.kv_cache_bytes_range[1] > plain.kv_cache_bytes_range[1]


def test_the_encoder_pass_and_a_video_item_bound_the_activation() -> None:
    model = _vision_model(item=4096)
    base = EngineSettings(vllm_version="0.32", max_model_len=32768)
    images = dataclasses.replace(base, limit_mm_per_prompt='{"video":{"count":0}}')
    both = predict(model, H100, base)
    image_only = predict(model, H100, images)
    assert both.activation.value_bytes == image_only.activation.value_bytes
    # a video item at its largest: 7 image-sized groups (28,672 tokens) instead of 2 images
    extra = (7 * 4096 - 2 * 4096) * 4096 * 2
    assert both.activation.high_bytes - image_only.activation.high_bytes >= extra
    # a wide tower's pass outweighs the text phase: its estimate is the value
    assert model.vision is not None
    wide = dataclasses.replace(model, vision=dataclasses.replace(model.vision, hidden_size=16384))
    got = predict(wide, H100, images)
    expected = mm.encoder_pass_bytes(wide, 8192, 2) + 8192 * 4096 * 2
    assert got.activation.value_bytes == expected > image_only.activation.value_bytes
    assert got.activation.high_bytes >= 2 * mm.encoder_pass_bytes(wide, 8192, 2)


def test_a_dropped_tower_leaves_the_checkpoint_cross_check_out() -> None:
    model = dataclasses.replace(
        _vision_model(), checkpoint_bytes_by_dtype={"BF16": 2 * 8_630_000_000}
    )
    view = mm.weights_view(model, '{"image":{"count":0},"video":{"count":0}}', "weights", 1)
    assert view.checkpoint_bytes_by_dtype == {} and view.vision is None
    basis = weight_bytes_per_stage(view, model_dtype="bfloat16").basis
    assert "checkpoint" not in basis
