"""Tier 1: named mechanism checks. Each fires only when the numbers it needs are in the log.

Every check models one way vLLM or PyTorch spends memory (docs/memory-model.md §2–§7) and
returns a :class:`Verdict` — a cause the numbers prove, with its numbers as evidence — or None.
None means "this mechanism cannot be shown from what the log states", never "it is not the
cause": the calibrated ranking (``model.py``) handles everything the checks leave open.

The thresholds are properties of the mechanisms, not fitted to cases:

- a share of the device held by others of at least ``OTHER_PROCESS_SHARE`` is a process, not
  the CUDA context, a display server or allocator slack (those take a few hundred MiB to 2 GiB);
- others at most ``CONTEXT_SHARE`` of the device is the normal overhead, so a request above
  the free memory is the utilization asking for too much;
- the weights at ``WEIGHTS_FILL_SHARE`` of the budget leave no KV cache whatever the length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from oomguard.doctor.situation import Situation
from oomguard.logs.parsed import Evidence, OomEvent, Phase

OTHER_PROCESS_SHARE = 0.5
CONTEXT_SHARE = 0.15
WEIGHTS_FILL_SHARE = 0.9
# a CUDA-graph estimate this share of the budget is what left the KV cache nothing
GRAPH_SHARE = 0.2
# an activation peak this share of the budget is the profiling batch, not noise
ACTIVATION_SHARE = 0.25
# memory held before the engine started: at least this share is another process
HELD_BEFORE_SHARE = 0.25
# TP ranks whose other-process memory differs by this share of the device are asymmetric
RANK_ASYMMETRY_SHARE = 0.2
# the highest utilization worth raising to, and the share of the device a raised budget must
# then leave for the KV cache for "the utilization is too low" rather than "the weights fill it"
MAX_UTIL = 0.95
ROOM_FOR_KV_SHARE = 0.1
# a utilization set at or below this plans for sharing the device with another workload
SHARED_UTIL = 0.6
# reserved-but-unallocated memory is fragmentation only when it is this many times the
# request and at least FRAGMENTED_MIN_GIB (small cached remainders are normal)
FRAGMENTED_RATIO = 2.0
FRAGMENTED_MIN_GIB = 1.0


@dataclass(frozen=True)
class Verdict:
    """A cause a mechanism check proved, and the numbers that prove it."""

    mechanism: str
    cause: str
    summary: str
    explanation: str
    evidence: tuple[Evidence, ...] = ()
    numbers: dict[str, float] = field(default_factory=dict)


def _ev(*items: Evidence | None) -> tuple[Evidence, ...]:
    return tuple(e for e in items if e is not None)


def cotenant_expected(s: Situation) -> bool:
    """Whether another workload is meant to share the device: the user says so, or set the
    utilization well below vLLM's default (a budget planned for sharing)."""
    util = s.util
    return s.context.expect_cotenant or (s.util_stated and util is not None and util <= SHARED_UTIL)


def _total(s: Situation) -> float | None:
    total = s.get("startup_total_gib") or s.total_gib
    return float(total) if total else None


# --- the checks ----------------------------------------------------------------------------------


def check_kv_fit(s: Situation) -> Verdict | None:
    """vLLM's fit check: one request of max_model_len needs more KV than the pool holds (§7)."""
    ev = s.parsed.evidence("kv_too_small")
    length = s.get("kv_error_max_model_len")
    if ev is None or not length:
        return None
    capacity = s.get("estimated_max_model_len") or s.get("kv_capacity_tokens")
    need, avail = s.get("kv_needed_gib"), s.get("kv_available_gib")
    if not capacity and need and avail is not None and float(need) > 0:
        capacity = int(int(length) * max(float(avail), 0.0) / float(need))
    if capacity is None:
        return None
    numbers = {"max_model_len": float(length), "kv_capacity_tokens": float(capacity)}
    if need and avail is not None:
        numbers.update(kv_needed_gib=float(need), kv_available_gib=float(avail))
    return Verdict(
        "kv_fit_check",
        "kv_too_small_for_max_len",
        f"max_model_len {int(length):,} does not fit in the KV cache, which holds about "
        f"{int(capacity):,} tokens",
        "vLLM checks at start-up that one request of max_model_len tokens fits in the KV cache "
        "left after weights, activations and graphs; it does not.",
        _ev(ev, s.parsed.evidence("estimated_max_model_len")),
        numbers,
    )


