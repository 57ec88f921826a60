"""The pure memory model of vLLM: specs in, the numbers vLLM prints out (no I/O)."""

from oomguard.memory.activation import DEFAULT_COEFFICIENTS, Coefficients, Estimate
from oomguard.memory.engine import (
    EngineSettings,
    MeasuredTerms,
    MemoryPrediction,
    Problem,
    StageMemory,
    predict,
)
from oomguard.memory.versions import VllmEra, resolve_era

__all__ = [
    "DEFAULT_COEFFICIENTS",
    "Coefficients",
    "EngineSettings",
    "Estimate",
    "MeasuredTerms",
    "MemoryPrediction",
    "Problem",
    "StageMemory",
    "VllmEra",
    "predict",
    "resolve_era",
]
