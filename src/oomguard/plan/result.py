"""The plan as a value: what the CLI renders and the Python API returns.

A :class:`PlanResult` holds the configuration oomguard tells the user to run (``plan``), the
user's configuration as given (``given``), the workload, the recommendation with a reason per
flag, ranked alternatives when nothing fits, a sizing table when no GPU was named, and where
calibrated measurements replaced estimates. ``to_dict()`` / ``to_json()`` give one JSON object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oomguard.memory.parallel import engine_world_size
from oomguard.units import gib_rounded
from oomguard.vllm_args import explicit_flags, plain_value, render_llm, render_serve, render_yaml
from oomguard.workload import Workload

if TYPE_CHECKING:
    from oomguard.calibration.prefix import PrefixCacheAdvice
    from oomguard.memory.engine import EngineSettings, MemoryPrediction
    from oomguard.memory.spec import GPUSpec, ModelSpec


@dataclass(frozen=True)
class ServeCheck:
    """Whether a configuration serves the workload, in the binding sense.

    ``max_concurrency`` is vLLM's own figure at ``max_model_len = p99_tokens`` (it accounts for
    per-request blocks, sliding windows and Mamba state); ``required_concurrency`` is the
    workload's concurrency × (1 + margin), reduced for a shared prefix.
    """

    served: bool
    max_concurrency: float
    required_concurrency: float
    effective_concurrency: float  # concurrency after prefix sharing, before the margin
    kv_tokens_needed: int
    margin_achieved: float  # spare capacity over the effective concurrency (0.25 = 25 %)
    reason: str = ""
    # vLLM's concurrency at the low and high ends of the KV budget's range
    max_concurrency_range: tuple[float, float] = (0.0, 0.0)

    @property
    def served_at_low_end(self) -> bool:
        """Still served when every estimated term takes the worst end of its range."""
        return self.served and self.max_concurrency_range[0] >= self.required_concurrency

    def to_dict(self) -> dict[str, Any]:
        return {
            "served": self.served,
            "served_at_low_end": self.served_at_low_end,
            "max_concurrency": round(self.max_concurrency, 2),
            "max_concurrency_range": [round(c, 2) for c in self.max_concurrency_range],
            "required_concurrency": round(self.required_concurrency, 2),
            "kv_tokens_needed": self.kv_tokens_needed,
            "margin_achieved": round(self.margin_achieved, 3),
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Candidate:
    """One fully specified deployment and the memory model's prediction for it."""

    model_ref: str  # what goes after ``vllm serve``
    model: ModelSpec
    gpu: GPUSpec
    gpu_count: int
    settings: EngineSettings  # explicit settings (None = vLLM's default)
    prediction: MemoryPrediction
    serve: ServeCheck | None = None
    weights_label: str = ""  # "bf16", "fp8 (online)", "int4 AWQ checkpoint"
    weights_key: str = "native"  # "native" | "fp8" | "int4"

    @property
    def fits(self) -> bool:
        return bool(self.prediction.fits)

    @property
    def gpus_used(self) -> int:
        """GPUs the configuration occupies: tensor × pipeline × prefill-context × data parallel
        (decode context parallelism reuses the tensor-parallel GPUs)."""
        s = self.settings
        tp, pp = s.tensor_parallel_size, s.pipeline_parallel_size
        return engine_world_size(tp, pp, s.prefill_context_parallel_size) * s.data_parallel_size

    @property
    def parallel_label(self) -> str:
        """``TP 2 × DP 8 (EP)`` style description of the layout ("" on one GPU)."""
        s = self.settings
        parts = [
            f"{name} {size}"
            for name, size in (
                ("TP", s.tensor_parallel_size),
                ("PP", s.pipeline_parallel_size),
                ("DP", s.data_parallel_size),
            )
            if size > 1
        ]
        text = " × ".join(parts)
        if s.enable_expert_parallel and text:
            text += " (EP)"
        return text

    @property
    def serves(self) -> bool:
        return self.fits and (self.serve is None or self.serve.served)

    def commands(self, other_flags: dict[str, Any] | None = None) -> dict[str, str]:
        """The runnable forms of this configuration."""
        return {
            "vllm_serve": render_serve(self.model_ref, self.settings, other_flags=other_flags),
            "llm": render_llm(self.model_ref, self.settings),
            "yaml": render_yaml(self.model_ref, self.settings),
        }

    def summary_dict(self) -> dict[str, Any]:
        """The compact figures used by alternatives and sizing rows."""
        p = self.prediction
        return {
            "gpu": self.gpu.name,
            "gpu_count": self.gpus_used,
            "weights": self.weights_label,
            "settings": {name: plain_value(value) for name, value in explicit_flags(self.settings)},
            "fits": self.fits,
            "weights_gib": gib_rounded(p.weights.value_bytes),
            "kv_cache_gib": gib_rounded(p.kv_cache_bytes),
            "kv_cache_tokens": p.kv_cache_tokens,
            "max_concurrency": round(float(p.max_concurrency), 2),
            "serve": self.serve.to_dict() if self.serve else None,
            "command": render_serve(self.model_ref, self.settings),
        }


