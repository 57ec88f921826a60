"""The one GGUF reader (``gguf`` package, header only) and the model facts it gives vLLM.

:func:`read_header` opens a file once and decodes its fields and tensor table; the llama.cpp
model (:func:`oomguard.tiering.gguf_file.read_gguf`) and :func:`spec_from_gguf` are built on
it. For vLLM the metadata is mapped onto the HF config keys the config reader understands (so
layer kinds and the default context come from one place); parameter counts and bytes come
from the tensor table itself, which is exact.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.facts.config_reader import spec_from_config
from oomguard.memory.spec import ModelSpec, ParamGroup, ParamSharding, QuantSpec

# GGUF general.architecture → HF model_type
_ARCH_TO_MODEL_TYPE = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "granite": "granite",
}

# tensor-name patterns (per-block names follow "blk.N.") → parameter group
_TENSOR_GROUPS: tuple[tuple[str, str], ...] = (
    (r"^token_embd\.", "embed"),
    (r"^output\.", "lm_head"),
    (r"^output_norm\.", "norm"),
    (r"\.ffn_(gate|up|down)_shexp\.", "shared_experts"),
    (r"\.ffn_gate_inp_shexp\.", "router"),
    (r"\.ffn_(gate|up|down|gate_up)_exps\.", "experts"),
    (r"\.ffn_gate_inp\.", "router"),
    (r"\.attn_(q|output)\.", "attn_qo"),
    (r"\.attn_(k|v)\.", "attn_kv"),
    (r"\.attn_qkv\.", "attn_qkv"),
    (r"\.ffn_(gate|up|down)\.", "mlp"),
    (r"norm", "norm"),
)
_UNQUANTIZED_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One entry of the tensor table: ggml shape (``ne0`` first), type, offset, size."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data_offset: int
    n_elements: int
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's metadata and tensor table (no tensor data read)."""

    path: Path
    architecture: str
    tensors: tuple[GGUFTensorInfo, ...]
    reader: Any = field(repr=False, compare=False)

    def value(self, key: str) -> Any:
        """The decoded value of metadata ``key``; None when absent."""
        f = self.reader.fields.get(key)
        if f is None:
            return None
        try:
            return f.contents()
        except Exception:  # noqa: BLE001 - an undecodable field is the same as a corrupt file
            raise MalformedConfig(
                f"GGUF field {key!r} cannot be decoded", "download the file again"
            ) from None

    def key(self, name: str) -> Any:
        """The architecture's own key ``{arch}.{name}``; None when absent."""
        return self.value(f"{self.architecture}.{name}")

    def token_count(self) -> int | None:
        """Entries of ``tokenizer.ggml.tokens``; None when the file has no tokenizer."""
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        return len(tokens.data) if tokens is not None else None


def read_header(path: str | Path) -> GGUFHeader:
    """Open ``path`` and read its header.

    Raises :class:`MalformedConfig` for a file the gguf package cannot parse or one without
    ``general.architecture``.
    """
    from gguf import GGUFReader

    p = Path(path).expanduser()
    try:
        reader = GGUFReader(str(p))
    except Exception as exc:  # noqa: BLE001 - the gguf package raises plain ValueError/struct errors
        raise MalformedConfig(
            f"{p} is not a readable GGUF file ({type(exc).__name__}: {exc})",
            "check the file; it may be truncated",
        ) from None
    tensors = tuple(
        GGUFTensorInfo(
            t.name,
            t.tensor_type.name,
            tuple(int(d) for d in t.shape),
            int(t.data_offset),
            int(t.n_elements),
            int(t.n_bytes),
        )
        for t in reader.tensors
    )
    header = GGUFHeader(path=p, architecture="", tensors=tensors, reader=reader)
    arch = header.value("general.architecture")
    if not isinstance(arch, str):
        raise MalformedConfig(f"{p} has no general.architecture", "check the file")
    return dataclasses.replace(header, architecture=arch)


def _group_of(tensor_name: str) -> str:
    for pattern, group in _TENSOR_GROUPS:
        if re.search(pattern, tensor_name):
            return group
    return "other"


