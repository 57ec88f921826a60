"""A GGUF file's header (:func:`oomguard.facts.gguf.read_header`) as a :class:`GGUFModel`.

Hyperparameters are the ``{arch}.*`` keys llama.cpp reads (``llama-model.cpp``
``load_hparams``): block_count, embedding_length, attention.head_count(_kv) (a number or a
per-layer array), key_length/value_length (default n_embd / n_head), context_length,
sliding_window with the architecture's pattern (gemma2: every 2nd layer global, gemma3: every
6th; ``attention.sliding_window_pattern`` overrides). Tensor offsets are absolute file offsets,
as llama.cpp's ``llama_tensor_weight::offs``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.facts.gguf import GGUFHeader, read_header
from oomguard.tiering.model import GGUFModel, GGUFTensor

# Architectures whose KV cache is plain per-layer K and V (llama_kv_cache / _iswa): the ones
# this model accounts for. MLA (deepseek2), recurrent and hybrid layers keep other state.
KV_ARCHITECTURES = frozenset({
    "llama", "llama4", "mistral3", "qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma", "gemma2",
    "gemma3", "phi3", "granite", "granitemoe", "command-r", "cohere2", "olmo2", "mixtral",
    "internlm2", "starcoder2", "stablelm", "exaone", "gpt-oss", "glm4", "glm4moe", "smollm3",
})  # fmt: skip
# llama-model.cpp: load_swa_pattern(ml, n) defaults per architecture
_SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4, "gpt-oss": 2}
# general.file_type (llama_ftype) → name, for the ones users meet
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
               10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
               16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16", 38: "MXFP4_MOE"}  # fmt: skip


def _per_layer(value: Any, n_layer: int, default: int) -> tuple[int, ...]:
    if value is None:
        return (default,) * n_layer
    if isinstance(value, list):
        if len(value) != n_layer:
            raise MalformedConfig(
                f"per-layer array of {len(value)} values for {n_layer} layers",
                "the GGUF file is inconsistent",
            )
        return tuple(int(v) for v in value)
    return (int(value),) * n_layer


def _swa_layers(header: GGUFHeader, n_layer: int, window: int) -> tuple[bool, ...]:
    if not window:
        return ()
    arch = header.architecture
    pattern = header.key("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(bool(v) for v in pattern[:n_layer])
    n = int(pattern) if pattern is not None else _SWA_PATTERN.get(arch, 0)
    # set_swa_pattern(n, dense_first=false): layer il is SWA unless il % n == n - 1
    return tuple(n == 0 or (il % n < n - 1) for il in range(n_layer))


def read_gguf(path: str | Path) -> GGUFModel:
    """The :class:`GGUFModel` of a GGUF file (header only).

    Raises :class:`MalformedConfig` for an unreadable file and
    :class:`UnsupportedArchitecture` for an architecture whose KV cache is not plain K/V.
    """
    header = read_header(path)
    p, arch = header.path, header.architecture
    if arch not in KV_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"llama.cpp's memory for GGUF architecture {arch!r} is not modelled (its KV cache is "
            "not plain per-layer K/V, or it has not been checked)",
            f"supported: {', '.join(sorted(KV_ARCHITECTURES))}",
        )

    key = header.key
    n_layer = int(key("block_count") or 0)
    n_embd = int(key("embedding_length") or 0)
    heads = key("attention.head_count")
    if not n_layer or not n_embd or heads is None:
        raise MalformedConfig(
            f"{p} lacks block_count, embedding_length or attention.head_count",
            "the GGUF file is incomplete",
        )
    n_head_layers = _per_layer(heads, n_layer, 0)
    n_head = max(n_head_layers)
    n_head_kv = _per_layer(key("attention.head_count_kv"), n_layer, n_head)
    head_k = int(key("attention.key_length") or n_embd // n_head)
    head_v = int(key("attention.value_length") or n_embd // n_head)
    tensors = tuple(GGUFTensor(t.name, t.type_name, t.shape, t.data_offset) for t in header.tensors)
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    n_vocab = int(
        key("vocab_size")
        or (header.token_count() or 0)
        or (embd.shape[1] if embd is not None else 0)
    )
    window = int(key("attention.sliding_window") or 0)
    file_type = header.value("general.file_type")
    ff = key("feed_forward_length")
    return GGUFModel(
        name=str(header.value("general.name") or p.stem),
        architecture=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=head_v,
        n_vocab=n_vocab,
        n_ctx_train=int(key("context_length") or 0),
        tensors=tensors,
        n_expert=int(key("expert_count") or 0),
        n_expert_used=int(key("expert_used_count") or 0),
        n_ff=int(max(ff) if isinstance(ff, list) else (ff or 0)),
        sliding_window=window,
        swa_layers=_swa_layers(header, n_layer, window),
        file_type=_FILE_TYPES.get(int(file_type), str(file_type)) if file_type is not None else "",
        source=f"GGUF header of {p}",
        file_bytes=p.stat().st_size,
    )