@dataclass(frozen=True)
class FlagReason:
    """One flag of the recommendation and why it has that value."""

    flag: str  # vLLM flag name without dashes, or "model"
    value: Any
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"flag": self.flag, "value": self.value, "reason": self.reason}


@dataclass(frozen=True)
class Recommendation:
    """The cheapest configuration found that serves the workload, with a reason per flag."""

    candidate: Candidate
    reasons: tuple[FlagReason, ...]
    steps: tuple[str, ...]  # checklist steps that were needed, in order
    min_gpu_memory_utilization: float | None = None  # lowest util that still serves (approx.)

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "flags": [r.to_dict() for r in self.reasons],
            "min_gpu_memory_utilization": self.min_gpu_memory_utilization,
            **self.candidate.summary_dict(),
            "commands": self.candidate.commands(),
        }


@dataclass(frozen=True)
class Alternative:
    """A ranked way out when the workload does not fit the given GPUs."""

    rank: int
    # as_planned | more_gpus | larger_gpu | quantization | quantize_yourself | shorter_context |
    # cpu_offload | llama_cpp | cpu_only
    kind: str
    title: str
    serves_workload: bool
    numbers: dict[str, Any]
    command: str
    caveats: tuple[str, ...] = ()
    candidate: Candidate | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rank": self.rank,
            "kind": self.kind,
            "title": self.title,
            "serves_workload": self.serves_workload,
            "numbers": self.numbers,
            "command": self.command,
            "caveats": list(self.caveats),
        }
        if self.candidate is not None:
            out["config"] = self.candidate.summary_dict()
        return out


@dataclass(frozen=True)
class SizingRow:
    """One line of the sizing table: a GPU model and the smallest count that serves."""

    gpu: str
    total_gib: float
    count: int
    serves: bool
    kv_cache_tokens: int
    max_concurrency: float
    margin_achieved: float | None
    command: str
    weights_gib_per_gpu: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "total_gib": round(self.total_gib, 2),
            "count": self.count,
            "serves": self.serves,
            "kv_cache_tokens": self.kv_cache_tokens,
            "max_concurrency": round(self.max_concurrency, 2),
            "margin_achieved": None
            if self.margin_achieved is None
            else round(self.margin_achieved, 3),
            "weights_gib_per_gpu": self.weights_gib_per_gpu,
            "command": self.command,
        }


@dataclass(frozen=True)
class Calibration:
    """Whether measured terms from real logs replaced the model's estimates."""

    used: bool
    source: str = ""
    terms: tuple[str, ...] = ()
    key: str = ""  # the store entry used: "gpu|vllm minor|model family|tpN"

    def to_dict(self) -> dict[str, Any]:
        return {
            "used": self.used,
            "source": self.source,
            "terms": list(self.terms),
            "key": self.key,
        }


