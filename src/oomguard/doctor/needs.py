"""What would settle a diagnosis the log leaves open: the lines and facts each cause is told
apart by, and whether the log already holds them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from oomguard.doctor.findings import Need
from oomguard.doctor.situation import Situation


@dataclass(frozen=True)
class _Fact:
    what: str
    how: str
    causes: frozenset[str]
    present: Callable[[Situation], bool]


def _has_budget_lines(s: Situation) -> bool:
    return any(s.get(n) is not None for n in ("available_kv_gib", "activation_gib", "kv_tokens"))


def _has_process_view(s: Situation) -> bool:
    oom = s.parsed.first_oom
    return (
        bool(s.parsed.gpu_processes)
        or s.get("startup_free_gib") is not None
        or (oom is not None and oom.other_processes_gib is not None)
    )


def _has_command(s: Situation) -> bool:
    return bool(s.context.command or s.parsed.user_args_evidence or s.parsed.args)


def _has_weights(s: Situation) -> bool:
    known = s.known("weights_per_gpu_gib")
    return known is not None and known.origin in ("log", "facts") and bool(s.total_gib)


_FACTS = (
    _Fact(
        "the start-up memory lines: 'Model loading took … GiB', 'Memory profiling takes …' or "
        "'Available KV cache memory: … GiB', and 'GPU KV cache size: … tokens'",
        "keep the whole start-up log (VLLM_LOGGING_LEVEL=INFO, the default), not only the "
        "traceback",
        frozenset(
            {
                "kv_too_small_for_max_len",
                "concurrency_or_batch",
                "weights_dont_fit",
                "cuda_graph",
                "util_overshoot",
                "multimodal_encoder",
            }
        ),
        _has_budget_lines,
    ),
    _Fact(
        "what else holds the GPU",
        "run nvidia-smi (or nvidia-smi --query-compute-apps=pid,used_memory --format=csv) "
        "when it fails",
        frozenset({"leak_or_other_process", "util_overshoot", "weights_dont_fit"}),
        _has_process_view,
    ),
    _Fact(
        "the traceback down to the exception",
        "paste it whole: its frames show the phase that failed (weight loading, profiling, "
        "sampler warm-up, CUDA-graph capture, serving)",
        frozenset(
            {
                "cuda_graph",
                "concurrency_or_batch",
                "weights_dont_fit",
                "multimodal_encoder",
                "kv_too_small_for_max_len",
            }
        ),
        lambda s: s.parsed.failure_phase is not None,
    ),
    _Fact(
        "PyTorch's whole out-of-memory message",
        "it states the request, the free memory, this process's share and what is reserved "
        "but unallocated",
        frozenset(
            {"fragmentation", "leak_or_other_process", "concurrency_or_batch", "weights_dont_fit"}
        ),
        # only a PyTorch OOM whose figures were cut lacks it
        lambda s: s.parsed.first_oom is None or s.parsed.first_oom.total_gib is not None,
    ),
    _Fact(
        "the command line",
        "pass it with --command 'vllm serve …' (max_model_len, max_num_seqs, "
        "gpu_memory_utilization, limits per prompt)",
        frozenset(
            {
                "util_overshoot",
                "kv_too_small_for_max_len",
                "concurrency_or_batch",
                "multimodal_encoder",
                "cuda_graph",
            }
        ),
        _has_command,
    ),
    _Fact(
        "the model and the GPU",
        "pass --model and --gpu: the weights per GPU against the device decide whether they fit",
        frozenset({"weights_dont_fit", "kv_too_small_for_max_len"}),
        _has_weights,
    ),
    _Fact(
        "the host's memory and the kernel log",
        "free -g and dmesg | grep -i -e oom -e killed (or the container's exit code: 137 is "
        "the OOM killer)",
        frozenset({"cpu_ram"}),
        lambda s: any(s.parsed.has(n) for n in ("host_ram_kill", "host_alloc_failure")),
    ),
)


def what_would_settle(s: Situation, candidates: list[str], limit: int = 4) -> list[Need]:
    """The missing facts that tell ``candidates`` (best first) apart, most useful first."""
    scored: list[tuple[int, int, Need]] = []
    for order, fact in enumerate(_FACTS):
        if fact.present(s):
            continue
        settles = tuple(c for c in candidates if c in fact.causes)
        if not settles:
            continue
        scored.append((-len(settles), order, Need(fact.what, fact.how, settles)))
    return [need for _, _, need in sorted(scored, key=lambda t: (t[0], t[1]))][:limit]
