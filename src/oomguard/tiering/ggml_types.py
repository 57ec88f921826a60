"""Bytes of GGML tensors: block sizes per type, row sizes, and the KV-cache types llama.cpp accepts.

The per-type block size and bytes per block come from the ``gguf`` package's
``GGML_QUANT_SIZES`` table (the same numbers as ggml's ``type_traits``); a tensor's size is
``ggml_nbytes``: rows × ``ggml_row_size(type, ne0)`` for a contiguous tensor.
"""

from __future__ import annotations

import math
from functools import cache

from oomguard.errors import BadInput

# --cache-type-k / --cache-type-v values llama.cpp accepts (common/arg.cpp kv_cache_types)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


# The types GGUF files of LLMs use, as (elements per block, bytes per block); the unit tests
# check them against gguf's GGML_QUANT_SIZES, which answers for the rest (importing gguf costs
# most of a second, which ``oomguard plan`` should not pay for the common types).
COMMON_TYPE_SIZES = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q2_K": (256, 84), "Q3_K": (256, 110),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136), "MXFP4": (32, 17),
}  # fmt: skip


@cache
def _sizes() -> dict[str, tuple[int, int]]:
    from gguf import GGML_QUANT_SIZES

    return {
        qtype.name: (int(block), int(size)) for qtype, (block, size) in GGML_QUANT_SIZES.items()
    }


def type_sizes(type_name: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type name such as ``"Q4_K"``."""
    key = type_name.upper()
    if key in COMMON_TYPE_SIZES:
        return COMMON_TYPE_SIZES[key]
    sizes = _sizes()
    if key not in sizes:
        raise BadInput(f"unknown GGML type {type_name!r}", f"use one of {', '.join(sorted(sizes))}")
    return sizes[key]


def is_quantized(type_name: str) -> bool:
    """Whether the type stores blocks of several elements (ggml_is_quantized)."""
    return type_sizes(type_name)[0] > 1


def row_bytes(type_name: str, ne0: int) -> int:
    """``ggml_row_size``: bytes of one row of ``ne0`` elements (``ne0`` must fill whole blocks)."""
    block, size = type_sizes(type_name)
    if ne0 % block:
        raise BadInput(
            f"a {type_name} row of {ne0} elements is not a whole number of {block}-element blocks",
            "the GGUF file is inconsistent; convert the model again",
        )
    return ne0 // block * size


def tensor_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    """``ggml_nbytes`` of a contiguous tensor with ggml shape ``shape`` (ne0 first)."""
    if not shape:
        return 0
    return row_bytes(type_name, shape[0]) * math.prod(shape[1:])


def pad(value: int, alignment: int) -> int:
    """``GGML_PAD``: ``value`` rounded up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


def kv_cache_type(name: str) -> str:
    """The GGML type name for a ``--cache-type-k/-v`` value; BadInput for one llama.cpp refuses."""
    key = name.strip().lower()
    if key not in KV_CACHE_TYPES:
        raise BadInput(
            f"--cache-type {name!r} is not a KV cache type llama.cpp accepts",
            f"use one of {', '.join(KV_CACHE_TYPES)}",
        )
    return key.upper()