def _hf_config(header: GGUFHeader) -> dict[str, Any]:
    """The header's metadata as the HF config.json keys the config reader understands."""
    arch = header.architecture
    model_type = _ARCH_TO_MODEL_TYPE.get(arch)
    if model_type is None:
        raise UnsupportedArchitecture(
            f"GGUF architecture {arch!r} is not supported",
            f"supported GGUF architectures: {', '.join(sorted(_ARCH_TO_MODEL_TYPE))}",
        )
    kv = header.key
    tensors = header.tensors
    names = {t.name for t in tensors}
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    vocab = header.token_count()
    if vocab is None and embd is not None:
        vocab = int(embd.shape[-1])
    config: dict[str, Any] = {
        "architectures": [f"gguf:{arch}"],
        "model_type": model_type,
        "hidden_size": kv("embedding_length"),
        "intermediate_size": kv("feed_forward_length"),
        "num_hidden_layers": kv("block_count"),
        "num_attention_heads": kv("attention.head_count"),
        "num_key_value_heads": kv("attention.head_count_kv"),
        "max_position_embeddings": kv("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "bfloat16",
    }
    if kv("attention.key_length"):
        config["head_dim"] = kv("attention.key_length")
    if kv("attention.sliding_window"):
        config["sliding_window"] = kv("attention.sliding_window")
    if kv("expert_count"):
        config.update(
            num_experts=kv("expert_count"),
            num_local_experts=kv("expert_count"),
            num_experts_per_tok=kv("expert_used_count"),
            moe_intermediate_size=kv("expert_feed_forward_length") or kv("feed_forward_length"),
            shared_expert_intermediate_size=kv("expert_shared_feed_forward_length") or 0,
        )
        if model_type == "llama":
            config["model_type"] = "mixtral"
    factor = kv("rope.scaling.factor")
    if factor and kv("rope.scaling.type") in ("linear",):
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return config


def spec_from_gguf(path: str | Path) -> ModelSpec:
    """ModelSpec for a ``.gguf`` file with ``QuantSpec(method="gguf", gguf_bits_per_weight=…)``.

    Raises :class:`MalformedConfig` for a file the gguf package cannot parse and
    :class:`UnsupportedArchitecture` for a ``general.architecture`` not mapped here.
    """
    header = read_header(path)
    p, tensors = header.path, header.tensors
    base = spec_from_config(_hf_config(header), name=p.stem, source=str(p))

    counts: dict[str, int] = {}
    bytes_by_type: dict[str, int] = {}
    quant_elems = quant_bytes = 0
    for t in tensors:
        group = _group_of(t.name)
        n = int(t.n_elements)
        if group == "attn_qkv":  # fused qkv: split by head counts
            q = base.num_attention_heads * base.head_size
            kvn = 2 * base.num_kv_heads * base.head_size
            counts["attn_qo"] = counts.get("attn_qo", 0) + n * q // (q + kvn)
            counts["attn_kv"] = counts.get("attn_kv", 0) + n * kvn // (q + kvn)
        else:
            counts[group] = counts.get(group, 0) + n
        type_name = t.type_name
        bytes_by_type[type_name] = bytes_by_type.get(type_name, 0) + int(t.n_bytes)
        if type_name not in _UNQUANTIZED_TYPES:
            quant_elems += n
            quant_bytes += int(t.n_bytes)
    layout = {g.name: g for g in base.params}
    groups = []
    for gname, n in counts.items():
        proto = layout.get(gname)
        if proto is not None:
            groups.append(dataclasses.replace(proto, count=n))
        else:
            groups.append(
                ParamGroup(
                    name=gname, count=n, sharding=ParamSharding.REPLICATED, quantizable=False
                )
            )
    total_elems = sum(int(t.n_elements) for t in tensors)
    total_bytes = sum(int(t.n_bytes) for t in tensors)
    bpw = 8 * total_bytes / total_elems if total_elems else 0.0
    quant = QuantSpec(
        method="gguf",
        weight_bits=round(8 * quant_bytes / quant_elems) if quant_elems else 16,
        scale_granularity="block",
        gguf_bits_per_weight=bpw,
    )
    return dataclasses.replace(
        base,
        params=tuple(groups),
        quant=quant,
        checkpoint_bytes_by_dtype=bytes_by_type,
        architecture=f"gguf:{header.architecture}",
    )
