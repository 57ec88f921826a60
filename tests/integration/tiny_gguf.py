"""Write tiny random-weight GGUF models with the ``gguf`` package, for llama-server on CPU.

The weights are random bytes of the right size for each GGML type. Every byte is kept below
0x20, so every f16 field inside a block (scales, minimums) is a finite number below 0.01 and
the model computes finite activations; what it says is noise, which is all a memory test needs.
The vocabulary is a SentencePiece-style ("llama") one with byte fallback, so llama-server
tokenizes any prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# gguf is a core dependency of oomguard
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType


@dataclass(frozen=True)
class GGUFShape:
    """The dimensions of one tiny model; ``weight_type`` is the GGML type of the matrices."""

    name: str
    weight_type: str = "Q8_0"  # a GGMLQuantizationType name
    n_embd: int = 256
    n_ff: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    n_vocab: int = 1024
    n_ctx_train: int = 4096
    tied_output: bool = False  # no output.weight: the head reuses token_embd
    n_expert: int = 0  # > 0: a Mixtral-style MoE (llama architecture with expert tensors)
    n_expert_used: int = 2
    embd_type: str | None = None  # token_embd's type (default: weight_type)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Several GGUF quantization types (block sizes 32 and 256), a tied head, and an MoE.
SHAPES: dict[str, GGUFShape] = {
    "q8_0": GGUFShape("tiny-q8_0", "Q8_0"),
    "q4_0": GGUFShape("tiny-q4_0", "Q4_0"),
    "q4_k": GGUFShape("tiny-q4_k", "Q4_K", embd_type="Q6_K"),
    "q5_k": GGUFShape("tiny-q5_k", "Q5_K", tied_output=True),
    "q6_k": GGUFShape("tiny-q6_k", "Q6_K", n_layer=3),
    "f16": GGUFShape("tiny-f16", "F16", n_layer=2),
    "moe_q4_k": GGUFShape("tiny-moe-q4_k", "Q4_K", n_expert=4, n_expert_used=2, n_layer=3),
}


def _random_tensor(
    rng: np.random.Generator, type_name: str, rows: int, cols: int
) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A ``rows × cols`` matrix (``cols`` is ggml's ne0) as raw bytes of ``type_name``."""
    qtype = GGMLQuantizationType[type_name]
    if qtype == GGMLQuantizationType.F32:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32), qtype
    if qtype == GGMLQuantizationType.F16:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16), qtype
    block, type_bytes = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{type_name} needs rows of a multiple of {block} elements, not {cols}")
    row_bytes = cols // block * type_bytes
    return rng.integers(0, 0x20, size=(rows, row_bytes), dtype=np.uint8), qtype


def _vocabulary(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        a, b = divmod(i, 26)
        piece = "▁" + letters[b] if a == 0 else "▁" + letters[a % 26] + letters[b]
        piece = piece if i < 26 * 27 else f"▁w{i}"
        tokens.append(piece)
        types.append(TokenType.NORMAL)
        i += 1
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(k) for k in range(len(tokens) - 259)]
    return tokens[:n_vocab], scores[:n_vocab], [int(t) for t in types[:n_vocab]]


def write_tiny_gguf(path: Path, shape: GGUFShape, seed: int = 0) -> Path:
    """Write ``shape`` as a GGUF file at ``path`` (random weights) and return the path."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), "llama")
    w.add_name(shape.name)
    w.add_context_length(shape.n_ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_vocab_size(shape.n_vocab)
    if shape.n_expert:
        w.add_expert_count(shape.n_expert)
        w.add_expert_used_count(shape.n_expert_used)
    tokens, scores, types = _vocabulary(shape.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def _add(name: str, data: np.ndarray, qtype: GGMLQuantizationType) -> None:
        # float arrays carry their own type; quantized ones are bytes shaped (…, row bytes)
        raw = qtype if data.dtype == np.uint8 else None
        w.add_tensor(name, data, raw_dtype=raw)

    def matrix(name: str, rows: int, cols: int, type_name: str | None = None) -> None:
        data, qtype = _random_tensor(rng, type_name or shape.weight_type, rows, cols)
        _add(name, data, qtype)

    def experts(name: str, rows: int, cols: int) -> None:
        parts = [_random_tensor(rng, shape.weight_type, rows, cols) for _ in range(shape.n_expert)]
        data = np.stack([p[0] for p in parts])
        _add(name, data, parts[0][1])

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

    q_dim = shape.n_head * shape.head_dim
    kv_dim = shape.n_head_kv * shape.head_dim
    matrix("token_embd.weight", shape.n_vocab, shape.n_embd, shape.embd_type)
    for i in range(shape.n_layer):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight")
        matrix(f"{b}.attn_q.weight", q_dim, shape.n_embd)
        matrix(f"{b}.attn_k.weight", kv_dim, shape.n_embd)
        matrix(f"{b}.attn_v.weight", kv_dim, shape.n_embd)
        matrix(f"{b}.attn_output.weight", shape.n_embd, q_dim)
        norm(f"{b}.ffn_norm.weight")
        if shape.n_expert:
            matrix(f"{b}.ffn_gate_inp.weight", shape.n_expert, shape.n_embd, "F32")
            experts(f"{b}.ffn_gate_exps.weight", shape.n_ff, shape.n_embd)
            experts(f"{b}.ffn_up_exps.weight", shape.n_ff, shape.n_embd)
            experts(f"{b}.ffn_down_exps.weight", shape.n_embd, shape.n_ff)
        else:
            matrix(f"{b}.ffn_gate.weight", shape.n_ff, shape.n_embd)
            matrix(f"{b}.ffn_up.weight", shape.n_ff, shape.n_embd)
            matrix(f"{b}.ffn_down.weight", shape.n_embd, shape.n_ff)
    norm("output_norm.weight")
    if not shape.tied_output:
        matrix("output.weight", shape.n_vocab, shape.n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
