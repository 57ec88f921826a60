"""What a log states, each value with the line that states it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MAX_EVIDENCE_CHARS = 400
MAX_LIST = 16


@dataclass(frozen=True)
class Evidence:
    """A line of the log (1-based number) and its text (cut to a few hundred characters)."""

    line: int
    text: str

    @staticmethod
    def of(line: int, text: str) -> Evidence:
        text = text.strip()
        if len(text) > MAX_EVIDENCE_CHARS:
            text = text[: MAX_EVIDENCE_CHARS - 1] + "…"
        return Evidence(line=line, text=text)

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "text": self.text}


@dataclass(frozen=True)
class Observed(Generic[T]):
    """A value read from the log and where it was read."""

    value: T
    evidence: Evidence


class Phase(str, Enum):
    """Startup phases of a vLLM engine, in the order they run (V1; V0 is the same order)."""

    STARTUP = "startup"  # device init and the free-memory check
    WEIGHT_LOADING = "weight_loading"
    PROFILING = "profiling"  # dummy forward pass (and, ≤0.9, the sampler dummy run)
    KV_ALLOCATION = "kv_allocation"
    SAMPLER_WARMUP = "sampler_warmup"
    CUDA_GRAPH_CAPTURE = "cuda_graph_capture"
    SERVING = "serving"

    @property
    def rank(self) -> int:
        return list(Phase).index(self)


@dataclass(frozen=True)
class OomEvent:
    """One out-of-memory report (PyTorch allocator, CUDA driver, or vLLM's own message)."""

    kind: str  # "torch" | "driver" | "xpu" | "hip"
    evidence: Evidence
    tried_gib: float | None = None
    gpu_index: int | None = None
    total_gib: float | None = None
    free_gib: float | None = None
    this_process_gib: float | None = None
    processes_gib: tuple[tuple[int, float], ...] = ()  # (pid, GiB) listed by PyTorch
    allocated_gib: float | None = None  # allocated by PyTorch
    reserved_gib: float | None = None  # reserved in total (old format)
    reserved_unallocated_gib: float | None = None
    private_pools_gib: float | None = None  # CUDA graph pools

    @property
    def own_gib(self) -> float | None:
        """Memory the failing process itself holds on the GPU, when derivable."""
        if self.total_gib is None or self.free_gib is None:
            return None
        others = self.other_processes_gib
        return None if others is None else max(self.total_gib - self.free_gib - others, 0.0)

    @property
    def other_processes_gib(self) -> float | None:
        """Memory held on the GPU by processes other than the failing one, when derivable."""
        if self.total_gib is None or self.free_gib is None:
            return None
        used = self.total_gib - self.free_gib
        # "this process has 0 bytes memory in use": inside a container PyTorch cannot see the
        # process's own usage, so 0 means unknown, not an empty process
        if self.this_process_gib:
            return max(used - self.this_process_gib, 0.0)
        if len(self.processes_gib) == 1:
            return max(used - self.processes_gib[0][1], 0.0)
        if len(self.processes_gib) > 1:
            # one of them is the failing process: the largest is the best guess
            largest = max(g for _, g in self.processes_gib)
            return max(used - largest, 0.0)
        reserved = self.reserved_gib
        if reserved is None and self.allocated_gib is not None:
            reserved = self.allocated_gib + (self.reserved_unallocated_gib or 0.0)
        if reserved is not None:
            # only this process's torch reservation is known; allow for its CUDA context
            # (~0.5 GiB), which PyTorch does not count as reserved
            return max(used - reserved - 0.5, 0.0)
        return None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "line": self.evidence.line}
        for name in (
            "tried_gib",
            "gpu_index",
            "total_gib",
            "free_gib",
            "this_process_gib",
            "allocated_gib",
            "reserved_gib",
            "reserved_unallocated_gib",
            "private_pools_gib",
        ):
            value = getattr(self, name)
            if value is not None:
                out[name] = round(value, 4) if isinstance(value, float) else value
        if self.processes_gib:
            out["processes"] = [{"pid": p, "gib": round(g, 4)} for p, g in self.processes_gib]
        other = self.other_processes_gib
        if other is not None:
            out["other_processes_gib"] = round(other, 3)
        return out


