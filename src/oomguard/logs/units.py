"""Numbers as vLLM and PyTorch print them: thousands separators, binary and decimal units."""

from __future__ import annotations

GIB = 2**30

# PyTorch prints binary units (KiB/MiB/GiB); very old vLLM printed "GB" while meaning 2**30
# ("Loading model weights took 14.9888 GB" is the same number later printed as GiB).
_UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "bytes": 1,
    "kib": 2**10,
    "kb": 2**10,
    "k": 2**10,
    "mib": 2**20,
    "mb": 2**20,
    "m": 2**20,
    "gib": 2**30,
    "gb": 2**30,
    "g": 2**30,
    "tib": 2**40,
    "tb": 2**40,
    "t": 2**40,
}


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