def explicit_kv_bytes(s: Situation) -> int | None:
    """``--kv-cache-memory-bytes`` when the command or the log's arguments set it."""
    value = s.context.args.get("kv_cache_memory_bytes") or s.parsed.args.get(
        "kv_cache_memory_bytes"
    )
    if not value:
        return None
    try:
        from oomguard.vllm_args import parse_human_int

        return parse_human_int(str(value))
    except Exception:  # an unreadable value states no size
        return None


def check_explicit_pool(s: Situation) -> Verdict | None:
    """``--kv-cache-memory-bytes`` sets the pool exactly (§2.5): a pool too small for one
    request of max_model_len, or for one block, is that setting."""
    p = s.parsed
    ev = p.evidence("kv_too_small") or p.evidence("no_cache_blocks")
    pool = explicit_kv_bytes(s)
    if ev is None or pool is None:
        return None
    return Verdict(
        "explicit_kv_pool",
        "kv_too_small_for_max_len",
        f"--kv-cache-memory-bytes {pool:,} is too small for one request of max_model_len",
        "With --kv-cache-memory-bytes vLLM skips the memory profiling and gives the KV cache "
        "exactly that many bytes; they do not hold one request of max_model_len.",
        _ev(ev, p.args_evidence),
        {"kv_cache_memory_bytes": float(pool)},
    )


def check_startup_free_memory(s: Situation) -> Verdict | None:
    """The start-up check: free memory below utilization × total (§2.1). Who holds the rest
    decides: a large share is another process, a small one is the utilization asking too much."""
    ev = s.parsed.evidence("startup_check_failed")
    free, total = s.get("startup_free_gib"), _total(s)
    if ev is None or free is None or not total:
        return None
    others = max(total - float(free), 0.0)
    share = others / total
    numbers = {"free_gib": float(free), "total_gib": total, "others_gib": others}
    if s.util is not None:
        numbers["gpu_memory_utilization"] = float(s.util)
    cpu = s.get("platform") == "cpu"
    expected = cotenant_expected(s)
    if share >= OTHER_PROCESS_SHARE and not cpu and not expected:
        return Verdict(
            "startup_free_memory",
            "leak_or_other_process",
            f"{others:.1f} of {total:.1f} GiB ({share:.0%}) were held by another process when "
            "vLLM started",
            "vLLM requests utilization × total memory and refuses to start when less is free. "
            "A share this large is another process (a leftover engine, a trainer, a second "
            "server), not the CUDA context.",
            (ev,),
            numbers,
        )
    if share <= CONTEXT_SHARE or cpu or expected:
        held = (
            "other processes on the node"
            if cpu
            else "the workloads sharing the GPU"
            if expected
            else "the CUDA context and other processes"
        )
        return Verdict(
            "startup_free_memory",
            "util_overshoot",
            f"gpu_memory_utilization asks for more than the {float(free):.2f} GiB free: "
            f"{others:.1f} GiB are held by {held}",
            "vLLM requests utilization × total memory at start-up; what others hold is normal "
            "overhead or a planned co-tenant, so the utilization is set too high for what is "
            "left of this device.",
            (ev,),
            numbers,
        )
    return None


def check_budget(s: Situation) -> Verdict | None:
    """No KV blocks: utilization × total minus weights, activation peak, non-torch memory and
    the CUDA-graph estimate left nothing (§2.4). The term that took the budget is the cause."""
    p = s.parsed
    ev = p.evidence("no_cache_blocks") or p.evidence("auto_fit_failed")
    total, util = _total(s), s.util
    if ev is None or not total or util is None:
        return None
    budget = total * float(util)
    held = _held_before_start(s, total)
    if held is not None and held >= HELD_BEFORE_SHARE * total and s.get("platform") != "cpu":
        if not cotenant_expected(s):
            return _budget_verdict(
                s,
                ev,
                "leak_or_other_process",
                {"held_before_gib": held, "total_gib": total},
                f"{held:.1f} GiB were in use before this engine started",
            )
    graphs = s.get("cudagraph_estimate_gib")
    if graphs is not None and float(graphs) >= max(2.0, GRAPH_SHARE * budget):
        return _budget_verdict(
            s,
            ev,
            "cuda_graph",
            {"cudagraph_estimate_gib": float(graphs), "budget_gib": budget},
            f"vLLM reserved {float(graphs):.2f} GiB for CUDA graphs of a {budget:.1f} GiB budget",
        )
    weights = s.known("weights_per_gpu_gib")
    if weights is None or weights.origin not in ("log", "facts"):
        return _activation_verdict(s, ev, budget)
    w = float(weights.value)
    if w >= WEIGHTS_FILL_SHARE * budget:
        numbers = {"weights_gib": w, "budget_gib": budget, "total_gib": total}
        act = float(s.get("activation_gib") or 1.0)
        if MAX_UTIL * total - w - act < ROOM_FOR_KV_SHARE * total:
            return _budget_verdict(
                s,
                ev,
                "weights_dont_fit",
                numbers,
                f"the weights take {w:.1f} GiB of a {total:.1f} GiB device",
            )
        return _budget_verdict(
            s,
            ev,
            "kv_too_small_for_max_len",
            numbers,
            f"utilization {float(util):g} gives {budget:.1f} GiB; the weights alone take {w:.1f}",
        )
    return _activation_verdict(s, ev, budget)


