"""Model facts from a GGUF file's header (``gguf`` package): dims, layer kinds, exact bytes.

The metadata is mapped onto the HF config keys the config reader understands (so layer kinds
and the default context come from one place); parameter counts and bytes come from the tensor
table itself, which is exact.
"""

from __future__ import annotations

import dataclasses
import re
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


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - an undecodable field is the same as a corrupt file
        raise MalformedConfig(
            f"GGUF field {key!r} cannot be decoded", "download the file again"
        ) from None


def _group_of(tensor_name: str) -> str:
    for pattern, group in _TENSOR_GROUPS:
        if re.search(pattern, tensor_name):
            return group
    return "other"


def _open_gguf(p: Path) -> tuple[Any, str, str]:
    """(reader, GGUF architecture, the config reader's model_type) of a GGUF file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(p))
    except Exception as exc:  # noqa: BLE001 - the gguf package raises plain ValueError/struct errors
        raise MalformedConfig(f"{p} is not a readable GGUF file ({type(exc).__name__}: {exc})",
                              "check the file; it may be truncated") from None  # fmt: skip
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise MalformedConfig(f"{p} has no general.architecture", "check the file")
    model_type = _ARCH_TO_MODEL_TYPE.get(arch)
    if model_type is None:
        raise UnsupportedArchitecture(
            f"GGUF architecture {arch!r} is not supported",
            f"supported GGUF architectures: {', '.join(sorted(_ARCH_TO_MODEL_TYPE))}",
        )
    return reader, arch, model_type


def _config_from_gguf(reader: Any, arch: str, model_type: str) -> dict[str, Any]:
    """A Hugging Face-style config from the GGUF header's keys and tensor names."""

    def kv(key: str) -> Any:
        return _field(reader, f"{arch}.{key}")

    tensors = list(reader.tensors)
    names = {t.name for t in tensors}
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = (
        len(tokens.data)
        if tokens is not None
        else (int(embd.shape[-1]) if embd is not None else None)
    )
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
        config.update(num_experts=kv("expert_count"), num_local_experts=kv("expert_count"),
                      num_experts_per_tok=kv("expert_used_count"),
                      moe_intermediate_size=kv("expert_feed_forward_length") or kv("feed_forward_length"),
                      shared_expert_intermediate_size=kv("expert_shared_feed_forward_length") or 0)  # fmt: skip
        if model_type == "llama":
            config["model_type"] = "mixtral"
    factor = kv("rope.scaling.factor")
    if factor and kv("rope.scaling.type") in ("linear",):
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return config


def _gguf_params(
    tensors: list[Any], base: ModelSpec
) -> tuple[tuple[ParamGroup, ...], dict[str, int], QuantSpec]:
    """The parameter groups counted from the tensors, bytes by GGUF type, and the quantization."""
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
        type_name = t.tensor_type.name
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
    return tuple(groups), bytes_by_type, quant


def spec_from_gguf(path: str | Path) -> ModelSpec:
    """ModelSpec for a ``.gguf`` file with ``QuantSpec(method="gguf", gguf_bits_per_weight=…)``.

    Raises :class:`MalformedConfig` for a file the gguf package cannot parse and
    :class:`UnsupportedArchitecture` for a ``general.architecture`` not mapped here.
    """
    p = Path(path).expanduser()
    reader, arch, model_type = _open_gguf(p)
    config = _config_from_gguf(reader, arch, model_type)
    base = spec_from_config(config, name=p.stem, source=str(p))
    groups, bytes_by_type, quant = _gguf_params(list(reader.tensors), base)
    return dataclasses.replace(
        base, params=groups, quant=quant, checkpoint_bytes_by_dtype=bytes_by_type,
        architecture=f"gguf:{arch}",
    )  # fmt: skip