@dataclass(frozen=True)
class GpuProcess:
    """A process listed with its GPU memory (an nvidia-smi process table or its CSV query)."""

    pid: int
    name: str
    gib: float
    evidence: Evidence
    gpu_index: int | None = None

    @property
    def is_inference_engine(self) -> bool:
        """Whether the name is a vLLM engine (or a process that hosts one: Ray workers)."""
        low = self.name.lower()
        return "vllm" in low or "enginecore" in low or "ray::" in low

    @property
    def is_python(self) -> bool:
        """Whether the name is a Python interpreter or a process that hosts one."""
        low = self.name.lower()
        return self.is_inference_engine or "python" in low or "torchrun" in low

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "pid": self.pid,
            "name": self.name,
            "gib": round(self.gib, 3),
            "line": self.evidence.line,
        }
        if self.gpu_index is not None:
            out["gpu_index"] = self.gpu_index
        return out


# Scalar fields of ParsedLog that hold Observed values, with their merge rule when a log states
# them several times (TP/PP ranks print one line each; a log may hold several attempts).
#   first: keep the first statement; min: keep the smallest (vLLM uses the minimum over
#   ranks); max: keep the largest; last: keep the latest.
FIELD_RULES: dict[str, str] = {
    "vllm_version": "first",
    "engine": "first",
    "platform": "first",
    "model": "first",
    "tensor_parallel_size": "first",
    "pipeline_parallel_size": "first",
    "data_parallel_size": "first",
    "gpu_name": "first",
    "gpu_total_gib": "first",
    "gpu_memory_utilization": "first",
    "requested_gib": "first",
    "max_model_len": "first",
    "max_num_seqs": "first",
    "max_num_batched_tokens": "first",
    "block_size": "last",
    "kv_cache_dtype": "first",
    "quantization": "first",
    "dtype": "first",
    "enforce_eager": "first",
    "cpu_offload_gib": "first",
    "swap_space_gib": "first",
    "weights_gib": "first",
    "activation_gib": "first",
    "peak_torch_gib": "first",
    "non_torch_gib": "first",
    "total_consumed_gib": "first",
    "non_kv_total_gib": "first",
    "cudagraph_estimate_gib": "first",
    "cudagraph_actual_gib": "first",
    "cudagraph_estimate_applied": "first",  # 1: subtracted from the KV budget, 0: switched off
    "available_kv_gib": "min",
    "kv_tokens": "min",
    "gpu_blocks": "min",
    "cpu_blocks": "first",
    "max_concurrency": "min",
    "concurrency_max_model_len": "first",
    "startup_free_gib": "first",
    "startup_total_gib": "first",
    "initial_used_gib": "max",
    "startup_check_failed": "first",
    # CPU backend: the worker's resident memory outside the KV cache ("consumed by non-kv
    # usages"), and the pool a failed KV allocation asked for (negative: below that memory)
    "cpu_non_kv_gib": "first",
    "cpu_kv_request_gib": "first",
    "kv_needed_gib": "first",
    "kv_available_gib": "first",
    "kv_error_max_model_len": "first",
    "kv_capacity_tokens": "first",
    "estimated_max_model_len": "first",
    "no_cache_blocks": "first",
    "auto_fit_failed": "first",
    "auto_fit_reduced_to": "first",
    "mamba_max_num_seqs": "first",
    "mamba_cache_blocks": "first",
    "sampler_warmup_oom_seqs": "first",
    "weight_load_oom": "first",
    "profiling_free_increase": "first",
    "encoder_budget_tokens": "first",
    "encoder_profile_items": "first",
    "kv_usage_max_pct": "last",
    "preemptions": "last",
    # host memory as `free` lists it
    "host_ram_total_gib": "first",
    "host_ram_available_gib": "min",
    "host_swap_total_gib": "first",
    "host_swap_free_gib": "min",
    # sleep mode: what it freed and what the engine kept (first and latest statement)
    "sleep_freed_gib": "first",
    "sleep_residual_first_gib": "first",
    "sleep_residual_gib": "last",
    # numbers stated in prose (titles, summaries): weaker than a log line
    "said_util": "max",
    "said_unallocated_gib": "max",
    "said_gpu_name": "first",
    "said_weights_gib": "first",
    "said_gpu_count": "first",
    "said_version_old": "first",
    "said_version_new": "first",
}


# signatures of a memory failure that a log line, error or traceback shows
LOGGED_MEMORY_SIGNATURES = (
    "cuda_oom",
    "driver_oom",
    "no_cache_blocks",
    "kv_too_small",
    "startup_check_failed",
    "host_ram_kill",
    "cpu_swap_exhausted",
    "host_alloc_failure",
    "mamba_blocks_exceeded",
    "sampler_warmup_oom",
    "weight_load_oom",
    "profiling_free_increase",
    "auto_fit_failed",
    "sleep_expandable_conflict",
    "memory_growth",
    "cpu_kv_allocation_failed",
    "cpu_swap_too_large",
    "host_ram_low",
    "shm_exhausted",
    "wsl_resident_enomem",
)


