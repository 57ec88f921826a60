"""Where model and GPU facts come from: catalogue, local files, the hub, GGUF headers, NVML.

Entry points: :func:`resolve_model` (model reference → ModelSpec) and :func:`find_gpu`
(GPU name → GPUSpec); :func:`detect_gpus` reads the live GPUs through NVML.
"""

from oomguard.facts.catalogue import (
    CatalogueEntry,
    find_entry,
    known_quantized_variants,
    list_entries,
)
from oomguard.facts.config_reader import spec_from_config
from oomguard.facts.gpus import NoGPUDetected, detect_gpus, find_gpu, list_gpus
from oomguard.facts.resolve import resolve_model, resolve_model_with_quantization

__all__ = [
    "CatalogueEntry",
    "NoGPUDetected",
    "detect_gpus",
    "find_entry",
    "find_gpu",
    "known_quantized_variants",
    "list_entries",
    "list_gpus",
    "resolve_model",
    "resolve_model_with_quantization",
    "spec_from_config",
]
