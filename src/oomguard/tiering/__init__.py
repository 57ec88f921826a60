"""llama.cpp tiering: its memory model (from GGUF headers), the GPU/host split, llama-server
commands and load logs. The cross-engine fallback chain ``plan`` shows when vLLM cannot hold a
model is :mod:`oomguard.plan.chain`.

>>> from oomguard.tiering import read_gguf, predict_llama_cpp, LlamaCppSettings
>>> memory = predict_llama_cpp(read_gguf("model.gguf"), LlamaCppSettings(ctx_size=8192, n_gpu_layers=20, gpu_count=1))
"""

from oomguard.tiering.command import llama_server_argv, render_llama_server
from oomguard.tiering.compare import BufferCheck, compare_load
from oomguard.tiering.gguf_file import read_gguf
from oomguard.tiering.loadlog import LoadLog, parse_load_log
from oomguard.tiering.memory import Buffer, LlamaCppMemory, predict_llama_cpp
from oomguard.tiering.model import GGUFModel, GGUFTensor
from oomguard.tiering.settings import LlamaCppSettings, Override
from oomguard.tiering.split import SplitPlan, best_split
from oomguard.tiering.synthesize import synthesize_gguf

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
