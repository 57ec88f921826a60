"""Compare a llama.cpp memory prediction with what llama-server printed while loading.

Exact figures (model, KV, output buffers) must match to the print's resolution (0.01 MiB);
the compute buffer is an estimate and must fall inside its stated range.
"""

from __future__ import annotations

from dataclasses import dataclass

from oomguard.tiering.loadlog import PRINT_RESOLUTION_BYTES, LoadLog
from oomguard.tiering.memory import LlamaCppMemory
from oomguard.units import MIB


@dataclass(frozen=True)
class BufferCheck:
    """One buffer: predicted (with range), observed, and whether they agree."""

    kind: str
    device: str
    predicted_bytes: int
    low_bytes: int
    high_bytes: int
    observed_bytes: int | None
    estimated: bool
    printed_count: int = 1  # buffers summed (each printed rounded to 0.01 MiB)

    @property
    def agrees(self) -> bool:
        """Exact: within the print's rounding; estimate: inside its range (plus rounding)."""
        if self.observed_bytes is None:
            return False
        slack = PRINT_RESOLUTION_BYTES * self.printed_count
        return self.low_bytes - slack <= self.observed_bytes <= self.high_bytes + slack

    @property
    def error_fraction(self) -> float | None:
        """(predicted − observed) / observed."""
        if not self.observed_bytes:
            return None
        return (self.predicted_bytes - self.observed_bytes) / self.observed_bytes

    def line(self) -> str:
        """One readable line:
        ``compute GPU0: predicted 12.50 MiB (10.0–15.0), printed 12.31 MiB ✓``."""
        rng = f" ({self.low_bytes / MIB:.2f}–{self.high_bytes / MIB:.2f})" if self.estimated else ""
        seen = (
            "not printed"
            if self.observed_bytes is None
            else f"printed {self.observed_bytes / MIB:.2f} MiB"
        )
        mark = "✓" if self.agrees else "✗"
        return (
            f"{self.kind} {self.device}: predicted {self.predicted_bytes / MIB:.2f} "
            f"MiB{rng}, {seen} {mark}"
        )


def compare_load(prediction: LlamaCppMemory, log: LoadLog) -> list[BufferCheck]:
    """One :class:`BufferCheck` per predicted buffer, plus printed buffers nothing predicted."""
    grouped: dict[tuple[str, str], list[int]] = {}
    estimated: set[tuple[str, str]] = set()
    for b in prediction.buffers:  # several buffers of a kind on one device are printed separately
        low, high = b.range_bytes()
        sums = grouped.setdefault((b.kind, b.device), [0, 0, 0])
        sums[0] += b.size_bytes
        sums[1] += low
        sums[2] += high
        if b.estimated:
            estimated.add((b.kind, b.device))
    checks = []
    for (kind, device), (value, low, high) in grouped.items():
        printed = sum(1 for ob in log.buffers if ob.kind == kind and ob.device == device)
        checks.append(
            BufferCheck(
                kind,
                device,
                value,
                low,
                high,
                log.total(kind, device),
                (kind, device) in estimated,
                max(1, printed),
            )
        )
    seen = set(grouped)
    for ob in log.buffers:
        if (ob.kind, ob.device) not in seen and ob.size_bytes > PRINT_RESOLUTION_BYTES:
            checks.append(
                BufferCheck(ob.kind, ob.device, 0, 0, 0, log.total(ob.kind, ob.device), False)
            )
            seen.add((ob.kind, ob.device))
    return checks
