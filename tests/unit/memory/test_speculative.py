"""Speculative decoding (docs/memory-model.md §2.8): each mechanism against vLLM 0.32's source."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomguard.errors import BadInput
from oomguard.memory import kv as kvm
from oomguard.memory import speculative as specm
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import AttentionKind, GPUSpec, LayerSpec, ParamGroup, ParamSharding
from oomguard.memory.versions import resolve_era
from oomguard.memory.weights import weight_bytes_per_stage

from .builders import GIB, deepseek_v3, dense, llama_3_1_8b, qwen3_next_80b

H100 = GPUSpec("H100 SXM", int(79.19 * GIB), 80, compute_capability="9.0")
EAGLE3 = specm.SpeculativeConfig(method="eagle3", model="org/eagle3-head", num_speculative_tokens=3)


def eagle3_head():
    """An EAGLE3 head for Llama-3.1-8B: one decoder layer, fc 3H→H, a 32k draft vocabulary."""
    spec = dense(
        "org/eagle3-head", layers=1, hidden=4096, inter=14336, heads=32, kv=8, head=128,
        vocab=32000,
    )  # fmt: skip
    fc = ParamGroup("mlp", 3 * 4096 * 4096, ParamSharding.TP, True, per_layer=False, stage="last")
    return replace(spec, params=(*spec.params, fc))


# -- reading the flags ------------------------------------------------------------------------


def test_json_is_read_as_vllm_reads_it_and_written_back() -> None:
    cfg = specm.parse_speculative_config(
        '{"method": "eagle3", "model": "m", "num_speculative_tokens": 3,'
        ' "draft_sample_method": "greedy"}'
    )
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("eagle3", "m", 3)
    assert cfg.to_dict() == {
        "method": "eagle3",
        "model": "m",
        "num_speculative_tokens": 3,
        "draft_sample_method": "greedy",
    }
    assert specm.parse_speculative_config(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"method": "eagle3",', "not valid JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"method": "eagle4"}', "not one vLLM 0.32 knows"),
        ('{"num_speculative_tokens": 0}', "not a positive integer"),
        ('{"tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
    ],
)
def test_bad_json_is_one_line_naming_the_fix(text: str, needle: str) -> None:
    with pytest.raises(BadInput) as info:
        specm.parse_speculative_config(text)
    assert needle in info.value.one_line()
    assert "\n" not in info.value.one_line()


def test_family_mtp_names_become_mtp_as_in_vllm() -> None:
    for name in ("deepseek_mtp", "qwen3_next_mtp", "qwen3_5_mtp", "glm4_moe_mtp", "mimo_mtp"):
        assert specm.parse_speculative_config(f'{{"method": "{name}"}}').method == "mtp"


def test_older_flags_fill_the_keys_and_may_not_repeat_one() -> None:
    cfg = specm.merge_legacy(None, "spec-method", "eagle3")
    cfg = specm.merge_legacy(cfg, "spec-model", "m")
    cfg = specm.merge_legacy(cfg, "spec-tokens", "4")
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("eagle3", "m", 4)
    with pytest.raises(BadInput, match="mutually exclusive"):
        specm.merge_legacy(cfg, "spec-tokens", "2")


# -- resolution ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "method"),
    [
        ("yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle"),
        ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
        ("z-lab/Qwen3-8B-DFlash-b16", "dflash"),
        ("meta-llama/Llama-3.2-1B-Instruct", "draft_model"),
        ("ngram", "ngram"),
    ],
)
def test_method_detected_from_the_drafter_name(model: str, method: str) -> None:
    cfg = specm.SpeculativeConfig(model=model, num_speculative_tokens=2)
    spec = specm.resolve_speculation(cfg, llama_3_1_8b(), tp=1, dtype_bytes=2)
    assert spec.method == method


def test_lookahead_slots_and_drafting_slots_per_method() -> None:
    """config/vllm.py num_lookahead_tokens; config/speculative.py max_num_new_slots_for_drafting."""
    k = 4
    table = {
        "eagle3": (k, 0, k - 1),
        "mtp": (k, 0, k - 1),
        "draft_model": (k, 1, k),
        "dflash": (k + 1, k, k),
        "ngram": (0, 0, k - 1),
    }
    for method, (lookahead, slots, parallel_slots) in table.items():
        spec = specm.Speculation(method, k, 1, None)
        assert spec.lookahead_tokens == lookahead, method
        assert spec.drafting_slots(False) == slots, method
        assert spec.drafting_slots(True) == parallel_slots, method
        assert spec.uniform_decode_query_len == k + 1


def test_mtp_tokens_default_to_the_checkpoint_layers_and_must_divide() -> None:
    model = replace(deepseek_v3(), num_mtp_layers=1)
    spec = specm.resolve_speculation(
        specm.SpeculativeConfig(method="mtp"), model, tp=8, dtype_bytes=2
    )
    assert spec.num_speculative_tokens == 1
    two = replace(model, num_mtp_layers=2)
    with pytest.raises(BadInput, match="divisible"):
        specm.resolve_speculation(
            specm.SpeculativeConfig(method="mtp", num_speculative_tokens=3),
            two,
            tp=8,
            dtype_bytes=2,
        )
    with pytest.raises(BadInput, match="no MTP layers"):
        specm.resolve_speculation(
            specm.SpeculativeConfig(method="mtp", num_speculative_tokens=1),
            llama_3_1_8b(),
            tp=1,
            dtype_bytes=2,
        )


def test_draft_tp_is_one_or_the_targets() -> None:
    cfg = replace(EAGLE3, draft_tensor_parallel_size=2)
    with pytest.raises(BadInput, match="other value than 1 or target"):
        specm.resolve_speculation(cfg, llama_3_1_8b(), tp=4, dtype_bytes=2)


def test_capture_sizes_add_uniform_decode_sizes() -> None:
    """config/vllm.py _set_cudagraph_sizes: ceiling min(2·seqs·q, 512), decode sizes n·q."""
    # seqs 4, q 3: ceiling 24; grid 1, 2, 4, 8, 16, 24; decode 3, 6, 12
    assert specm.capture_sizes(4, 2048, 3) == [1, 2, 3, 4, 6, 8, 12, 16, 24]
    # without drafts the largest size is 2·seqs, and max_num_seqs itself is captured
    assert specm.capture_sizes(4, 2048, 1) == [1, 2, 4, 8]
    # 256 sequences, 3 tokens each: the 512 ceiling; decode sizes up to 168 requests × 3
    sizes = specm.capture_sizes(256, 8192, 3)
    assert sizes[-1] == 512 and {3, 6, 72, 504} <= set(sizes) and 528 not in sizes


# -- the KV pool, the weights, the graphs -----------------------------------------------------


def test_eagle3_head_weights_and_kv_layer_join_the_pool_byte_exact() -> None:
    target, head = llama_3_1_8b(), eagle3_head()
    settings = EngineSettings(max_model_len=8192, vllm_version="0.32")
    plain = predict(target, H100, settings)
    with_head = predict(
        target, H100, replace(settings, speculative_config=replace(EAGLE3, draft=head))
    )
    layer_token_bytes = 8 * 128 * 2 * 2
    assert plain.kv_bytes_per_token == 32 * layer_token_bytes
    assert with_head.kv_bytes_per_token == 33 * layer_token_bytes
    assert with_head.bytes_per_block == 33 * 16 * layer_token_bytes  # one group of 33 layers
    head_bytes = sum(weight_bytes_per_stage(head, model_dtype="bfloat16").per_stage_bytes)
    assert with_head.weights.value_bytes - plain.weights.value_bytes == head_bytes
    assert with_head.speculation is not None and with_head.speculation.notes == ()
    assert with_head.kv_cache_tokens < plain.kv_cache_tokens


def test_unknown_drafter_is_said_and_widens_the_range() -> None:
    settings = EngineSettings(max_model_len=8192, vllm_version="0.32")
    known = predict(
        llama_3_1_8b(),
        H100,
        replace(settings, speculative_config=replace(EAGLE3, draft=eagle3_head())),
    )
    unknown = predict(llama_3_1_8b(), H100, replace(settings, speculative_config=EAGLE3))
    assert unknown.speculation is not None
    assert "not available locally" in unknown.speculation.notes[0]
    assert unknown.kv_bytes_per_token == known.kv_bytes_per_token  # one target-shaped layer
    assert unknown.weights.high_bytes > known.weights.high_bytes
    assert unknown.kv_cache_tokens_range[0] < known.kv_cache_tokens_range[0]


def test_deepseek_mtp_adds_one_mla_layer_and_the_mtp_weights() -> None:
    mtp = ParamGroup("mtp", 11_500_000_000, ParamSharding.TP, True, per_layer=False, stage="last")
    model = replace(deepseek_v3(), num_mtp_layers=1, params=(*deepseek_v3().params, mtp))
    settings = EngineSettings(tensor_parallel_size=8, max_model_len=32768, vllm_version="0.32")
    plain = predict(model, H100, settings, strict=False)
    cfg = specm.parse_speculative_config('{"method": "deepseek_mtp", "num_speculative_tokens": 1}')
    spec = predict(model, H100, replace(settings, speculative_config=cfg), strict=False)
    assert spec.kv_bytes_per_token - plain.kv_bytes_per_token == 576 * 2  # one MLA latent
    assert spec.weights.value_bytes - plain.weights.value_bytes == 11_500_000_000 * 2 // 8


def test_hybrid_mamba_state_grows_by_the_drafted_tokens() -> None:
    """MambaSpec.num_speculative_blocks and conv_kernel − 1 + num_spec rows (mamba_utils.py)."""
    model = qwen3_next_80b()
    era = resolve_era("0.32")
    fmt = kvm.CacheFormat(1, 2, "auto", era)
    plain = kvm.mamba_state_sizes(model, fmt)
    drafted = kvm.mamba_state_sizes(model, fmt, 2)
    conv_dim = 2 * 16 * 128 + 32 * 128
    assert next(iter(drafted.values())) - next(iter(plain.values())) == 2 * conv_dim * 2
    bound = kvm.RequestBound(max_model_len=4096, lookahead_tokens=8192, num_speculative_blocks=2)
    state = kvm.Mamba(block_size=16, state_bytes=1)
    assert state.max_blocks_per_request(bound) == 3


def test_qwen3_next_mtp_defaults_to_one_layer_and_estimates_its_weights() -> None:
    model = qwen3_next_80b()
    settings = EngineSettings(tensor_parallel_size=2, max_model_len=32768, vllm_version="0.32")
    cfg = specm.SpeculativeConfig(method="qwen3_next_mtp", num_speculative_tokens=2)
    cfg = replace(cfg, method=specm.check_method(cfg.method))
    plain = predict(model, H100, settings)
    spec = predict(model, H100, replace(settings, speculative_config=cfg))
    assert spec.kv_bytes_per_token - plain.kv_bytes_per_token == (2 // 2) * 256 * 2 * 2
    assert (
        spec.speculation is not None
        and "MTP weights not in the model facts" in (spec.speculation.notes[0])
    )
    assert spec.weights.value_bytes > plain.weights.value_bytes


def test_multi_module_mtp_keeps_sliding_tokens() -> None:
    """kv_cache_utils.py: extra_retained_tokens = num_prefill_lookahead_tokens − 1."""
    model = replace(deepseek_v3(), num_mtp_layers=3)
    spec = specm.Speculation("mtp", 3, 1, None)
    assert spec.sliding_retained_tokens(model) == 2
    assert specm.Speculation("eagle3", 3, 1, None).sliding_retained_tokens(model) == 0
    window = kvm.SlidingWindow(16, None, 8, 256, 256, sliding_window=4096)
    bound = kvm.RequestBound(max_model_len=32768, lookahead_tokens=8192, sliding_retained_tokens=2)
    assert window.max_blocks_per_request(bound) == kvm.cdiv(4095 + 2 + 8192, 16) + 1


def test_batched_tokens_must_exceed_the_drafting_slots() -> None:
    settings = EngineSettings(max_model_len=8192, max_num_seqs=1, max_num_batched_tokens=1)
    cfg = specm.SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2)
    with pytest.raises(BadInput, match="drafting slots=1"):
        predict(llama_3_1_8b(), H100, replace(settings, speculative_config=cfg))


def test_graphs_count_the_drafter_layers_and_decode_sizes() -> None:
    settings = EngineSettings(max_model_len=8192, vllm_version="0.32")
    plain = predict(llama_3_1_8b(), H100, settings)
    spec = predict(
        llama_3_1_8b(),
        H100,
        replace(settings, speculative_config=replace(EAGLE3, draft=eagle3_head())),
    )
    assert spec.cudagraph.value_bytes > plain.cudagraph.value_bytes
    assert "33 layers" in spec.cudagraph.basis


def _graph_count(basis: str) -> int:
    """The graphs an estimate's basis counts ("estimate: N captured sizes × L layers")."""
    return int(basis.split("estimate: ", 1)[1].split(" captured sizes", 1)[0])


