"""GGUF headers → ModelSpec, with a tiny real GGUF file written by gguf.GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.facts.gguf import spec_from_gguf
from oomguard.memory.spec import AttentionKind

HIDDEN, FF, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 96


def _write_llama(path: Path, *, arch: str = "llama", tied: bool = False) -> dict[str, int]:
    """Write a 2-layer llama GGUF: Q8_0 linears, F32 norms, F16 embeddings. Returns bytes by
    type."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(4096)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    rng = np.random.default_rng(0)
    expected: dict[str, int] = {}

    def f16(name: str, shape: tuple[int, ...]) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
        expected["F16"] = expected.get("F16", 0) + 2 * int(np.prod(shape))

    def f32(name: str, shape: tuple[int, ...]) -> None:
        w.add_tensor(name, np.ones(shape, dtype=np.float32))
        expected["F32"] = expected.get("F32", 0) + 4 * int(np.prod(shape))

    def q8(name: str, shape: tuple[int, ...]) -> None:
        data = gguf.quants.quantize(
            rng.standard_normal(shape).astype(np.float32), gguf.GGMLQuantizationType.Q8_0
        )
        w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        expected["Q8_0"] = expected.get("Q8_0", 0) + int(np.prod(shape)) // 32 * 34

    hd = HIDDEN // HEADS
    f16("token_embd.weight", (VOCAB, HIDDEN))
    if not tied:
        f16("output.weight", (VOCAB, HIDDEN))
    f32("output_norm.weight", (HIDDEN,))
    for i in range(LAYERS):
        q8(f"blk.{i}.attn_q.weight", (HEADS * hd, HIDDEN))
        q8(f"blk.{i}.attn_k.weight", (KV_HEADS * hd, HIDDEN))
        q8(f"blk.{i}.attn_v.weight", (KV_HEADS * hd, HIDDEN))
        q8(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * hd))
        q8(f"blk.{i}.ffn_gate.weight", (FF, HIDDEN))
        q8(f"blk.{i}.ffn_up.weight", (FF, HIDDEN))
        q8(f"blk.{i}.ffn_down.weight", (HIDDEN, FF))
        f32(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        f32(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_gguf_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "tiny-Q8_0.gguf"
    expected_bytes = _write_llama(path)
    spec = spec_from_gguf(path)
    hd = HIDDEN // HEADS
    assert (
        spec.hidden_size,
        spec.num_layers,
        spec.num_attention_heads,
        spec.num_kv_heads,
        spec.head_size,
    ) == (
        HIDDEN,
        LAYERS,
        HEADS,
        KV_HEADS,
        hd,
    )
    assert (
        spec.vocab_size == VOCAB
        and spec.derived_max_model_len == 4096
        and not spec.tie_word_embeddings
    )
    assert [layer.kind for layer in spec.layers] == [AttentionKind.FULL] * LAYERS
    groups = {g.name: g.count for g in spec.params}
    assert groups["attn_qo"] == LAYERS * 2 * HIDDEN * HEADS * hd
    assert groups["attn_kv"] == LAYERS * 2 * HIDDEN * KV_HEADS * hd
    assert groups["mlp"] == LAYERS * 3 * HIDDEN * FF
    assert groups["embed"] == groups["lm_head"] == VOCAB * HIDDEN
    assert spec.checkpoint_bytes_by_dtype == expected_bytes
    total_elems = spec.total_params
    assert spec.quant.method == "gguf"
    assert spec.quant.gguf_bits_per_weight == pytest.approx(
        8 * sum(expected_bytes.values()) / total_elems
    )
    assert spec.quant.weight_bits == 8  # Q8_0: 8.5 bits per weight rounds to 8


def test_gguf_tied_embeddings(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    _write_llama(path, tied=True)
    spec = spec_from_gguf(path)
    assert spec.tie_word_embeddings and "lm_head" not in {g.name for g in spec.params}


def test_gguf_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "rwkv.gguf"
    _write_llama(path, arch="rwkv6")
    with pytest.raises(UnsupportedArchitecture, match="rwkv6"):
        spec_from_gguf(path)


def test_gguf_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    _write_llama(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(MalformedConfig, match="broken.gguf"):
        spec_from_gguf(path)
