"""The fallback chain: the ways to serve a model that vLLM cannot hold as planned, ordered and
priced.

The order follows the seeds' checklist: 1. vLLM as planned; 2. fp8 KV cache or a shorter
context; 3. tensor parallelism (more, or larger, GPUs); 4. a quantized checkpoint; 5. vLLM
``--cpu-offload-gb``; 6. llama.cpp with a GGUF of the model, the largest split that fits with
a margin; 7. CPU only. Each tier carries its command, the GPU memory per device and the host
memory it needs, and its single-sequence decode speed bound from memory bandwidth with the
slowdown against the model's own weights read at the planned GPU's bandwidth (estimates).

Tiers 1–5 come from the vLLM planner's alternatives (:mod:`oomguard.plan.recommend`);
tiers 6 and 7 are priced here with the llama.cpp memory model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard.errors import OomguardError
from oomguard.plan.result import Alternative, Candidate
from oomguard.tiering.bandwidth import HOST_RAM_GBPS, PCIE_GBPS, gpu_bandwidth_gbps
from oomguard.tiering.command import render_llama_server
from oomguard.tiering.model import GGUFModel
from oomguard.tiering.settings import LlamaCppSettings
from oomguard.tiering.split import SplitPlan, best_split, price_split
from oomguard.units import GIB, gib_rounded
from oomguard.vllm_args import render_serve

if TYPE_CHECKING:
    from oomguard.memory.spec import ModelSpec
    from oomguard.plan.recommend import SearchSpace

STEP_OF_KIND = {"as_planned": 1, "shorter_context": 2, "more_gpus": 3, "larger_gpu": 3,
                "quantization": 4, "quantize_yourself": 4, "cpu_offload": 5, "llama_cpp": 6,
                "cpu_only": 7}  # fmt: skip
STEP_NAMES = {1: "vLLM as planned", 2: "fp8 KV or a shorter context",
              3: "tensor parallelism / more GPU memory", 4: "a quantized checkpoint",
              5: "vLLM --cpu-offload-gb", 6: "llama.cpp, split GPU/host",
              7: "CPU only"}  # fmt: skip


def _step(alt: Alternative) -> int:
    c = alt.candidate
    if alt.kind == "more_gpus" and c is not None and c.weights_key != "native":
        return 4  # more GPUs *and* a quantized checkpoint: the checkpoint is the bigger change
    return STEP_OF_KIND.get(alt.kind, 4)


def gguf_for(space: SearchSpace, recipe: str = "Q4_K_M") -> GGUFModel:
    """The GGUF model to price: the user's file when the model is one, else a synthesized table."""
    ref = Path(space.model_ref).expanduser()
    if ref.suffix == ".gguf" and ref.is_file():
        from oomguard.tiering.gguf_file import read_gguf

        return read_gguf(ref)
    from oomguard.tiering.synthesize import synthesize_gguf

    return synthesize_gguf(space.model, recipe)


def active_share(model: ModelSpec) -> float:
    """The share of the weights one token reads: all dense weights, the used experts' share of
    the expert weights (MoE decode reads ``experts_per_token`` of ``num_experts``)."""
    total = sum(g.count for g in model.params)
    if model.moe is None or not total:
        return 1.0
    experts = sum(g.count for g in model.params if g.name == "experts")
    unused = experts * (1 - model.moe.experts_per_token / model.moe.num_experts)
    return (total - unused) / total


def _vllm_price(alt: Alternative, ref_s: float | None) -> dict[str, Any]:
    c = alt.candidate
    if c is None:
        return {}
    pred = c.prediction
    gbps = gpu_bandwidth_gbps(c.gpu.name)
    share = active_share(c.model)
    offload = float(c.settings.cpu_offload_gb or 0) * GIB * share
    on_gpu = max(0.0, pred.weights.value_bytes * share - offload)
    seconds = (on_gpu / (gbps * 1e9) if gbps else 0.0) + offload / (PCIE_GBPS * 1e9)
    tokens = 1 / seconds if seconds and (gbps or not on_gpu) else None
    return {
        "engine": "vllm",
        "gpu_gib_per_device": gib_rounded(pred.requested_bytes),
        "gpu_count": c.gpu_count,
        "host_gib": gib_rounded(offload * c.settings.tensor_parallel_size) or 0.0,
        "decode_tokens_per_s_bound": None if tokens is None else round(tokens, 1),
        "slowdown": None if tokens is None or not ref_s else round((1 / tokens) / ref_s, 2),
    }


