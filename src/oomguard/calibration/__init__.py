"""Observed (GPU, vLLM version, model family, TP, PP) numbers from real logs, stored locally
with the settings they were measured under, that replace the memory model's estimated terms
where those settings match."""

from oomguard.calibration.store import (
    SETTINGS,
    TERM_SETTINGS,
    TERMS,
    UNSET,
    StartupMeasurement,
    Store,
    catalogue_gpu_name,
    default_path,
    lookup,
    lookup_for,
    make_key,
    model_family,
    normalize_setting,
    observation_from_log,
    record_logs,
    settings_filters,
)

__all__ = [
    "SETTINGS",
    "TERMS",
    "TERM_SETTINGS",
    "UNSET",
    "StartupMeasurement",
    "Store",
    "catalogue_gpu_name",
    "default_path",
    "lookup",
    "lookup_for",
    "make_key",
    "model_family",
    "normalize_setting",
    "observation_from_log",
    "record_logs",
    "settings_filters",
]
