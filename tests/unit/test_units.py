"""One units module: constants, display helpers and printed-number parsing."""

from __future__ import annotations

import pytest

from oomguard.units import GIB, MIB, gib, gib_label, gib_rounded, gib_text, mib, to_gib


def test_constants_and_conversions() -> None:
    assert (GIB, MIB) == (1 << 30, 1 << 20)
    assert gib(3 * GIB) == 3.0 and mib(GIB) == 1024.0
    assert gib_rounded(1.234567 * GIB) == 1.23 and gib_rounded(None) is None
    assert gib_text(12.345 * GIB) == "12.35" and gib_text(None) == "–"
    assert gib_label(0.5 * GIB) == "0.50 GiB"


def test_printed_numbers() -> None:
    assert to_gib("524.00", "MiB") == pytest.approx(524 / 1024)
    assert to_gib("14.9888", "GB") == pytest.approx(14.9888)  # old vLLM's GB meant GiB
    with pytest.raises(ValueError, match="unknown memory unit"):
        to_gib("1", "furlongs")
