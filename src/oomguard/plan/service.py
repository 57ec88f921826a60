"""oomguard's Python API: the same values the CLI renders.

>>> from oomguard import plan
>>> result = plan("meta-llama/Llama-3.1-8B-Instruct", gpu="L4", p99_tokens=8192, concurrency=16)
>>> result.fits, result.command
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from oomguard.errors import BadInput, OomguardError
from oomguard.memory.engine import EngineSettings, MeasuredTerms, MemoryPrediction, predict
from oomguard.memory.parallel import engine_world_size
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.plan.features import feature_notes
from oomguard.plan.recommend import (
    SearchSpace,
    alternatives,
    recommend,
    sizing_table,
    valid_tp_sizes,
    weights_options,
)
from oomguard.plan.result import (
    Alternative,
    Calibration,
    Candidate,
    PlanResult,
    Recommendation,
)
from oomguard.units import GIB
from oomguard.vllm_args import ParsedCommand, parse_command, parse_human_int
from oomguard.workload import DEFAULT_MARGIN, Workload, shared_prefix_tokens

if TYPE_CHECKING:
    from oomguard.calibration.prefix import PrefixCacheAdvice

# the format words oomguard.calibration.model_family keeps in a family name
_CHECKPOINT_FORMATS = ("awq", "gptq", "fp8", "int4", "int8", "w4a16", "w8a8", "bnb-4bit", "gguf",
                       "nvfp4", "mxfp4")  # fmt: skip
_SETTING_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineSettings))

__all__ = ["plan", "PlanResult", "Workload"]


def _resolve_gpu(
    gpu: str | GPUSpec | None, gpu_memory_gib: float | None
) -> tuple[GPUSpec | None, str, int | None, int | None]:
    """(spec, source, detected count, free bytes) for --gpu / --gpu-memory-gib."""
    from oomguard.facts.gpus import custom_gpu, detect_gpus, find_gpu

    if isinstance(gpu, GPUSpec):
        spec: GPUSpec | None = gpu
        source = "custom"
    elif gpu is None:
        if gpu_memory_gib is None:
            return None, "sizing", None, None
        return (
            custom_gpu(gpu_memory_gib, name=f"custom {gpu_memory_gib:g} GiB"),
            "custom",
            None,
            None,
        )
    elif gpu.strip().lower() == "auto":
        detected = detect_gpus()
        spec = detected[0].spec
        free = min(d.free_bytes for d in detected)
        if gpu_memory_gib is not None:
            spec = dataclasses.replace(spec, total_bytes=round(gpu_memory_gib * GIB))
        return spec, "nvml", len(detected), free
    else:
        spec = find_gpu(gpu)
        source = "catalogue"
    if gpu_memory_gib is not None and spec is not None:
        if not gpu_memory_gib > 0:
            raise BadInput(
                f"--gpu-memory-gib {gpu_memory_gib} must be positive",
                "pass the GPU's memory in GiB",
            )
        spec = dataclasses.replace(
            spec,
            name=f"{spec.name} ({gpu_memory_gib:g} GiB)",
            total_bytes=round(gpu_memory_gib * GIB),
        )
        source = "custom"
    return spec, source, None, None


@dataclasses.dataclass
class _CalibrationLookup:
    """Measured terms from the calibration store for one (GPU, vLLM version, model).

    Each configuration the search prices asks with its own settings, so a term measured under
    other settings (another batch-token cap, dtype, quantization, eager mode) is left to the
    estimate. ``keys`` records which store entry served each TP.
    """

    gpu: GPUSpec
    vllm_version: str
    model_name: str
    memo: dict[tuple[Any, ...], MeasuredTerms | None] = dataclasses.field(default_factory=dict)
    keys: dict[int, str] = dataclasses.field(default_factory=dict)
    error: str = ""

    def __call__(self, settings: EngineSettings) -> MeasuredTerms | None:
        from oomguard.calibration import settings_filters

        filters = {"pp": settings.pipeline_parallel_size, **settings_filters(settings)}
        tp = settings.tensor_parallel_size
        memo_key = (tp, *filters.values())
        if memo_key not in self.memo:
            try:
                self.memo[memo_key] = self._find(tp, filters)
            except OomguardError as exc:
                self.memo[memo_key] = None  # an unreadable store must not stop a plan
                self.error = f"calibration store not used: {exc}"
        return self.memo[memo_key]

    def _find(self, tp: int, filters: dict[str, Any]) -> MeasuredTerms | None:
        from oomguard.calibration import lookup, model_family
        from oomguard.calibration.store import make_key

        terms = lookup(self.gpu.name, self.vllm_version, self.model_name, tp, **filters)
        if terms is not None:
            family = model_family(self.model_name)
            self.keys[tp] = make_key(self.gpu.name, self.vllm_version, family, tp, pp=filters["pp"])
        return terms


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """One plan's inputs, read and checked: bad numbers raise :class:`BadInput` on construction."""

    model: str
    base: EngineSettings
    fixed: frozenset[str]  # the settings given, which the search keeps
    notes: tuple[str, ...]
    other_flags: dict[str, Any]
    p99_tokens: int | str | None = None
    concurrency: int | None = None
    shared_prefix: float | int | str | None = None
    headroom_gib: float = 0.0
    margin: float = DEFAULT_MARGIN
    host_memory_gib: float | None = None
    gpu_count: int | None = None

    def __post_init__(self) -> None:
        if self.margin < 0:
            raise BadInput(
                f"--margin {self.margin} is negative", "pass a fraction such as 0.1 (10 % spare KV)"
            )
        if self.headroom_gib < 0:
            raise BadInput(f"--headroom-gib {self.headroom_gib} is negative", "pass 0 or more GiB")
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise BadInput(
                f"--host-memory-gib {self.host_memory_gib} must be positive",
                "pass the host's RAM in GiB",
            )
        p99 = self.p99
        if p99 is not None and p99 <= 0:
            raise BadInput(
                f"--p99-tokens {self.p99_tokens}: a length must be positive",
                "pass the P99 prompt+output in tokens",
            )
        if self.concurrency is not None and self.concurrency <= 0:
            raise BadInput(
                f"--concurrency {self.concurrency} must be at least 1",
                "pass the peak number of concurrent requests",
            )
        if self.gpu_count is not None and self.gpu_count < 1:
            raise BadInput(
                f"--gpu-count {self.gpu_count} must be at least 1", "pass the number of GPUs"
            )

    @property
    def p99(self) -> int | None:
        """The P99 length as given (``8k`` read as 8000), or None."""
        if self.p99_tokens is None:
            return None
        return parse_human_int(str(self.p99_tokens), flag="--p99-tokens")

    def workload(self, spec: ModelSpec) -> Workload:
        """The workload to serve: as stated, else one request at the model's length."""
        p99, concurrency = self.p99, self.concurrency
        stated = p99 is not None or concurrency is not None
        base, derived = self.base, spec.derived_max_model_len
        if p99 is None:
            p99 = base.max_model_len if base.max_model_len not in (None, -1) else derived
        if concurrency is None:
            concurrency = base.max_num_seqs if stated and base.max_num_seqs else 1
        if p99 > derived:
            raise BadInput(
                f"--p99-tokens {p99} exceeds {spec.name}'s context length of {derived} tokens",
                "vLLM refuses longer requests; check the P99 or pick a longer-context model",
            )
        return Workload(
            p99_tokens=int(p99),
            concurrency=int(concurrency),
            shared_prefix_tokens=shared_prefix_tokens(self.shared_prefix, int(p99)),
            margin=float(self.margin) if stated else 0.0,
            headroom_bytes=int(self.headroom_gib * GIB),
            stated=stated,
        )


