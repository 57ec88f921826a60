"""Fault injection into a real vLLM engine: SIGILL on its first request.

vLLM's bf16 attention kernel on a CPU that advertises AMX without the virtual machine enabling
it kills the engine-core process with SIGILL on the first request. This reproduces that death
on any machine: :func:`sigill_plugin_dir` writes a vLLM general plugin (the entry-point group
``vllm.general_plugins``, which vLLM loads in every process it starts) into a directory to put
on ``PYTHONPATH``. In the processes vLLM starts (the engine core, its worker) the plugin wraps
the model runner's ``execute_model`` so the first step that schedules a new request sends the
process running it SIGILL; the API server (the main process) and oomguard are left alone.
"""

from __future__ import annotations

from pathlib import Path

MODULE = "oomguard_test_sigill"
_PLUGIN = '''"""vLLM general plugin (tests only): the engine core dies of SIGILL on its \
first request."""

import multiprocessing
import os
import signal


def register():
    if multiprocessing.current_process().name == "MainProcess":
        return
    from vllm.v1.worker import gpu_model_runner

    runner = gpu_model_runner.GPUModelRunner
    original = runner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        if scheduler_output.scheduled_new_reqs:
            os.kill(os.getpid(), signal.SIGILL)
        return original(self, scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model
'''
_METADATA = f"Metadata-Version: 2.1\nName: {MODULE}\nVersion: 0.1\n"
_ENTRY_POINTS = f"[vllm.general_plugins]\nsigill_on_first_request = {MODULE}:register\n"


def sigill_plugin_dir(root: Path) -> Path:
    """Write the plugin (module and ``.dist-info``) under ``root``; the directory to add to
    ``PYTHONPATH`` of the engine."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{MODULE}.py").write_text(_PLUGIN)
    info = root / f"{MODULE}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(_METADATA)
    (info / "entry_points.txt").write_text(_ENTRY_POINTS)
    return root