def _held_before_start(s: Situation, total: float) -> float | None:
    held = s.get("initial_used_gib")
    if held is None and s.get("startup_free_gib") is not None:
        held = total - float(s.get("startup_free_gib"))
    return None if held is None else float(held)


def _activation_verdict(s: Situation, ev: Evidence, budget: float) -> Verdict | None:
    act = s.get("activation_gib")
    if act is None or float(act) < ACTIVATION_SHARE * budget:
        return None
    return _budget_verdict(
        s,
        ev,
        "concurrency_or_batch",
        {"activation_gib": float(act), "budget_gib": budget},
        f"the profiling batch peaked at {float(act):.2f} GiB of a {budget:.1f} GiB budget",
    )


def _budget_verdict(
    s: Situation, ev: Evidence, cause: str, numbers: dict[str, float], summary: str
) -> Verdict:
    p = s.parsed
    return Verdict(
        "budget_arithmetic",
        cause,
        summary + ": nothing was left for the KV cache",
        "vLLM gives the KV cache utilization × total memory minus the weights, the profiled "
        "activation peak, non-torch memory and the CUDA-graph estimate; here that is zero.",
        _ev(
            ev,
            p.evidence("weights_gib"),
            p.evidence("activation_gib"),
            p.evidence("cudagraph_estimate_gib"),
            p.evidence("initial_used_gib"),
        ),
        numbers,
    )


def check_cpu_kv_budget(s: Situation) -> Verdict | None:
    """CPU backend: utilization × node memory minus the worker's resident memory is below
    zero (vllm 0.32 ``cpu_worker.py``), so the utilization is too low for the KV cache."""
    ev = s.parsed.evidence("cpu_kv_allocation_failed")
    if ev is None:
        return None
    numbers = {"gpu_memory_utilization": float(s.util)} if s.util is not None else {}
    return Verdict(
        "cpu_kv_budget",
        "kv_too_small_for_max_len",
        "utilization × node memory is below what the worker already holds: no KV cache",
        "On the CPU backend the KV cache gets gpu_memory_utilization × node memory minus the "
        "worker's resident memory; that is negative here.",
        (ev,),
        numbers,
    )


def check_failed_allocation(s: Situation) -> Verdict | None:
    """A PyTorch OOM with its figures: memory other processes hold, or a cached remainder the
    allocator could not hand out in one piece (reserved but unallocated ≥ the request)."""
    oom = s.parsed.first_oom
    if oom is None or oom.total_gib is None or oom.free_gib is None:
        return None
    total = oom.total_gib
    others, own = oom.other_processes_gib, oom.own_gib
    numbers = {"total_gib": total, "free_gib": oom.free_gib}
    if oom.tried_gib is not None:
        numbers["tried_gib"] = oom.tried_gib
    if (
        others is not None
        and own is not None
        and others >= OTHER_PROCESS_SHARE * total
        and others >= 2 * own
        and not cotenant_expected(s)
    ):
        return Verdict(
            "failed_allocation",
            "leak_or_other_process",
            f"other processes held {others:.1f} of {total:.1f} GiB when the allocation failed; "
            f"the failing process held {own:.1f}",
            "PyTorch's report lists the memory in use on the device; most of it belongs to "
            "processes other than the one that failed, which held too little to be the cause.",
            (oom.evidence,),
            {**numbers, "other_processes_gib": others, "own_gib": own},
        )
    spare = oom.reserved_unallocated_gib
    tried = oom.tried_gib
    if (
        spare is not None
        and tried
        and tried > oom.free_gib
        and spare >= max(FRAGMENTED_RATIO * tried, FRAGMENTED_MIN_GIB)
    ):
        return Verdict(
            "failed_allocation",
            "fragmentation",
            f"{spare:.2f} GiB were reserved but unallocated, more than the {tried:.2f} GiB "
            "requested: the cached memory was fragmented",
            "PyTorch's caching allocator held enough memory for the request, but not in one "
            "piece; expandable segments let it grow blocks instead.",
            (oom.evidence,),
            {**numbers, "reserved_unallocated_gib": spare},
        )
    return None