@dataclass
class ParsedLog:
    """Everything the log states that matters for memory, with evidence.

    ``fields`` maps a name from :data:`FIELD_RULES` to an :class:`Observed` value;
    ``signatures`` maps a signature name (``host_ram_kill``, ``nccl_error``,
    ``sleep_mode``, ``expandable_segments_hint`` …) to the first line that shows it;
    ``phases`` maps each phase seen to its first marker. Everything is bounded: a log of any
    size yields an object of the same small size.
    """

    lines: int = 0
    fields: dict[str, Observed[Any]] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)  # non-default args / engine config
    args_evidence: Evidence | None = None
    # the settings (ParsedLog field names, converted) the user's own arguments state: the
    # non-default args line, a command line, ``LLM(...)`` or the api_server Namespace; an
    # engine config line (the values in force) does not count. ``user_args_evidence`` is the
    # first such line: when it is set, a setting absent here was left at vLLM's default.
    user_settings: dict[str, Any] = field(default_factory=dict)
    user_args_evidence: Evidence | None = None
    signatures: dict[str, Evidence] = field(default_factory=dict)
    signature_counts: dict[str, int] = field(default_factory=dict)
    phases: dict[Phase, Evidence] = field(default_factory=dict)
    failure_phase: Observed[Phase] | None = None
    ooms: list[OomEvent] = field(default_factory=list)
    oom_count: int = 0
    errors: list[Evidence] = field(default_factory=list)  # exception lines (first few)
    gpu_processes: list[GpuProcess] = field(default_factory=list)  # listed by nvidia-smi
    # `ps` rows of running vLLM servers/engines (their GPU memory is not shown)
    engine_processes: list[Evidence] = field(default_factory=list)

    # --- access helpers -------------------------------------------------------------------
    def get(self, name: str) -> Any:
        """The value of a field, or None."""
        obs = self.fields.get(name)
        return obs.value if obs is not None else None

    def evidence(self, name: str) -> Evidence | None:
        obs = self.fields.get(name)
        if obs is not None:
            return obs.evidence
        return self.signatures.get(name)

    def has(self, signature: str) -> bool:
        return signature in self.signatures

    @property
    def first_oom(self) -> OomEvent | None:
        return self.ooms[0] if self.ooms else None

    @property
    def phase_reached(self) -> Phase | None:
        if not self.phases:
            return None
        return max(self.phases, key=lambda p: p.rank)

    @property
    def shows_failure(self) -> bool:
        """Whether the log reports a memory failure of any kind (the doctor's exit 3 test)."""
        memory_signatures = (
            *LOGGED_MEMORY_SIGNATURES,
            # a sentence that says memory ran out (an issue title, a summary): weaker
            # evidence, but a stated failure all the same
            "said_oom",
        )
        return any(s in self.signatures for s in memory_signatures) or bool(self.ooms)

    @property
    def only_said(self) -> bool:
        """Whether the only evidence of a failure is prose (no log line, error or traceback
        of a memory failure)."""
        return (
            self.shows_failure
            and not self.ooms
            and all(s == "said_oom" or s not in self.signatures for s in LOGGED_MEMORY_SIGNATURES)
        )

    # --- rendering ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view: values plus the line each was read from."""
        values: dict[str, Any] = {}
        for name, obs in self.fields.items():
            value = obs.value
            if isinstance(value, float):
                value = round(value, 4)
            elif isinstance(value, Enum):
                value = value.value
            values[name] = {"value": value, "line": obs.evidence.line}
        reached = self.phase_reached
        return {
            "lines": self.lines,
            "values": values,
            "args": _jsonable(self.args),
            "user_settings": _jsonable(self.user_settings),
            "signatures": {
                name: {
                    "line": ev.line,
                    "text": ev.text,
                    "count": self.signature_counts.get(name, 1),
                }
                for name, ev in self.signatures.items()
            },
            "phase_reached": reached.value if reached else None,
            "phase_failed": self.failure_phase.value.value if self.failure_phase else None,
            "phases": {
                p.value: ev.line for p, ev in sorted(self.phases.items(), key=lambda kv: kv[0].rank)
            },
            "ooms": [o.to_dict() for o in self.ooms],
            "oom_count": self.oom_count,
            "gpu_processes": [g.to_dict() for g in self.gpu_processes],
            "engine_processes": [e.to_dict() for e in self.engine_processes],
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