_ESTIMATE_TERMS = ("weights", "activation", "non_torch", "cudagraph")
# the settings the JSON shows, in its order
_SETTINGS_KEYS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                  "enable_expert_parallel", "gpu_memory_utilization", "max_model_len",
                  "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "quantization",
                  "dtype", "enforce_eager", "block_size", "enable_prefix_caching",
                  "kv_cache_memory_bytes", "num_gpu_blocks_override", "cpu_offload_gb",
                  "performance_mode", "speculative_config",
                  "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_dtype",
                  "fully_sharded_loras", "limit_mm_per_prompt", "skip_mm_profiling",
                  "mm_encoder_tp_mode", "mm_processor_cache_gb",
                  "mm_processor_cache_type", "decode_context_parallel_size",
                  "prefill_context_parallel_size", "kv_offloading_size", "kv_offloading_backend",
                  "kv_transfer_config", "enable_sleep_mode", "compilation_config",
                  "cudagraph_capture_sizes", "max_cudagraph_capture_size",
                  "estimate_cudagraphs", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
                  "mamba_block_size", "mamba_cache_mode")  # fmt: skip
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def weights_known(c: Candidate) -> tuple[bool, str]:
    """(estimated, how known) for the weights term of ``c``, in a few words.

    Weights are counted: parameters × bytes per element (packed layouts and scales for
    quantized formats), split by TP/PP and checked against the checkpoint's own byte count
    where the facts have it. Their range is what such counts missed by on real startup logs
    (``oomguard.memory.bands``), wider for quantized formats, multimodal towers and
    architectures read by the generic reader.
    """
    est = c.prediction.weights
    if not est.estimated:
        return False, "measured" if est.basis.startswith("measured") else "exact"
    spread = (est.high_bytes - est.value_bytes) / max(est.value_bytes, 1) * 100
    quant = c.model.quant.method or c.settings.quantization
    if not c.model.verified:
        return True, f"counted ±{spread:.1f} %: architecture not verified (generic reader)"
    if quant:
        return True, f"counted ±{spread:.1f} %: {quant} packing and scales"
    params_b = c.model.total_params / 1e9
    from oomguard.memory.weights import resolve_model_dtype

    served = resolve_model_dtype(c.model, c.settings.dtype, c.gpu.compute_capability)
    dtype = _DTYPE_NAMES.get(served, served)
    split = []
    if c.settings.tensor_parallel_size > 1:
        split.append(f"TP {c.settings.tensor_parallel_size}")
    if c.settings.pipeline_parallel_size > 1:
        split.append(f"PP {c.settings.pipeline_parallel_size}")
    where = f" ÷ {' × '.join(split)}" if split else ""
    checked = " (checkpoint size)" if "checkpoint element count" in est.basis else ""
    return True, f"counted ±{spread:.1f} %: {params_b:.2f} B params × {dtype}{where}{checked}"


