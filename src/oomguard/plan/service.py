"""oomguard's Python API: the same values the CLI renders.

>>> from oomguard import plan
>>> result = plan("meta-llama/Llama-3.1-8B-Instruct", gpu="L4", p99_tokens=8192, concurrency=16)
>>> result.fits, result.command
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from oomguard.errors import BadInput, OomguardError
from oomguard.memory.engine import EngineSettings, MeasuredTerms, predict
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.plan.recommend import (
    SearchSpace,
    alternatives,
    recommend,
    sizing_table,
    valid_tp_sizes,
    weights_options,
)
from oomguard.plan.result import Calibration, Candidate, PlanResult, Workload
from oomguard.vllm_args import ParsedCommand, parse_command, parse_human_int

GIB = 2**30
DEFAULT_MARGIN = 0.10
# the format words oomguard.calibration.model_family keeps in a family name
_CHECKPOINT_FORMATS = ("awq", "gptq", "fp8", "int4", "int8", "w4a16", "w8a8", "bnb-4bit", "gguf",
                       "nvfp4", "mxfp4")  # fmt: skip
_SETTING_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineSettings))

__all__ = ["plan", "PlanResult", "Workload"]


def _shared_prefix_tokens(value: float | int | str | None, p99_tokens: int) -> int:
    """A shared prefix as tokens: a fraction (0 < x < 1) of the P99, or a token count."""
    if value is None:
        return 0
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return _shared_prefix_tokens(parse_human_int(text, flag="--shared-prefix"), p99_tokens)
        value = int(number) if number >= 1 and number == int(number) else number
    if isinstance(value, float) and 0 <= value < 1:
        return int(value * p99_tokens)
    if value < 0 or (isinstance(value, float) and value != int(value)):
        raise BadInput(
            f"--shared-prefix {value} is neither a fraction below 1 nor a token count",
            "pass e.g. 0.3 (30 % of the P99) or 2048 (tokens)",
        )
    tokens = int(value)
    if tokens > p99_tokens:
        raise BadInput(
            f"--shared-prefix {tokens} tokens is longer than --p99-tokens {p99_tokens}",
            "the shared prefix is part of every request; pass at most the P99",
        )
    return tokens


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
        filters = {
            "pp": settings.pipeline_parallel_size,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "max_num_seqs": settings.max_num_seqs,
            "enforce_eager": settings.enforce_eager,
            "quantization": settings.quantization,
            "dtype": None if settings.dtype in (None, "auto") else settings.dtype,
        }
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
    """Plan a vLLM deployment: predicted memory, the verdict, and the command that serves the workload.

    ``model`` is a catalogue name, hub id or local path; ``gpu`` a catalogue name, ``"auto"``
    (NVML) or None for a sizing table over the catalogue. ``settings`` are
    :class:`~oomguard.memory.engine.EngineSettings` fields (``max_model_len=8192``,
    ``tensor_parallel_size=2``…); they are constraints the search keeps. ``command`` is a pasted
    ``vllm serve …`` line (its flags are read as settings). With ``p99_tokens`` and
    ``concurrency`` the checklist search returns the cheapest configuration that serves them with
    ``margin`` spare KV capacity. When nothing serves, the alternatives are the fallback chain
    (:mod:`oomguard.plan.chain`), whose host-memory needs are checked against
    ``host_memory_gib`` (with ``gpu="auto"``: this machine's memory). Bad input raises
    :class:`~oomguard.errors.BadInput` (one line).
    """
    started = time.perf_counter()
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
    base = EngineSettings(**kwargs)

    from oomguard.facts.resolve import resolve_model_with_quantization, serve_reference

    spec = resolve_model_with_quantization(model, base.quantization, allow_hub=allow_hub)
    model = serve_reference(model)
    notes.extend(spec.caveats)  # generic reader, a sibling's or base model's config

    # -- workload -------------------------------------------------------------------------------
    if margin < 0:
        raise BadInput(
            f"--margin {margin} is negative", "pass a fraction such as 0.1 (10 % spare KV)"
        )
    if headroom_gib < 0:
        raise BadInput(f"--headroom-gib {headroom_gib} is negative", "pass 0 or more GiB")
    if host_memory_gib is not None and not host_memory_gib > 0:
        raise BadInput(f"--host-memory-gib {host_memory_gib} must be positive", "pass the host's RAM in GiB")
    p99 = None if p99_tokens is None else parse_human_int(str(p99_tokens), flag="--p99-tokens")
    if p99 is not None and p99 <= 0:
        raise BadInput(
            f"--p99-tokens {p99_tokens}: a length must be positive",
            "pass the P99 prompt+output in tokens",
        )
    if concurrency is not None and concurrency <= 0:
        raise BadInput(
            f"--concurrency {concurrency} must be at least 1",
            "pass the peak number of concurrent requests",
        )
    stated = p99 is not None or concurrency is not None
    derived = spec.derived_max_model_len
    if p99 is None:
        p99 = base.max_model_len if base.max_model_len not in (None, -1) else derived
    if concurrency is None:
        concurrency = base.max_num_seqs if stated and base.max_num_seqs else 1
    if p99 > derived:
        raise BadInput(
            f"--p99-tokens {p99} exceeds {spec.name}'s context length of {derived} tokens",
            "vLLM refuses longer requests; check the P99 or pick a longer-context model",
        )
    workload = Workload(
        p99_tokens=int(p99),
        concurrency=int(concurrency),
        shared_prefix_tokens=_shared_prefix_tokens(shared_prefix, int(p99)),
        margin=float(margin) if stated else 0.0,
        headroom_bytes=int(headroom_gib * GIB),
        stated=stated,
    )

    # -- GPU ------------------------------------------------------------------------------------
    gpu_spec, gpu_source, detected_count, free_bytes = _resolve_gpu(gpu, gpu_memory_gib)
    world = base.tensor_parallel_size * base.pipeline_parallel_size * base.data_parallel_size
    if gpu_count is not None and gpu_count < 1:
        raise BadInput(f"--gpu-count {gpu_count} must be at least 1", "pass the number of GPUs")
    count = gpu_count or (max(world, detected_count or 1) if detected_count else world)
    if world > count:
        raise BadInput(
            f"tensor × pipeline × data parallel = {world} GPUs, but only {count} available",
            "lower --tensor-parallel-size/--pipeline-parallel-size/--data-parallel-size or "
            "raise --gpu-count",
        )
    if base.enable_expert_parallel and spec.moe is None:
        notes.append(
            f"--enable-expert-parallel has no effect: {spec.name} has no MoE layers "
            "(every rank holds the whole model)"
        )

    from oomguard.facts.gpus import list_gpus
    from oomguard.memory.versions import resolve_era

    version = resolve_era(base.vllm_version, base.engine).label
    catalogue = list_gpus()

    if gpu_spec is None:
        return _sizing_plan(
            model, spec, base, fixed, workload, catalogue, notes, other_flags, started
        )

    measured = _CalibrationLookup(gpu_spec, version, spec.name) if use_calibration else None
    space = SearchSpace(
        model_ref=model, model=spec, gpu=gpu_spec, gpu_count=count, base=base, fixed=fixed,
        workload=workload, free_bytes=free_bytes, measured=measured,
    )  # fmt: skip
    native = weights_options(model, spec, gpu_spec, base, fixed)[0]
    # Strict first: an impossible TP is bad input (exit 2), not a "does not fit".
    try:
        predict(spec, gpu_spec, base)
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
    given = space.candidate(native, base)
    if not workload.stated:
        given = dataclasses.replace(given, serve=None)
    result_plan = given
    recommendation = None
    alts: tuple[Any, ...] = ()
    if workload.stated or not given.fits:
        recommendation, outcome = recommend(space, given.prediction)
        if recommendation is not None and workload.stated:
            result_plan = recommendation.candidate
        if recommendation is None:
            from oomguard.plan.chain import fallback_chain

            host = _host_memory_bytes(host_memory_gib, gpu_source)
            alts = tuple(fallback_chain(space, given, alternatives(space, outcome, given.prediction, catalogue), host))
    calibration = Calibration(used=False)
    terms = [
        t
        for t in ("weights", "activation", "non_torch", "cudagraph")
        if getattr(result_plan.prediction, t).basis.startswith("measured")
    ]
    if terms and measured is not None:
        tp = result_plan.settings.tensor_parallel_size
        found = measured(result_plan.settings)
        calibration = Calibration(
            used=True,
            source=found.source if found is not None else "calibration store",
            terms=tuple(terms),
            key=measured.keys.get(tp, ""),
        )
    if measured is not None and measured.error:
        notes.append(measured.error)
    if gpu_spec.unified_memory:
        notes.append(unified_memory_note(gpu_spec, version))
    if gpu_source == "nvml" and free_bytes is not None:
        notes.append(
            f"NVML: {free_bytes / GIB:.2f} GiB free of {gpu_spec.total_gib:.2f} GiB on the fullest GPU"
        )
    return PlanResult(
        model_ref=model,
        plan=result_plan,
        given=given,
        gpu_source=gpu_source,
        workload=workload,
        recommendation=recommendation,
        alternatives=alts,
        calibration=calibration,
        notes=tuple(notes),
        other_flags=other_flags,
        elapsed_s=time.perf_counter() - started,
    )


def _host_memory_bytes(host_memory_gib: float | None, gpu_source: str) -> int | None:
    """Host RAM to check the chain's host needs against: as given, or this machine's with NVML GPUs."""
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
    space = SearchSpace(model_ref=model_ref, model=spec, gpu=first, gpu_count=8, base=base,
                        fixed=fixed - {"tensor_parallel_size"}, workload=workload)  # fmt: skip
    rows = sizing_table(space, catalogue)
    serving = [c for row, c in rows if c.serves]
    if serving:
        chosen: Candidate = serving[0]
    else:
        largest = max(catalogue, key=lambda g: g.total_bytes)
        native = weights_options(model_ref, spec, largest, base, fixed)[0]
        chosen = space.candidate(native, dataclasses.replace(base, tensor_parallel_size=1,
                                                             max_model_len=workload.p99_tokens), gpu=largest, count=1)  # fmt: skip
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