def check_rank_asymmetry(s: Situation) -> Verdict | None:
    """Tensor-parallel ranks that hold the same shard but see different free memory: the
    difference is another process on the short GPU."""
    per_gpu: dict[int, tuple[float, OomEvent]] = {}
    for oom in s.parsed.ooms:
        others = oom.other_processes_gib
        if oom.gpu_index is not None and others is not None and oom.total_gib:
            per_gpu.setdefault(oom.gpu_index, (others / oom.total_gib, oom))
    if len(per_gpu) < 2:
        return None
    high_gpu, (high, high_oom) = max(per_gpu.items(), key=lambda kv: kv[1][0])
    low = min(share for share, _ in per_gpu.values())
    if high - low < RANK_ASYMMETRY_SHARE:
        return None
    return Verdict(
        "rank_asymmetry",
        "leak_or_other_process",
        f"GPU {high_gpu} had {high - low:.0%} more of its memory taken by other processes than "
        "its tensor-parallel peers",
        "Tensor-parallel ranks load the same share of the model; one GPU with much less free "
        "memory holds another process.",
        (high_oom.evidence,),
        {"gpu_index": float(high_gpu), "others_share_high": high, "others_share_low": low},
    )


_HOST_SIGNATURES = (
    "host_ram_kill",
    "host_alloc_failure",
    "cpu_swap_exhausted",
    "cpu_swap_too_large",
    "shm_exhausted",
    "host_ram_low",
)


def check_host_memory(s: Situation) -> Verdict | None:
    """Host memory ran out: the kernel's or Ray's OOM killer, a failed host allocation, the
    swap space or /dev/shm. The GPU is not the problem."""
    p = s.parsed
    found = [name for name in _HOST_SIGNATURES if p.has(name)]
    if not found or (p.ooms and p.failure_phase is not None and not p.has("host_ram_kill")):
        return None
    numbers: dict[str, float] = {}
    for name in ("host_ram_total_gib", "host_ram_available_gib", "swap_space_gib"):
        if s.get(name) is not None:
            numbers[name] = float(s.get(name))
    return Verdict(
        "host_memory",
        "cpu_ram",
        "host memory ran out (" + ", ".join(n.replace("_", " ") for n in found) + ")",
        "The process was killed or refused for host RAM, not GPU memory: loading, swap space, "
        "CPU offload, pinned buffers and shared memory all live in the host's RAM.",
        _ev(*(p.signatures[n] for n in found)),
        numbers,
    )


def check_encoder_profile(s: Situation) -> Verdict | None:
    """The multimodal encoder's profiling run (§2.3): an OOM inside the vision/audio encoder,
    or while the encoder budget is being profiled."""
    p = s.parsed
    in_encoder = p.signatures.get("failing_in_mm_encoder")
    profiling = p.failure_phase is not None and p.failure_phase.value == Phase.PROFILING
    profile_line = p.signatures.get("mm_encoder_profile")
    if in_encoder is None and not (profiling and profile_line is not None and p.ooms):
        return None
    numbers = {}
    for name in ("encoder_budget_tokens", "encoder_profile_items"):
        if s.get(name) is not None:
            numbers[name] = float(s.get(name))
    return Verdict(
        "encoder_profile",
        "multimodal_encoder",
        "the multimodal encoder ran out of memory on its maximal dummy items",
        "vLLM profiles the vision/audio encoder on the largest items the limits allow; that run "
        "needs more memory than the budget leaves.",
        _ev(in_encoder, profile_line, p.first_oom.evidence if p.first_oom else None),
        numbers,
    )


