"""Engine processes (vLLM, llama-server) and the processes around them.

``engine.process`` owns process groups: every start, stop and kill of an engine or a helper
process (serve's engines and guard, llama-server, the test and bench servers) goes through
:func:`start_group`, :func:`stop_group`, :func:`kill_group` or :class:`EngineProcess`, which
starts the process in a group of its own, reads its output, waits for health and stops the
whole group, checking that nothing of it is left. ``engine.memory`` reads the device and host
memory those processes hold; ``engine.vllm`` finds the interpreter that has vLLM.
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
    kill_group,
    signal_group,
    start_group,
    stop_group,
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
    "kill_group",
    "process_tree",
    "signal_group",
    "start_group",
    "stop_group",
    "wait_memory_released",
]
