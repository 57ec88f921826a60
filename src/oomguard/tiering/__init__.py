"""llama.cpp tiering: its memory model (from GGUF headers), the GPU/host split, llama-server
commands and load logs. The cross-engine fallback chain ``plan`` shows when vLLM cannot hold a
model is :mod:`oomguard.plan.chain`.

>>> from oomguard.tiering import read_gguf, predict_llama_cpp, LlamaCppSettings
>>> memory = predict_llama_cpp(
...     read_gguf("model.gguf"), LlamaCppSettings(ctx_size=8192, n_gpu_layers=20, gpu_count=1)
... )
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomguard.tiering.command import llama_server_argv, render_llama_server
    from oomguard.tiering.compare import BufferCheck, compare_load
    from oomguard.tiering.gguf_file import read_gguf
    from oomguard.tiering.loadlog import LoadLog, parse_load_log
    from oomguard.tiering.memory import Buffer, LlamaCppMemory, predict_llama_cpp
    from oomguard.tiering.model import GGUFModel, GGUFTensor
    from oomguard.tiering.settings import LlamaCppSettings, Override
    from oomguard.tiering.split import SplitPlan, best_split
    from oomguard.tiering.synthesize import synthesize_gguf

# each name's module, imported on first use: `plan` needs the split, not the load-log reader
_HOMES = {
    "llama_server_argv": "command",
    "render_llama_server": "command",
    "BufferCheck": "compare",
    "compare_load": "compare",
    "read_gguf": "gguf_file",
    "LoadLog": "loadlog",
    "parse_load_log": "loadlog",
    "Buffer": "memory",
    "LlamaCppMemory": "memory",
    "predict_llama_cpp": "memory",
    "GGUFModel": "model",
    "GGUFTensor": "model",
    "LlamaCppSettings": "settings",
    "Override": "settings",
    "SplitPlan": "split",
    "best_split": "split",
    "synthesize_gguf": "synthesize",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "Buffer",
    "BufferCheck",
    "GGUFModel",
    "GGUFTensor",
    "LlamaCppMemory",
    "LlamaCppSettings",
    "LoadLog",
    "Override",
    "SplitPlan",
    "best_split",
    "compare_load",
    "llama_server_argv",
    "parse_load_log",
    "predict_llama_cpp",
    "read_gguf",
    "render_llama_server",
    "synthesize_gguf",
]
