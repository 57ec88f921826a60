"""Bytes per element of every dtype the project meets, in one table per naming scheme.

Torch/vLLM names (``--dtype``, ``--kv-cache-dtype``, config ``torch_dtype``) and safetensors
header names (``BF16``, ``F8_E4M3``; F4/FP4 packed two per byte, F6 four per three bytes).
"""

from __future__ import annotations

from oomguard.errors import BadInput

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
}

SAFETENSORS_DTYPE_BYTES: dict[str, float] = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
    "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1, "F4": 0.5,
    "F6_E2M3": 0.75, "F6_E3M2": 0.75,
}  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of a floating-point model dtype name."""
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise BadInput(
            f"dtype {dtype!r} is unknown", "use auto, bfloat16, float16 or float32"
        ) from None