def _llama_cpp_caveats(
    plan: SplitPlan, kind: str, numbers: dict[str, Any], kv_q8: SplitPlan | None
) -> list[str]:
    """What a llama.cpp alternative's reader should know: placement, engine, host memory, speed."""
    s = plan.settings
    model = plan.memory.model
    caveats: list[str] = []
    if kind == "llama_cpp":
        on_gpu = plan.memory.placement.gpu_layers()
        where = (
            f"{on_gpu} of {model.n_layer} layers on the GPU"
            if not s.n_cpu_moe
            else (
                "attention of all layers on the GPU, the experts of the first "
                f"{s.n_cpu_moe} on the CPU"
            )
        )
        caveats.append(
            f"{where}; predicted GPU {numbers['gpu_gib_per_device']} GiB of a "
            f"{numbers['gpu_budget_gib']} GiB budget (1 GiB margin and the CUDA context kept free)"
        )
        if kv_q8 is not None and kv_q8.settings.n_gpu_layers > s.n_gpu_layers:
            caveats.append(
                f"with --cache-type-k q8_0 --cache-type-v q8_0 the KV cache halves and -ngl "
                f"{kv_q8.settings.n_gpu_layers} fits"
            )
    caveats.append(
        "a different engine: llama-server slots (--parallel) each hold a fixed context; "
        "no PagedAttention, modest batching"
    )
    if plan.fits_host is False:
        caveats.append(
            f"host memory: needs {numbers['host_gib']} GiB, the host has "
            f"{numbers['host_budget_gib']} GiB usable"
        )
    elif plan.fits_host is None:
        caveats.append(
            f"needs {numbers['host_gib']} GiB of host RAM (host memory not checked: "
            "pass --host-memory-gib)"
        )
    caveats.append(
        f"speeds are memory-bandwidth bounds (host RAM {HOST_RAM_GBPS:.0f} GB/s), estimates"
    )
    return caveats


def _llama_cpp_tier(
    space: SearchSpace,
    plan: SplitPlan,
    ref_s: float | None,
    kind: str,
    gguf_name: str,
    alternative_cls: type,
    kv_q8: SplitPlan | None,
) -> Alternative:
    s = plan.settings
    model = plan.memory.model
    gbps = gpu_bandwidth_gbps(space.gpu.name)
    tokens = plan.decode_tokens_per_s(gbps)
    cmd = render_llama_server(gguf_name, s)
    serves = plan.fits_gpu and plan.fits_host is not False
    numbers: dict[str, Any] = {
        "engine": "llama.cpp",
        "gguf": model.file_type,
        "gguf_gib": round(model.weight_bytes / GIB, 2),
        "layers": model.n_layer,
        "n_gpu_layers": s.n_gpu_layers,
        "n_cpu_moe": s.n_cpu_moe,
        "cpu_moe": s.cpu_moe,
        "ctx_size": plan.memory.context.n_ctx,
        "ctx_per_slot": plan.memory.context.n_ctx_seq,
        "parallel": s.parallel,
        "gpu_gib_per_device": gib_rounded(plan.gpu_need_bytes) if s.gpu_count else 0.0,
        "gpu_budget_gib": gib_rounded(plan.gpu_budget_bytes) if s.gpu_count else None,
        "gpu_count": s.gpu_count,
        "host_gib": gib_rounded(plan.host_need_bytes),
        "host_budget_gib": gib_rounded(plan.host_budget_bytes),
        "decode_tokens_per_s_bound": None if tokens is None else round(tokens, 2),
        "slowdown": None if tokens is None or not ref_s else round((1 / tokens) / ref_s, 1),
        "buffers": [
            {
                "kind": b.kind,
                "device": b.device,
                "name": b.name or b.device,
                "gib": round(b.size_bytes / GIB, 3),
                "estimated": b.estimated,
            }
            for b in plan.memory.buffers
        ],
        "model_source": model.source,
    }
    caveats = _llama_cpp_caveats(plan, kind, numbers, kv_q8)
    title = (
        f"llama.cpp {model.file_type} GGUF, -ngl {s.n_gpu_layers}"
        if kind == "llama_cpp"
        else f"llama.cpp {model.file_type} GGUF on the CPU only"
    )
    if kind == "llama_cpp" and s.n_cpu_moe:
        title += f" --n-cpu-moe {s.n_cpu_moe}"
    return alternative_cls(
        rank=0,
        kind=kind,
        title=title,
        serves_workload=serves,
        numbers=numbers,
        command=cmd,
        caveats=tuple(caveats),
        candidate=None,
    )


def _offload_checked(
    alt: Alternative, space: SearchSpace, host_memory_bytes: int | None
) -> Alternative:
    """``--cpu-offload-gb`` moves weights to host memory: it cannot serve on a device that is
    host memory (a CPU node, a unified-memory part), nor beyond the host memory there is."""
    if alt.kind != "cpu_offload" or not alt.serves_workload:
        return alt
    reason = None
    if space.gpu.vendor == "cpu" or space.gpu.unified_memory:
        reason = f"{space.gpu.name} already is host memory: offloading weights to it adds no room"
    elif host_memory_bytes is not None:
        need_gib = float(alt.numbers.get("host_ram_gib") or 0.0)
        if need_gib * GIB > host_memory_bytes:
            reason = (
                f"needs {need_gib:g} GiB of pinned host RAM; the host has "
                f"{host_memory_bytes / GIB:.1f} GiB usable"
            )
    if reason is None:
        return alt
    return dataclasses.replace(alt, serves_workload=False, caveats=(reason, *alt.caveats))