@dataclass(frozen=True)
class PlanResult:
    """Everything ``oomguard plan`` knows; the CLI renders it, the API returns it.

    ``plan`` is the configuration oomguard tells the user to run: the recommendation when a
    workload was given and one serves it, otherwise the configuration as given (``given``).
    ``fits`` and :attr:`exit_code` follow ``plan`` (and the workload, when stated).
    """

    model_ref: str
    plan: Candidate
    given: Candidate
    gpu_source: str  # "catalogue" | "nvml" | "custom" | "sizing"
    workload: Workload | None = None
    recommendation: Recommendation | None = None
    alternatives: tuple[Alternative, ...] = ()
    sizing: tuple[SizingRow, ...] = ()
    calibration: Calibration = field(default_factory=lambda: Calibration(used=False))
    notes: tuple[str, ...] = ()
    other_flags: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0
    # prefix caching on or off from a hit rate bench or watch measured (None: none measured)
    prefix_caching: PrefixCacheAdvice | None = None

    @property
    def fits(self) -> bool:
        """True when the planned configuration starts and (if stated) serves the workload."""
        if self.workload is not None and self.workload.stated:
            return self.plan.serves
        return self.plan.fits

    @property
    def exit_code(self) -> int:
        """0 fits, 1 does not fit (bad input never reaches a PlanResult: it raises)."""
        return 0 if self.fits else 1

    @property
    def command(self) -> str:
        """The ``vllm serve`` command of the planned configuration."""
        return render_serve(self.plan.model_ref, self.plan.settings, other_flags=self.other_flags)

    def commands(self) -> dict[str, str]:
        """``vllm serve`` (one line and multi-line), ``LLM(...)`` and YAML forms of the plan."""
        out = self.plan.commands(self.other_flags)
        out["vllm_serve_multiline"] = render_serve(
            self.plan.model_ref, self.plan.settings, other_flags=self.other_flags, multiline=True
        )
        return out

    def _estimates_dict(self) -> dict[str, Any]:
        """Each budget term's value, range and basis (the weights' known-ness from the plan)."""
        p = self.plan.prediction
        estimates = {}
        for term in _ESTIMATE_TERMS:
            est = getattr(p, term)
            estimated = bool(est.estimated)
            basis = est.basis
            if term == "weights":
                estimated, how = weights_known(self.plan)
                basis = f"{how} ({est.basis})" if estimated else est.basis
            estimates[term] = {
                "estimated": estimated,
                "value_gib": gib_rounded(est.value_bytes),
                "low_gib": gib_rounded(est.low_bytes if estimated else est.value_bytes),
                "high_gib": gib_rounded(est.high_bytes if estimated else est.value_bytes),
                "basis": basis,
            }
        return estimates

    def _gpu_dict(self) -> dict[str, Any]:
        return {
            "name": self.plan.gpu.name,
            "total_gib": round(self.plan.gpu.total_gib, 2),
            "count": self.plan.gpus_used,
            "available": self.plan.gpu_count,
            "free_gib": gib_rounded(self.plan.prediction.free_bytes)
            if self.gpu_source == "nvml"
            else None,
            "source": self.gpu_source,
        }

    def _memory_dict(self) -> dict[str, Any]:
        p = self.plan.prediction
        return {
            "total_gib": gib_rounded(p.total_bytes),
            "requested_gib": gib_rounded(p.requested_bytes),
            "weights_gib": gib_rounded(p.weights.value_bytes),
            "activation_gib": gib_rounded(p.activation.value_bytes),
            "non_torch_gib": gib_rounded(p.non_torch.value_bytes),
            "cudagraph_gib": gib_rounded(p.cudagraph.value_bytes),
            "kv_cache_gib": gib_rounded(p.kv_cache_bytes),
            # what the estimated terms' ranges allow (equal ends when all are measured)
            "kv_cache_gib_range": [gib_rounded(b) for b in p.kv_cache_bytes_range],
        }

    def _given_dict(self) -> dict[str, Any] | None:
        """The configuration as given, when the plan differs from it."""
        if self.given is self.plan:
            return None
        given = self.given
        return {
            "fits": given.fits,
            "serve": given.serve.to_dict() if given.serve else None,
            "kv_cache_gib": gib_rounded(given.prediction.kv_cache_bytes),
            "kv_cache_tokens": given.prediction.kv_cache_tokens,
            "max_concurrency": round(float(given.prediction.max_concurrency), 2),
            "problems": [
                {"code": pr.code, "message": pr.message} for pr in given.prediction.problems
            ],
            "command": render_serve(given.model_ref, given.settings),
        }

    def to_dict(self) -> dict[str, Any]:
        """One JSON-ready object (keys documented in docs/plan.md)."""
        p = self.plan.prediction
        workload = None
        if self.workload is not None:
            workload = {
                **self.workload.to_dict(),
                **(self.plan.serve.to_dict() if self.plan.serve else {}),
            }
        return {
            "model": self.model_ref,
            "model_name": self.plan.model.name,
            # False: an architecture read by the generic reader (see notes; wider ranges)
            "model_verified": self.plan.model.verified,
            "vllm_version": p.settings.vllm_version,
            "gpu": self._gpu_dict(),
            "settings": {key: plain_value(getattr(p.settings, key)) for key in _SETTINGS_KEYS},
            "memory": self._memory_dict(),
            "kv_cache_tokens": p.kv_cache_tokens,
            "kv_cache_tokens_range": list(p.kv_cache_tokens_range),
            "max_concurrency": round(float(p.max_concurrency), 2),
            "max_concurrency_range": [round(float(c), 2) for c in p.max_concurrency_range],
            "kv_bytes_per_token": p.kv_bytes_per_token,
            "num_blocks": p.num_blocks,
            "bytes_per_block": p.bytes_per_block,
            "estimated_max_model_len": p.estimated_max_model_len,
            "fits": self.fits,
            "starts": self.plan.fits,
            "problems": [{"code": pr.code, "message": pr.message} for pr in p.problems],
            "command": self.command,
            "commands": self.commands(),
            "log_lines": list(p.log_lines),
            "workload": workload,
            "recommendation": None
            if self.recommendation is None
            else self.recommendation.to_dict(),
            "alternatives": [a.to_dict() for a in self.alternatives],
            "sizing": [row.to_dict() for row in self.sizing],
            "estimates": self._estimates_dict(),
            "calibration": self.calibration.to_dict(),
            "prefix_caching": None
            if self.prefix_caching is None
            else self.prefix_caching.to_dict(),
            "given": self._given_dict(),
            "notes": list(self.notes),
            "elapsed_s": round(self.elapsed_s, 4),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, default=str)
