"""Observed (GPU, vLLM version, model family, TP) numbers from real logs, stored locally, that
replace the memory model's estimated terms next time."""

from oomguard.calibration.store import (
    Observation,
    Store,
    default_path,
    lookup,
    model_family,
    observation_from_log,
    record_logs,
)

__all__ = [
    "Observation",
    "Store",
    "default_path",
    "lookup",
    "model_family",
    "observation_from_log",
    "record_logs",
]