def read_request(
    model: str | None,
    command: str | Sequence[str] | None,
    settings: dict[str, Any],
    **numbers: Any,
) -> PlanRequest:
    """The request from MODEL or a pasted ``vllm serve`` command, the settings and the numbers."""
    notes: list[str] = []
    other_flags: dict[str, Any] = {}
    kwargs: dict[str, Any] = {}
    if command is not None:
        parsed: ParsedCommand = parse_command(command)
        parsed.check_flags()  # a misspelt flag is an error naming the closest real one
        if model is not None and model != parsed.model:
            raise BadInput(
                f"two models given: {model!r} and {parsed.model!r} in the command",
                "pass the model once, in the command or as MODEL",
            )
        model = parsed.model
        kwargs.update(parsed.settings_kwargs)
        other_flags = dict(parsed.other_flags)
        notes.extend(parsed.notes())
    if model is None:
        raise BadInput("no model given", "pass MODEL (catalogue name, hub id or local path)")
    unknown = sorted(set(settings) - _SETTING_FIELDS)
    if unknown:
        raise BadInput(
            f"unknown setting(s): {', '.join(unknown)}",
            "use EngineSettings field names such as max_model_len, tensor_parallel_size",
        )
    kwargs.update({k: v for k, v in settings.items() if v is not None})
    fixed = frozenset(k for k in kwargs if k not in ("vllm_version", "platform", "usage_context"))
    return PlanRequest(
        model=model,
        base=EngineSettings(**kwargs),
        fixed=fixed,
        notes=tuple(notes),
        other_flags=other_flags,
        **numbers,
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """The GPU to plan for, how it was found, how many there are and their free memory."""

    gpu: GPUSpec | None  # None: a sizing table over the catalogue
    source: str
    count: int
    free_bytes: int | None


def resolve_target(
    req: PlanRequest,
    spec: ModelSpec,
    gpu: str | GPUSpec | None,
    gpu_memory_gib: float | None,
    notes: list[str],
) -> Target:
    """The GPU and count, checked against the parallel sizes the settings ask for."""
    gpu_spec, gpu_source, detected_count, free_bytes = _resolve_gpu(gpu, gpu_memory_gib)
    base = req.base
    tp, pp, pcp = (
        base.tensor_parallel_size,
        base.pipeline_parallel_size,
        base.prefill_context_parallel_size,
    )
    world = engine_world_size(tp, pp, pcp) * base.data_parallel_size
    count = req.gpu_count or (max(world, detected_count or 1) if detected_count else world)
    if world > count:
        what = (
            "tensor × pipeline × prefill-context × data" if pcp > 1 else "tensor × pipeline × data"
        )
        raise BadInput(
            f"{what} parallel = {world} GPUs, but only {count} available",
            "lower --tensor-parallel-size/--pipeline-parallel-size/--data-parallel-size or "
            "raise --gpu-count",
        )
    if base.enable_expert_parallel and spec.moe is None:
        notes.append(
            f"--enable-expert-parallel has no effect: {spec.name} has no MoE layers "
            "(every rank holds the whole model)"
        )
    return Target(gpu_spec, gpu_source, count, free_bytes)


def check_tp(spec: ModelSpec, gpu: GPUSpec, base: EngineSettings) -> None:
    """Strict first: an impossible TP is bad input (exit 2), not a "does not fit"."""
    try:
        predict(spec, gpu, base)
    except BadInput as exc:
        tp = base.tensor_parallel_size
        valid = valid_tp_sizes(spec, max(8, tp))
        if tp in valid:
            raise
        heads = f"{spec.num_attention_heads} attention heads"
        if spec.num_kv_heads and spec.num_kv_heads != spec.num_attention_heads:
            heads += f" and {spec.num_kv_heads} KV heads"
        raise BadInput(
            f"--tensor-parallel-size {tp} does not split {spec.name}'s {heads} evenly",
            f"use one of {', '.join(map(str, valid))}",
        ) from exc


@dataclasses.dataclass(frozen=True)
class PlanOutcome:
    """The configuration as given, the plan to show, the fix and the fallback chain."""

    given: Candidate
    plan: Candidate
    recommendation: Recommendation | None
    alternatives: tuple[Alternative, ...]


def find_plan(
    space: SearchSpace, req: PlanRequest, target: Target, catalogue: list[GPUSpec]
) -> PlanOutcome:
    """Price the given configuration; with a workload or a miss, search for a fix, and
    without one, build the fallback chain."""
    native = weights_options(space.model_ref, space.model, space.gpu, req.base, req.fixed)[0]
    given = space.candidate(native, req.base)
    if not space.workload.stated:
        given = dataclasses.replace(given, serve=None)
    if not (space.workload.stated or not given.fits):
        return PlanOutcome(given, given, None, ())
    recommendation, outcome = recommend(space, given.prediction)
    if recommendation is not None:
        chosen = recommendation.candidate if space.workload.stated else given
        return PlanOutcome(given, chosen, recommendation, ())
    from oomguard.plan.chain import fallback_chain

    host = _host_memory_bytes(req.host_memory_gib, target.source)
    alts = alternatives(space, outcome, given.prediction, catalogue)
    return PlanOutcome(given, given, None, tuple(fallback_chain(space, given, alts, host)))


def _calibration(plan: Candidate, measured: _CalibrationLookup | None) -> Calibration:
    """Which of the plan's terms the calibration store measured, and from which entry."""
    terms = [
        t
        for t in ("weights", "activation", "non_torch", "cudagraph")
        if getattr(plan.prediction, t).basis.startswith("measured")
    ]
    if not terms or measured is None:
        return Calibration(used=False)
    found = measured(plan.settings)
    return Calibration(
        used=True,
        source=found.source if found is not None else "calibration store",
        terms=tuple(terms),
        key=measured.keys.get(plan.settings.tensor_parallel_size, ""),
    )


def _prefix_caching(
    space: SearchSpace, plan: Candidate, notes: list[str]
) -> PrefixCacheAdvice | None:
    """Prefix caching on or off from a hit rate measured for this GPU, model, TP and PP (any
    vLLM version unless one was given); None when none was measured."""
    from oomguard.calibration.prefix import measured_advice

    s = plan.settings
    version = None if space.base.vllm_version in (None, "", "latest") else space.base.vllm_version
    try:
        return measured_advice(
            space.gpu.name,
            version,
            space.model.name,
            s.tensor_parallel_size,
            s.pipeline_parallel_size,
        )
    except OomguardError as exc:  # an unreadable store must not stop a plan
        notes.append(f"calibration store not used for prefix caching: {exc.one_line()}")
        return None


def assemble(
    space: SearchSpace,
    target: Target,
    found: PlanOutcome,
    version: str,
    notes: list[str],
    other_flags: dict[str, Any],
    started: float,
) -> PlanResult:
    """The result: the search's outcome with the calibration used and the notes."""
    measured = space.measured if isinstance(space.measured, _CalibrationLookup) else None
    calibration = _calibration(found.plan, measured)
    notes.extend(speculation_notes(found.plan.prediction))
    if measured is not None and measured.error:
        notes.append(measured.error)
    gpu = space.gpu
    if gpu.unified_memory:
        notes.append(unified_memory_note(gpu, version))
    if target.source == "nvml" and target.free_bytes is not None:
        notes.append(
            f"NVML: {target.free_bytes / GIB:.2f} GiB free of {gpu.total_gib:.2f} "
            "GiB on the fullest GPU"
        )
    return PlanResult(
        prefix_caching=_prefix_caching(space, found.plan, notes) if measured else None,
        model_ref=space.model_ref,
        plan=found.plan,
        given=found.given,
        gpu_source=target.source,
        workload=space.workload,
        recommendation=found.recommendation,
        alternatives=found.alternatives,
        calibration=calibration,
        notes=tuple(notes),
        other_flags=other_flags,
        elapsed_s=time.perf_counter() - started,
    )


def plan(
    model: str | None = None,
    gpu: str | GPUSpec | None = None,
    *,
    gpu_count: int | None = None,
    gpu_memory_gib: float | None = None,
    p99_tokens: int | str | None = None,
    concurrency: int | None = None,
    shared_prefix: float | int | str | None = None,
    headroom_gib: float = 0.0,
    margin: float = DEFAULT_MARGIN,
    command: str | Sequence[str] | None = None,
    allow_hub: bool = True,
    use_calibration: bool = True,
    host_memory_gib: float | None = None,
    **settings: Any,
) -> PlanResult:
    """Plan a vLLM deployment: predicted memory, the verdict, and the command that serves the
    workload.

    ``model`` is a catalogue name, hub id or local path; ``gpu`` a catalogue name, ``"auto"``
    (NVML) or None for a sizing table over the catalogue. ``settings`` are
    :class:`~oomguard.memory.engine.EngineSettings` fields (``max_model_len=8192``,
    ``tensor_parallel_size=2``…); they are constraints the search keeps. ``command`` is a pasted
    ``vllm serve …`` line (its flags are read as settings). With ``p99_tokens`` and
    ``concurrency`` the checklist search returns the cheapest configuration that serves them with
    ``margin`` spare KV capacity. When nothing serves, the alternatives are the fallback chain
    (:mod:`oomguard.plan.chain`), whose host-memory needs are checked against
    ``host_memory_gib`` (with ``gpu="auto"``: this machine's memory). Bad input raises
    :class:`~oomguard.errors.BadInput` (one line)."""
    started = time.perf_counter()
    req = read_request(
        model,
        command,
        settings,
        p99_tokens=p99_tokens,
        concurrency=concurrency,
        shared_prefix=shared_prefix,
        headroom_gib=headroom_gib,
        margin=margin,
        host_memory_gib=host_memory_gib,
        gpu_count=gpu_count,
    )
    from oomguard.facts.gpus import list_gpus
    from oomguard.facts.resolve import (
        attach_drafter,
        resolve_model_with_quantization,
        serve_reference,
    )
    from oomguard.memory.versions import resolve_era

    req = dataclasses.replace(req, base=attach_drafter(req.base, allow_hub=allow_hub))
    spec = resolve_model_with_quantization(req.model, req.base.quantization, allow_hub=allow_hub)
    model_ref = serve_reference(req.model)
    notes = [*req.notes, *spec.caveats]  # generic reader, a sibling's or base model's config
    notes.extend(adapter_notes(spec, req.base))
    workload = req.workload(spec)
    target = resolve_target(req, spec, gpu, gpu_memory_gib, notes)
    version = resolve_era(req.base.vllm_version, req.base.engine).label
    catalogue = list_gpus()
    if target.gpu is None:
        args = (model_ref, spec, req.base, req.fixed, workload, catalogue, notes)
        return _sizing_plan(*args, req.other_flags, started)
    measured = _CalibrationLookup(target.gpu, version, spec.name) if use_calibration else None
    space = SearchSpace(
        model_ref=model_ref,
        model=spec,
        gpu=target.gpu,
        gpu_count=target.count,
        base=req.base,
        fixed=req.fixed,
        workload=workload,
        free_bytes=target.free_bytes,
        measured=measured,
    )
    check_tp(spec, target.gpu, req.base)
    found = find_plan(space, req, target, catalogue)
    host_bytes = _host_memory_bytes(req.host_memory_gib, target.source)
    notes.extend(feature_notes(found.plan.prediction, host_bytes))
    return assemble(space, target, found, version, notes, req.other_flags, started)


def adapter_notes(spec: ModelSpec, settings: EngineSettings) -> list[str]:
    """What the plan says about LoRA and the multimodal encoder: host memory, and what is an
    upper bound or a measurement it does not price."""
    from oomguard.memory import lora
    from oomguard.memory import multimodal as mm
    from oomguard.memory.dtypes import dtype_bytes
    from oomguard.memory.engine import lora_slots

    notes: list[str] = []
    if settings.enable_lora:
        rank = settings.max_lora_rank or lora.DEFAULT_MAX_LORA_RANK
        slots = lora_slots(settings)
        cached = settings.max_cpu_loras or slots
        dtype = spec.dtype if settings.lora_dtype == "auto" else settings.lora_dtype
        shape = lora.LoraShape(slots, rank, dtype_bytes(dtype))
        host = cached * lora.adapter_host_bytes(spec, shape) / GIB
        notes.append(
            f"LoRA: buffers for {slots} adapter(s) at rank {rank} are counted in the weights; "
            f"{cached} adapter(s) cached in host memory take up to {host:.2f} GiB"
        )
        kinds = sorted({layer.kind.value for layer in spec.layers} - {"full", "sliding", "chunked"})
        if kinds:
            notes.append(f"LoRA on {', '.join(kinds)} layers is priced as attention (±50 %)")
    if spec.vision is None:
        return notes
    if settings.skip_mm_profiling:
        notes.append(
            "--skip-mm-profiling: the encoder's activations and cache are not reserved at "
            "startup; large images or videos can run out of memory while serving"
        )
    elif mm.has_size_options(settings.limit_mm_per_prompt):
        notes.append(
            "the item sizes in --limit-mm-per-prompt shrink the profiled item; the plan keeps "
            "the model's largest item (an upper bound on the encoder outputs)"
        )
    cache = mm.processor_cache_host_bytes(
        settings.mm_processor_cache_gb,
        settings.mm_processor_cache_type,
        data_parallel=settings.data_parallel_size,
    )
    notes.append(
        f"multimodal processor cache: {cache / GIB:.1f} GiB of host memory "
        f"({settings.mm_processor_cache_type}); the encoder pass's activation peak is a "
        "measurement, priced as a range"
    )
    return notes


def speculation_notes(prediction: MemoryPrediction) -> list[str]:
    """What the plan says of its drafter: what it adds, and what could not be read."""
    from oomguard.memory.speculative import summary

    spec = prediction.speculation
    if spec is None:
        return []
    return [summary(spec), *spec.notes]


def _host_memory_bytes(host_memory_gib: float | None, gpu_source: str) -> int | None:
    """Host RAM to check the chain's host needs against: as given, or this machine's with NVML
    GPUs."""
    if host_memory_gib is not None:
        return int(host_memory_gib * GIB)
    if gpu_source == "nvml":
        import psutil

        return int(psutil.virtual_memory().total)
    return None


def unified_memory_note(gpu: GPUSpec, vllm_version: str) -> str:
    """What a GPU that shares the host's memory (GB10, Jetson) changes for the plan, in one line."""
    from oomguard.memory.versions import resolve_era

    era = resolve_era(vllm_version)
    free_from = (
        "what the OS reports available"
        if era.uma_free_from_os
        else "CUDA's free figure, which counts the page cache as used"
    )
    return (
        f"{gpu.name} shares its {gpu.total_gib:.2f} GiB with the host: vLLM {era.label} compares "
        f"gpu_memory_utilization × total with {free_from}, and the OS, the page cache of earlier "
        "loads (vllm#48140) and every other process draw from the same pool; keep the "
        "utilization below available ÷ total (see `free -g`) or pass --headroom-gib for what "
        "else runs"
    )


def _sizing_plan(
    model_ref: str,
    spec: ModelSpec,
    base: EngineSettings,
    fixed: frozenset[str],
    workload: Workload,
    catalogue: list[GPUSpec],
    notes: list[str],
    other_flags: dict[str, Any],
    started: float,
) -> PlanResult:
    """No GPU named: which catalogue GPUs and counts serve the workload."""
    first = catalogue[0]
    space = SearchSpace(
        model_ref=model_ref,
        model=spec,
        gpu=first,
        gpu_count=8,
        base=base,
        fixed=fixed - {"tensor_parallel_size"},
        workload=workload,
    )
    rows = sizing_table(space, catalogue)
    serving = [c for row, c in rows if c.serves]
    if serving:
        chosen: Candidate = serving[0]
    else:
        largest = max(catalogue, key=lambda g: g.total_bytes)
        native = weights_options(model_ref, spec, largest, base, fixed)[0]
        chosen = space.candidate(
            native,
            dataclasses.replace(base, tensor_parallel_size=1, max_model_len=workload.p99_tokens),
            gpu=largest,
            count=1,
        )
        notes.append(
            "no catalogue GPU serves this workload with up to 8 GPUs at the checkpoint's precision"
        )
    if not workload.stated:
        notes.append(
            f"no workload given: sized for one request of {workload.p99_tokens:,} tokens "
            "(pass --p99-tokens and --concurrency for your traffic)"
        )
    return PlanResult(
        model_ref=model_ref,
        plan=chosen,
        given=chosen,
        gpu_source="sizing",
        workload=workload,
        sizing=tuple(row for row, _ in rows),
        notes=tuple(notes),
        other_flags=other_flags,
        elapsed_s=time.perf_counter() - started,
    )