def test_graph_count_is_capture_sizes_times_variants_with_a_drafter() -> None:
    """§14.4: the drafter's 1 + K sizes where none are given, given sizes as given; LoRA
    captures each size twice (with and without adapters)."""
    settings = EngineSettings(
        max_model_len=8192,
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        vllm_version="0.32",
        speculative_config=replace(EAGLE3, draft=eagle3_head()),
    )
    drafted = _graph_count(predict(llama_3_1_8b(), H100, settings).cudagraph.basis)
    assert drafted == len(specm.capture_sizes(4, 2048, 4, "9.0"))
    lora = replace(settings, enable_lora=True)
    assert _graph_count(predict(llama_3_1_8b(), H100, lora).cudagraph.basis) == 2 * drafted
    given = replace(lora, cudagraph_capture_sizes=(1, 2, 4, 8))
    assert _graph_count(predict(llama_3_1_8b(), H100, given).cudagraph.basis) == 2 * 4


def test_mtp_layers_copy_the_last_attention_layer() -> None:
    layers = (LayerSpec(AttentionKind.MLA, 1, 576),) * 3
    model = replace(deepseek_v3(), layers=layers, num_layers=3, num_mtp_layers=2)
    assert specm.mtp_layers(model) == (LayerSpec(AttentionKind.MLA, 1, 576),) * 2
