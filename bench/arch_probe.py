"""Load model directories in real vLLM (CPU backend, dummy weights) and print what each holds.

Runs inside vLLM's own virtual environment: ``.venv-vllm/bin/python bench/arch_probe.py
JOBS.json``, where the file is a list of ``{"name": ..., "kwargs": {...}}`` (keyword arguments
of ``vllm.LLM`` added to :data:`BASE_KWARGS`, ``model`` among them). The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the package is imported once for all jobs and
the loaded model and its KV cache configuration are read directly. One line per job:
``ARCH_PROBE {"name": ..., "result": {...}}`` or ``{"name": ..., "error": "..."}``, with

- ``params_bytes``, ``buffers_bytes``: bytes of the loaded model's parameters and buffers (the
  CPU worker prints no "Model loading took" line, so the model itself is measured);
- ``tensor_bytes``: those bytes by tensor name, layer numbers replaced by ``*``;
- ``num_blocks``, ``block_size``, ``bytes_per_block`` (the sum over every KV cache tensor
  divided by the block count), ``page_sizes`` (one per KV cache group);
- ``kv_cache_tokens``, ``max_concurrency`` (formatted as vLLM prints it), ``max_model_len``: the
  values vLLM formats into its "KV cache size … Maximum concurrency" line.
"""

from __future__ import annotations

import json
import os
import re
import sys

BASE_KWARGS = {
    "load_format": "dummy",
    "dtype": "float32",
    "enforce_eager": True,
    "trust_remote_code": False,
}


def _probe(job: dict[str, object]) -> dict[str, object]:
    """Load one job's model, read what vLLM holds, and shut the engine down."""
    import gc

    import vllm
    from vllm.distributed import cleanup_dist_env_and_memory

    kwargs = {**BASE_KWARGS, **job["kwargs"]}  # type: ignore[dict-item]
    llm = vllm.LLM(**kwargs)
    try:
        core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
        model = core.model_executor.driver_worker.worker.model_runner.model
        params = sum(t.numel() * t.element_size() for t in model.parameters())
        buffers = sum(t.numel() * t.element_size() for t in model.buffers())
        groups: dict[str, int] = {}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            key = re.sub(r"\.\d+\.", ".*.", name)
            groups[key] = groups.get(key, 0) + t.numel() * t.element_size()
        kv_config = core.scheduler.kv_cache_config
        cache = llm.llm_engine.vllm_config.cache_config
        total = sum(t.size for t in kv_config.kv_cache_tensors)
        return {
            "params_bytes": params,
            "buffers_bytes": buffers,
            "tensor_bytes": groups,
            "num_blocks": kv_config.num_blocks,
            "block_size": cache.block_size,
            "bytes_per_block": total // max(kv_config.num_blocks, 1),
            "page_sizes": [g.kv_cache_spec.page_size_bytes for g in kv_config.kv_cache_groups],
            "num_groups": len(kv_config.kv_cache_groups),
            # the two figures vLLM formats into its "KV cache size … Maximum concurrency" line
            "kv_cache_tokens": cache.kv_cache_size_tokens,
            "max_concurrency": f"{cache.kv_cache_max_concurrency:.2f}",
            "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len,
        }
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> int:
    """Run every job of the JSON file given; one ``ARCH_PROBE {...}`` line per job."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    jobs = json.loads(open(sys.argv[1]).read())
    for job in jobs:
        print(f"ARCH_START {job['name']}", flush=True)
        try:
            out: dict[str, object] = {"name": job["name"], "result": _probe(job)}
        except Exception as exc:  # noqa: BLE001 - any failure is a row of the table
            out = {"name": job["name"], "error": f"{type(exc).__name__}: {exc}"[-600:]}
        print("ARCH_PROBE " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