def fallback_chain(
    space: SearchSpace,
    given: Candidate,
    alternatives: list[Alternative] | tuple[Alternative, ...],
    host_memory_bytes: int | None = None,
) -> list[Alternative]:
    """The planner's alternatives in chain order with tiers 1, 6 and 7 added, each priced.

    Every returned item's ``numbers`` has ``tier``, ``tier_name``, ``engine``,
    ``gpu_gib_per_device``, ``host_gib``, ``decode_tokens_per_s_bound`` and ``slowdown``.
    """
    gbps = gpu_bandwidth_gbps(space.gpu.name)
    native_bytes = (
        given.prediction.weights.value_bytes
        * given.settings.tensor_parallel_size
        * active_share(space.model)
    )
    ref_s = native_bytes / (gbps * 1e9) if gbps else None
    problem = (
        given.prediction.problems[0].message
        if given.prediction.problems
        else (
            given.serve.reason
            if given.serve and given.serve.reason
            else "does not serve the workload"
        )
    )
    first = Alternative(
        rank=0,
        kind="as_planned",
        title=f"vLLM as planned: {problem}",
        serves_workload=False,
        numbers={},
        command=render_serve(given.model_ref, given.settings),
        caveats=(),
        candidate=given,
    )
    alternatives = [_offload_checked(a, space, host_memory_bytes) for a in alternatives]
    items: list[tuple[int, Alternative]] = [(1, first)] + [(_step(a), a) for a in alternatives]
    priced: list[tuple[int, Alternative]] = []
    for step, alt in items:
        numbers = {
            **alt.numbers,
            **_vllm_price(alt, ref_s),
            "tier": step,
            "tier_name": STEP_NAMES[step],
        }
        priced.append((step, dataclasses.replace(alt, numbers=numbers)))
    priced += [
        (
            step,
            dataclasses.replace(
                alt, numbers={**alt.numbers, "tier": step, "tier_name": STEP_NAMES[step]}
            ),
        )
        for step, alt in _llama_cpp_tiers(space, host_memory_bytes, ref_s, Alternative)
    ]
    priced.sort(key=lambda item: item[0])  # stable: the planner's order within a tier
    return [dataclasses.replace(alt, rank=i + 1) for i, (_, alt) in enumerate(priced)]


def _llama_cpp_tiers(
    space: SearchSpace, host_memory_bytes: int | None, ref_s: float | None, alternative_cls: type
) -> list[tuple[int, Alternative]]:
    w = space.workload
    try:
        model = gguf_for(space)
    except OomguardError as exc:
        note = alternative_cls(
            rank=0,
            kind="llama_cpp",
            title=f"llama.cpp: not priced ({exc.message})",
            serves_workload=False,
            numbers={"engine": "llama.cpp"},
            command="",
            caveats=(exc.hint,) if exc.hint else (),
        )
        return [(6, note)]
    ref = Path(space.model_ref)
    name = (
        ref.name
        if ref.suffix == ".gguf"
        else f"{space.model_ref.rstrip('/').split('/')[-1]}-{model.file_type}.gguf"
    )
    per_slot = min(w.p99_tokens, model.n_ctx_train or w.p99_tokens)
    base = LlamaCppSettings(
        ctx_size=per_slot * w.concurrency, parallel=w.concurrency, gpu_count=space.gpu_count
    )
    total = space.gpu.total_bytes if space.free_bytes is None else space.free_bytes
    split = best_split(model, base, total, w.headroom_bytes, host_memory_bytes)
    smaller_kv = dataclasses.replace(base, cache_type_k="q8_0", cache_type_v="q8_0")
    kv_q8 = (
        best_split(
            model,
            smaller_kv,
            total,
            w.headroom_bytes,
            host_memory_bytes,
            split.settings.n_gpu_layers,
        )
        if split.settings.n_gpu_layers <= model.n_layer and not model.n_expert
        else None
    )
    cpu = price_split(
        model, dataclasses.replace(base, gpu_count=0), total, w.headroom_bytes, host_memory_bytes
    )
    return [
        (6, _llama_cpp_tier(space, split, ref_s, "llama_cpp", name, alternative_cls, kv_q8)),
        (7, _llama_cpp_tier(space, cpu, ref_s, "cpu_only", name, alternative_cls, None)),
    ]