# the phase of an OOM proves the consumer: the engine was doing only that when it failed
_PHASE_CAUSE = {
    Phase.WEIGHT_LOADING: ("weights_dont_fit", "loading the weights"),
    Phase.SAMPLER_WARMUP: ("concurrency_or_batch", "warming up the sampler for max_num_seqs"),
    Phase.CUDA_GRAPH_CAPTURE: ("cuda_graph", "capturing CUDA graphs"),
}


def check_failure_phase(s: Situation) -> Verdict | None:
    """An out-of-memory error in a phase that has one consumer: weight loading (the weights),
    the sampler warm-up (max_num_seqs sequences of logits), CUDA-graph capture (the graphs)."""
    p = s.parsed
    phase = p.failure_phase
    if phase is None or phase.value not in _PHASE_CAUSE:
        return None
    oom_line = p.first_oom.evidence if p.first_oom else p.signatures.get("sampler_warmup_oom")
    if oom_line is None and not p.has("weight_load_oom"):
        return None
    cause, doing = _PHASE_CAUSE[phase.value]
    return Verdict(
        "failure_phase",
        cause,
        f"memory ran out while {doing}",
        f"The engine was {doing} when the allocation failed; nothing else was allocating then.",
        _ev(oom_line, p.signatures.get("weight_load_oom"), phase.evidence),
        {},
    )


def check_state_blocks(s: Situation) -> Verdict | None:
    """Hybrid (Mamba) models keep one state block per running sequence: more sequences than
    blocks cannot run."""
    ev = s.parsed.evidence("mamba_blocks_exceeded")
    seqs, blocks = s.get("mamba_max_num_seqs"), s.get("mamba_cache_blocks")
    if ev is None or not seqs or not blocks:
        return None
    return Verdict(
        "state_blocks",
        "concurrency_or_batch",
        f"max_num_seqs {int(seqs)} exceeds the {int(blocks)} Mamba state blocks that fit",
        "Each running sequence of a hybrid model holds one state block; the pool must hold "
        "max_num_seqs of them.",
        (ev,),
        {"max_num_seqs": float(seqs), "state_blocks": float(blocks)},
    )


def check_memory_growth(s: Situation) -> Verdict | None:
    """Memory the engine keeps growing across steps or sleep cycles: a leak."""
    p = s.parsed
    first, last = s.get("sleep_residual_first_gib"), s.get("sleep_residual_gib")
    if first is not None and last is not None and float(last) >= float(first) + 1.0:
        return Verdict(
            "memory_growth",
            "leak_or_other_process",
            f"memory kept after sleep grew from {float(first):.2f} to {float(last):.2f} GiB",
            "Sleep mode should release the same memory every cycle; a residual that grows is "
            "memory the engine does not free.",
            _ev(p.evidence("sleep_residual_first_gib"), p.evidence("sleep_residual_gib")),
            {"residual_first_gib": float(first), "residual_last_gib": float(last)},
        )
    return None


def check_allocator_conflict(s: Situation) -> Verdict | None:
    """Allocator settings the platform refuses: expandable segments inside sleep mode's memory
    pool, or WSL2 unable to make expandable memory resident."""
    p = s.parsed
    ev = p.signatures.get("sleep_expandable_conflict") or p.signatures.get("wsl_resident_enomem")
    if ev is None:
        return None
    return Verdict(
        "allocator_conflict",
        "other",
        "the allocator configuration is refused: expandable segments cannot be used here",
        "Sleep mode's memory pool and WSL2's driver both reject PyTorch's expandable segments; "
        "the failure is the setting, not the amount of memory.",
        (ev,),
        {},
    )


# In precedence order: a check that names who holds the memory comes before one that names
# what was being allocated (another process filling the GPU during weight loading is the
# other process, not the weights).
MECHANISMS: tuple[Callable[[Situation], Verdict | None], ...] = (
    check_allocator_conflict,
    check_host_memory,
    check_kv_fit,
    check_explicit_pool,
    check_cpu_kv_budget,
    check_startup_free_memory,
    check_rank_asymmetry,
    check_failed_allocation,
    check_budget,
    check_state_blocks,
    check_encoder_profile,
    check_failure_phase,
    check_memory_growth,
)


def run_mechanisms(s: Situation) -> list[Verdict]:
    """Every verdict the checks reach, in precedence order."""
    out: list[Verdict] = []
    for check in MECHANISMS:
        verdict = check(s)
        if verdict is not None:
            out.append(verdict)
    return out
