"""Load model directories in real vLLM (CPU backend, dummy weights) and print what each holds.

Runs inside vLLM's own virtual environment: ``.venv-vllm/bin/python bench/arch_probe.py
JOBS.json``, where the file is a list of ``{"name": ..., "kwargs": {...}}`` (keyword arguments
of ``vllm.LLM`` added to :data:`BASE_KWARGS`, ``model`` among them). The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the package is imported once for all jobs and
the loaded model and its KV cache configuration are read directly. One line per job:
``ARCH_PROBE {"name": ..., "result": {...}}`` or ``{"name": ..., "error": "..."}``, with

- ``params_bytes``, ``buffers_bytes``: bytes of the loaded model's parameters and buffers (the
  CPU worker prints no "Model loading took" line, so the model itself is measured); with a
  drafter, the target's and the drafter's together (both load inside "Model loading took");
- ``tensor_bytes``: those bytes by tensor name, layer numbers replaced by ``*``;
- ``kv_groups``: per KV cache group its page size, layer count, whether it is attention;
- ``num_blocks``, ``block_size``, ``tensor_bytes_per_block`` (every KV cache tensor's bytes
  divided by the block count);
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


LOADED: dict[str, object] = {}


def _tensor_bytes(model: object) -> tuple[int, int, dict[str, int]]:
    """Bytes of the model's parameters and buffers, and both by name (layer numbers as ``*``)."""
    params = sum(t.numel() * t.element_size() for t in model.parameters())  # type: ignore[attr-defined]
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())  # type: ignore[attr-defined]
    groups: dict[str, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # type: ignore[attr-defined]
        key = re.sub(r"\.\d+\.", ".*.", name)
        groups[key] = groups.get(key, 0) + t.numel() * t.element_size()
    return params, buffers, groups


def _measure_before_repacking() -> None:
    """Record the loaded model's tensors before vLLM's post-load processing runs.

    On CPU that processing repacks linear weights into the kernel library's own layout, which
    is no longer a parameter of the module; the bytes as loaded are what the planner predicts.
    """
    from vllm.model_executor.model_loader import base_loader

    original = base_loader.process_weights_after_loading

    def measured(model, model_config, target_device):  # type: ignore[no-untyped-def]
        # a drafter loads through the same loader after the target: add it up
        params, buffers, groups = _tensor_bytes(model)
        LOADED["params"] = int(LOADED.get("params", 0)) + params  # type: ignore[call-overload]
        LOADED["buffers"] = int(LOADED.get("buffers", 0)) + buffers  # type: ignore[call-overload]
        known: dict[str, int] = LOADED.setdefault("groups", {})  # type: ignore[assignment]
        for key, size in groups.items():
            known[key] = known.get(key, 0) + size
        return original(model, model_config, target_device)

    base_loader.process_weights_after_loading = measured


def _lora_bytes(core: object) -> int | None:
    """Bytes of the LoRA A/B stacks of every wrapped module, each storage once (None without
    LoRA); vLLM keeps them as plain tensor attributes, not as parameters or buffers."""
    runner = core.model_executor.driver_worker.worker.model_runner  # type: ignore[attr-defined]
    manager = getattr(runner, "lora_manager", None)
    if manager is None:
        return None
    seen: set[int] = set()
    total = 0
    for module in manager._adapter_manager.modules.values():
        for name, value in vars(module).items():
            if "lora_" not in name or not name.endswith("stacked"):
                continue
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def _probe(job: dict[str, object]) -> dict[str, object]:
    """Load one job's model, read what vLLM holds, and shut the engine down."""
    import gc

    import vllm
    from vllm.distributed import cleanup_dist_env_and_memory

    LOADED.clear()
    kwargs = {**BASE_KWARGS, **job["kwargs"]}  # type: ignore[dict-item]
    llm = vllm.LLM(**kwargs)
    try:
        core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
        kv_config = core.scheduler.kv_cache_config
        cache = llm.llm_engine.vllm_config.cache_config
        total = sum(t.size for t in kv_config.kv_cache_tensors)
        return {
            "params_bytes": LOADED["params"],
            "buffers_bytes": LOADED["buffers"],
            "tensor_bytes": LOADED["groups"],
            "kv_groups": [
                {
                    "page": g.kv_cache_spec.page_size_bytes,
                    "layers": len(g.layer_names),
                    "attention": hasattr(g.kv_cache_spec, "head_size"),
                    "spec": type(g.kv_cache_spec).__name__,
                }
                for g in kv_config.kv_cache_groups
            ],
            "num_blocks": kv_config.num_blocks,
            "block_size": cache.block_size,
            "tensor_bytes_per_block": total // max(kv_config.num_blocks, 1),
            "page_sizes": [g.kv_cache_spec.page_size_bytes for g in kv_config.kv_cache_groups],
            "num_groups": len(kv_config.kv_cache_groups),
            # the two figures vLLM formats into its "KV cache size … Maximum concurrency" line
            "kv_cache_tokens": cache.kv_cache_size_tokens,
            "max_concurrency": f"{cache.kv_cache_max_concurrency:.2f}",
            "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len,
            "lora_bytes": _lora_bytes(core),
        }
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def main() -> int:
    """Run every job of the JSON file given; one ``ARCH_PROBE {...}`` line per job."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.model_executor.models import registry

    # vLLM inspects each model class in a fresh interpreter so that CUDA is not initialised;
    # there is no CUDA here, and a fresh interpreter costs a minute per architecture.
    registry._run_in_subprocess = lambda fn: fn()  # type: ignore[attr-defined]
    _measure_before_repacking()
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
