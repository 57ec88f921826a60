"""The startup-log rows the planner is scored on: reading them, rebuilding each row's engine
settings offline, and predicting them (shared by ``planner_accuracy.py`` and ``planner_bands.py``).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from oomguard.errors import BadInput, OomguardError
from oomguard.memory.activation import DEFAULT_COEFFICIENTS, Coefficients
from oomguard.memory.engine import EngineSettings, MemoryPrediction, predict
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.memory.versions import parse_version
from oomguard.units import GIB

HERE = Path(__file__).resolve().parent
_DEV_CANDIDATES = (
    HERE.parent.parent / "shared" / "data" / "vllm-startup-logs.jsonl",
    HERE.parent.parent.parent / "shared" / "data" / "vllm-startup-logs.jsonl",
    Path("/work/shared/data/vllm-startup-logs.jsonl"),
)
HOLDOUT_GLOB = "startup-logs*.jsonl"
NAIVE_RESERVE_GIB = 1.0

# compute capability by GPU family, for rows whose free-text GPU name the catalogue cannot
# resolve (public NVIDIA specs)
_CAPABILITY = (("b200", "10.0"), ("h100", "9.0"), ("h200", "9.0"), ("h20", "9.0"), ("a100", "8.0"),
               ("l40s", "8.9"), ("l4", "8.9"), ("4090", "8.9"), ("3090", "8.6"), ("a6000", "8.6"),
               ("a10", "8.6"), ("t4", "7.5"), ("v100", "7.0"), ("2060", "7.5"), ("turing", "7.5"),
               ("volta", "7.0"))  # fmt: skip

# the row's "quantization" (what the log said vLLM used) → vLLM's --quantization value
_QUANT_FLAGS = {
    "awq": "awq", "awq_marlin": "awq_marlin", "gptq": "gptq", "gptq_marlin": "gptq_marlin",
    "fp8": "fp8", "compressed-tensors": "compressed-tensors", "mxfp4": "mxfp4",
    "bitsandbytes": "bitsandbytes", "modelopt": "modelopt", "modelopt_fp4": "modelopt_fp4",
}  # fmt: skip


@dataclass
class Case:
    """One observed figure and what the planner (and the naive formula) said of it."""

    dataset: str
    row: int
    source: str
    model: str
    version: str
    era: str
    metric: str
    observed: float
    predicted: float
    low: float = 0.0
    high: float = 0.0
    naive: float | None = None
    why: str = ""

    @property
    def rel_err_pct(self) -> float:
        return abs(self.predicted - self.observed) / abs(self.observed) * 100

    @property
    def naive_err_pct(self) -> float | None:
        if self.naive is None:
            return None
        return abs(self.naive - self.observed) / abs(self.observed) * 100

    @property
    def covered(self) -> bool:
        return self.low - 1e-9 <= self.observed <= self.high + 1e-9

    @property
    def half_width_pct(self) -> float:
        return (self.high - self.low) / 2 / max(abs(self.predicted), 1e-9) * 100


@dataclass
class Prepared:
    """One scoreable row: what to predict and what was observed."""

    dataset: str
    row: int
    source: str
    model: ModelSpec
    gpu: GPUSpec
    settings: EngineSettings
    observed: dict[str, float]
    raw_observed: dict[str, Any] = field(default_factory=dict)
    # False when the row's printed terms contradict vLLM's accounting (see ``inconsistent``):
    # none of its terms is used
    terms_consistent: bool = True


def source_key(source: str) -> str:
    """Group label of a row's source: ``owner/repo#N`` for issues/PRs, ``owner/repo`` for files,
    the site for other pages."""
    m = re.match(r"https?://github\.com/([^/]+/[^/]+)/(?:issues|pull)/(\d+)", source)
    if m:
        return f"{m.group(1)}#{m.group(2)}"
    m = re.match(r"https?://github\.com/([^/]+/[^/]+)", source)
    if m:
        return m.group(1)
    m = re.match(r"https?://([^/]+)", source)
    if m:
        return m.group(1)
    m = re.search(r"id (\d+)", source)
    return f"code file {m.group(1)}" if m else source[:40]


def era_label(settings: EngineSettings, version: str) -> str:
    """The vLLM era a row belongs to, for the per-era view."""
    if settings.engine == "v0":
        return "V0 engine"
    minor = parse_version(version)[1]
    for top, label in ((11, "0.10-0.11"), (17, "0.12-0.17"), (19, "0.18-0.19"), (26, "0.20-0.26")):
        if minor <= top:
            return label
    return "0.27+"


def _capability(name: str) -> str:
    low = name.lower()
    for key, cc in _CAPABILITY:
        if key in low:
            return cc
    return ""


def _gpu(row: dict[str, Any]) -> GPUSpec:
    from oomguard.facts.gpus import resolve_gpu

    name = str(row.get("gpu") or "unknown GPU")
    total = row.get("gpu_total_gib")
    try:
        spec = resolve_gpu(name)
    except OomguardError:
        if not total:
            raise
        spec = GPUSpec(
            name=name,
            total_bytes=0,
            marketing_gb=0,
            compute_capability=_capability(name),
            device_name=name.lower(),
        )
    if total:  # the log's own CUDA total beats the catalogue's
        spec = replace(spec, total_bytes=int(total * GIB))
    return spec


def _quant_flag(row: dict[str, Any]) -> str | None:
    text = str(row.get("quantization") or "").strip().lower()
    if not text:
        return None
    first = text.split()[0]
    if first not in _QUANT_FLAGS:
        raise ValueError(f"quantization {row['quantization']!r} has no vLLM flag modelled")
    return _QUANT_FLAGS[first]


def _settings(row: dict[str, Any], flag: str | None) -> EngineSettings:
    engine = row.get("engine") or "v0"  # version-less rows carry V0-style profiling lines
    version = row.get("vllm_version")
    if version:
        version = str(version).split()[0]
        parse_version(version)
    if engine == "v0":
        version = version if version and parse_version(version)[1] <= 10 else "0.10"
    elif not version:
        raise ValueError("V1 row without a vLLM version")
    kv_dtype = (row.get("kv_cache_dtype") or "auto").split()[0]
    dtype = str(row["dtype"]) if row.get("dtype") in ("bfloat16", "float16", "float32") else "auto"
    return EngineSettings(
        vllm_version=version or "0.10",
        engine=engine,
        tensor_parallel_size=row.get("tensor_parallel_size") or 1,
        pipeline_parallel_size=row.get("pipeline_parallel_size") or 1,
        data_parallel_size=row.get("data_parallel_size") or 1,
        enable_expert_parallel=bool(row.get("enable_expert_parallel")),
        gpu_memory_utilization=row.get("gpu_memory_utilization"),
        max_model_len=row.get("max_model_len"),
        max_num_seqs=row.get("max_num_seqs"),
        max_num_batched_tokens=row.get("max_num_batched_tokens"),
        kv_cache_dtype=kv_dtype,
        dtype=dtype,
        quantization=flag,
        enforce_eager=bool(row.get("enforce_eager")),
        block_size=row.get("block_size"),
        enable_prefix_caching=row.get("enable_prefix_caching"),
    )


def inconsistent(row: dict[str, Any]) -> str | None:
    """Why a row's own figures contradict vLLM's accounting, or None.

    V0 and 0.10–0.26 logs print weights, activation peak, non-torch memory and KV budget that
    add up to ``util × total`` (§2.4). A row whose figures overshoot that budget by more than
    the rounding of the printed numbers was transcribed wrongly (dev row 6 says so in its note);
    its KV figure cannot be scored against any model.
    """
    obs = row.get("observed") or {}
    terms = [obs.get(k) for k in ("weights_gib", "activation_peak_gib", "non_torch_gib")]
    total, util, kv = (
        row.get("gpu_total_gib"),
        row.get("gpu_memory_utilization"),
        obs.get("kv_cache_gib"),
    )
    if None in terms or not total or not util or kv is None:
        return None
    budget = total * util
    spent = sum(float(t) for t in terms if t is not None) + float(kv)
    if spent > budget * 1.02 + 0.1:
        return f"its terms add up to {spent:.2f} GiB, more than util × total = {budget:.2f} GiB"
    return None


def prepare(rows: list[dict[str, Any]], dataset: str) -> tuple[list[Prepared], list[str]]:
    """Resolve every usable row offline; return the scoreable ones and why the others are not."""
    from oomguard.facts.quant import apply_quantization_flag
    from oomguard.facts.resolve import resolve_model

    out: list[Prepared] = []
    skipped: list[str] = []
    for i, row in enumerate(rows):
        obs = row.get("observed") or {}
        wanted = {k: obs[k] for k in ("kv_cache_gib", "weights_gib") if obs.get(k) is not None}
        if obs.get("kv_cache_gib") is not None and obs["kv_cache_gib"] <= 0:
            wanted.pop("kv_cache_gib")  # a failed start: no budget to compare
        label = f"{dataset} row {i} {row.get('model')}"
        why = inconsistent(row)
        if why and "kv_cache_gib" in wanted:
            skipped.append(f"{label}: KV not scored, {why}")
            wanted.pop("kv_cache_gib")
        if not wanted:
            skipped.append(f"{label}: no observed KV cache or weights GiB")
            continue
        try:
            flag = _quant_flag(row)
            settings = _settings(row, flag)
        except (ValueError, OomguardError) as exc:
            msg = exc.one_line() if isinstance(exc, OomguardError) else str(exc)
            skipped.append(f"{label}: settings not usable ({msg})")
            continue
        try:
            model = resolve_model(str(row["model"]), allow_hub=False)
        except OomguardError as exc:
            skipped.append(f"{label}: model not resolvable offline ({exc.message[:90]})")
            continue
        try:
            model = replace(model, quant=apply_quantization_flag(model.quant, flag))
        except BadInput:
            # the row names the kernel vLLM reported (e.g. gptq_marlin for a compressed-tensors
            # W4A16 checkpoint), not a flag the user passed: the checkpoint's format wins, as
            # vLLM's own detection does
            settings = replace(settings, quantization=None)
        try:
            gpu = _gpu(row)
        except OomguardError as exc:
            skipped.append(f"{label}: GPU {row.get('gpu')!r} unknown and no total given ({exc})")
            continue
        out.append(
            Prepared(
                dataset,
                i,
                source_key(str(row.get("source") or "")),
                model,
                gpu,
                settings,
                wanted,
                obs,
                why is None,
            )
        )
    return out, skipped


def _why(p: MemoryPrediction, obs: dict[str, Any]) -> str:
    stage = p.stages[0]

    def pair(name: str, value: int, key: str) -> str:
        seen = f" (obs {obs[key]:.2f})" if key in obs else ""
        return f"{name} {value / GIB:.2f}{seen}"

    return ", ".join(
        (
            pair("W", stage.weights_bytes, "weights_gib"),
            pair("A", stage.activation_bytes, "activation_peak_gib"),
            pair("N", stage.non_torch_bytes, "non_torch_gib"),
            pair("G", stage.cudagraph_bytes, "cudagraph_estimated_gib"),
        )
    )


def naive_kv_gib(p: MemoryPrediction) -> float:
    """The napkin: ``util × total − weights − 1 GiB`` with the same weights and total."""
    util = float(p.settings.gpu_memory_utilization or 0.9)
    return util * p.total_bytes / GIB - p.stages[0].weights_bytes / GIB - NAIVE_RESERVE_GIB


def score(
    prepared: list[Prepared], coef: Coefficients = DEFAULT_COEFFICIENTS
) -> tuple[list[Case], list[str]]:
    """Predict every prepared row; cases for each observed metric, plus refused rows."""
    cases: list[Case] = []
    refused: list[str] = []
    for p in prepared:
        try:
            pred = predict(p.model, p.gpu, p.settings, strict=False, coefficients=coef)
        except OomguardError as exc:
            refused.append(
                f"{p.dataset} row {p.row} {p.model.name}: prediction refused "
                f"({exc.one_line()[:100]})"
            )
            continue
        stage0 = pred.stages[0]  # the logged rank (rank 0 prints first)
        version = f"{p.settings.engine} {pred.vllm_version}"
        era = era_label(p.settings, pred.vllm_version)
        common = (p.dataset, p.row, p.source, p.model.name, version, era)
        if "kv_cache_gib" in p.observed:
            cases.append(
                Case(
                    *common,
                    "kv_cache_gib",
                    p.observed["kv_cache_gib"],
                    stage0.kv_cache_bytes / GIB,
                    stage0.kv_cache_bytes_low / GIB,
                    stage0.kv_cache_bytes_high / GIB,
                    naive_kv_gib(pred),
                    _why(pred, p.raw_observed),
                )
            )
        if "weights_gib" in p.observed:
            w = pred.weights
            cases.append(
                Case(
                    *common,
                    "weights_gib",
                    p.observed["weights_gib"],
                    stage0.weights_bytes / GIB,
                    w.low_bytes / GIB,
                    w.high_bytes / GIB,
                    None,
                    w.basis,
                )
            )
    return cases, refused


def stats(errs: Iterable[float]) -> tuple[float, float]:
    """Median and p90 (nearest rank) of ``errs``."""
    values = sorted(errs)
    if not values:
        return float("nan"), float("nan")
    median = statistics.median(values)
    p90 = values[min(len(values) - 1, int(round(0.9 * (len(values) - 1))))]
    return median, p90


def load_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def default_dev() -> Path | None:
    """The development logs, where this checkout can see them."""
    return next((p for p in _DEV_CANDIDATES if p.exists()), None)
