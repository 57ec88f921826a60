"""Byte units, in one place: the binary constants, conversions for display, and numbers as
vLLM and PyTorch print them (thousands separators, binary and decimal units)."""

from __future__ import annotations

KIB = 2**10
MIB = 2**20
GIB = 2**30
TIB = 2**40

# PyTorch prints binary units (KiB/MiB/GiB); very old vLLM printed "GB" while meaning 2**30
# ("Loading model weights took 14.9888 GB" is the same number later printed as GiB).
_UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "bytes": 1,
    "kib": KIB,
    "kb": KIB,
    "k": KIB,
    "mib": MIB,
    "mb": MIB,
    "m": MIB,
    "gib": GIB,
    "gb": GIB,
    "g": GIB,
    "tib": TIB,
    "tb": TIB,
    "t": TIB,
}


def gib(num_bytes: float) -> float:
    """``num_bytes`` in GiB (2**30 bytes)."""
    return num_bytes / GIB


def mib(num_bytes: float) -> float:
    """``num_bytes`` in MiB (2**20 bytes)."""
    return num_bytes / MIB


def gib_rounded(num_bytes: float | None, digits: int = 2) -> float | None:
    """``num_bytes`` in GiB rounded to ``digits`` places, for JSON; None stays None."""
    return None if num_bytes is None else round(num_bytes / GIB, digits)


def gib_text(num_bytes: float | None, missing: str = "–") -> str:
    """``num_bytes`` as ``"12.34"`` (GiB, two places); ``missing`` for None."""
    return missing if num_bytes is None else f"{num_bytes / GIB:.2f}"


def gib_label(num_bytes: float) -> str:
    """``num_bytes`` as ``"12.34 GiB"``."""
    return f"{num_bytes / GIB:.2f} GiB"


def parse_number(text: str) -> float:
    """Parse ``"158,656"``, ``"14.96"`` or ``"-1.44"``; raises ValueError on anything else."""
    return float(text.replace(",", "").replace("_", ""))


def parse_int(text: str) -> int:
    """Parse a token count such as ``"1,505,552"``."""
    return int(parse_number(text))


def to_gib(value: str, unit: str) -> float:
    """Convert a printed ``value`` + ``unit`` (``"524.00"``, ``"MiB"``) to GiB (2**30 bytes)."""
    factor = _UNIT_BYTES.get(unit.strip().lower())
    if factor is None:
        raise ValueError(f"unknown memory unit {unit!r}")
    return parse_number(value) * factor / GIB
