"""Engine processes (vLLM, llama-server): start in a process group of their own, read their
output as it comes, wait for health, stop the whole group and check nothing is left.

serve, bench, watch and the integration tests all start and stop engines through this module.
"""

from oomguard.engine.memory import (
    DeviceMemory,
    Release,
    gpu_memory,
    host_rss_bytes,
    process_tree,
    wait_memory_released,
)
from oomguard.engine.process import (
    EngineLeftBehind,
    EngineProcess,
    EngineStartError,
    group_pids,
    http_ok,
)
from oomguard.engine.vllm import VllmInstall, VllmNotFound, find_vllm

__all__ = [
    "DeviceMemory",
    "EngineLeftBehind",
    "EngineProcess",
    "EngineStartError",
    "Release",
    "VllmInstall",
    "VllmNotFound",
    "find_vllm",
    "gpu_memory",
    "group_pids",
    "host_rss_bytes",
    "http_ok",
    "process_tree",
    "wait_memory_released",
]
