"""Score the memory model against real vLLM startup logs.

For every usable row of the startup-log data set (observed "Available KV cache memory" and/or
"Model loading took"), resolve the model offline (with the row's quantization applied through
the facts layer's ``apply_quantization_flag``, as ``--quantization`` would), rebuild the engine settings the log ran with,
predict, and print count, median and p90 absolute relative error of KV-cache GiB and weights GiB,
plus the five worst cases with the terms that explain them.

The estimated terms (activation peak, non-torch growth) carry coefficients calibrated on these
same rows, so the headline KV figures are IN-SAMPLE. Two further views are printed:

* per source: the figures of each data source (repository / issue / site) separately;
* leave-one-source-out: for each source, the estimated-term coefficients are refitted on the
  other sources only (robust one-dimensional fits of each coefficient on the KV residuals, two
  Gauss-Seidel passes) and the held-out source is predicted with them. A coefficient that no
  training row informs keeps its built-in value; the fold says so, because that value was fitted
  with the held-out rows.

Weights involve no fitted coefficient (they are computed from parameter counts and formats), so
their figures are the same in every view.

Usage: python bench/planner_accuracy.py [--data PATH] [--verbose] [--no-holdout]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from oomguard.errors import BadInput, OomguardError
from oomguard.memory.activation import DEFAULT_COEFFICIENTS, Coefficients
from oomguard.memory.engine import EngineSettings, MemoryPrediction, predict
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.memory.versions import parse_version

GIB = 2**30
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "vllm-startup-logs.jsonl"
TARGETS = {"kv_cache_gib": (3.0, 10.0), "weights_gib": (1.5, None)}

# compute capability by GPU family, for rows whose free-text GPU name the catalogue cannot
# resolve (public NVIDIA specs)
_CAPABILITY = (("b200", "10.0"), ("h100", "9.0"), ("h200", "9.0"), ("h20", "9.0"), ("a100", "8.0"),
               ("l40s", "8.9"), ("l4", "8.9"), ("4090", "8.9"), ("3090", "8.6"), ("a6000", "8.6"),
               ("a10", "8.6"), ("t4", "7.5"), ("v100", "7.0"))  # fmt: skip

# the row's "quantization" (what the log said vLLM used) → vLLM's --quantization value
_QUANT_FLAGS = {
    "awq": "awq", "awq_marlin": "awq_marlin", "gptq": "gptq", "gptq_marlin": "gptq_marlin",
    "fp8": "fp8", "compressed-tensors": "compressed-tensors", "mxfp4": "mxfp4",
    "bitsandbytes": "bitsandbytes", "modelopt": "modelopt", "modelopt_fp4": "modelopt_fp4",
}  # fmt: skip


@dataclass
class Case:
    row: int
    source: str
    model: str
    version: str
    metric: str
    observed: float
    predicted: float
    why: str

    @property
    def rel_err_pct(self) -> float:
        return abs(self.predicted - self.observed) / abs(self.observed) * 100


@dataclass
class Prepared:
    """One scoreable row: what to predict and what was observed."""

    row: int
    source: str
    model: ModelSpec
    gpu: GPUSpec
    settings: EngineSettings
    observed: dict[str, float]
    raw_observed: dict[str, Any] = field(default_factory=dict)


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
        spec = GPUSpec(name=name, total_bytes=0, marketing_gb=0,
                       compute_capability=_capability(name), device_name=name.lower())  # fmt: skip
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
        version = version.split()[0]
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


def prepare(rows: list[dict[str, Any]]) -> tuple[list[Prepared], list[str]]:
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
        label = f"row {i} {row['model']}"
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
            model = resolve_model(row["model"], allow_hub=False)
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
        out.append(Prepared(i, source_key(str(row.get("source") or "")), model, gpu, settings,
                            wanted, obs))  # fmt: skip
    return out, skipped


def _why(p: MemoryPrediction, obs: dict[str, Any]) -> str:
    stage = p.stages[0]
    parts = [f"pred W {stage.weights_bytes / GIB:.2f}"]
    if "weights_gib" in obs:
        parts[-1] += f" (obs {obs['weights_gib']:.2f})"
    parts.append(
        f"A {stage.activation_bytes / GIB:.2f}"
        + (f" (obs {obs['activation_peak_gib']:.2f})" if "activation_peak_gib" in obs else "")
    )
    parts.append(
        f"N {stage.non_torch_bytes / GIB:.2f}"
        + (f" (obs {obs['non_torch_gib']:.2f})" if "non_torch_gib" in obs else "")
    )
    parts.append(f"G {stage.cudagraph_bytes / GIB:.2f}")
    return ", ".join(parts)


def _predict(p: Prepared, coef: Coefficients) -> MemoryPrediction:
    return predict(p.model, p.gpu, p.settings, strict=False, coefficients=coef)


def score(
    prepared: list[Prepared], coef: Coefficients = DEFAULT_COEFFICIENTS
) -> tuple[list[Case], list[str]]:
    """Predict every prepared row; cases for each observed metric, plus refused rows."""
    cases: list[Case] = []
    refused: list[str] = []
    for p in prepared:
        try:
            pred = _predict(p, coef)
        except OomguardError as exc:
            refused.append(
                f"row {p.row} {p.model.name}: prediction refused ({exc.one_line()[:100]})"
            )
            continue
        stage0 = pred.stages[0]  # the logged rank (rank 0 prints first)
        version = f"{p.settings.engine} {pred.vllm_version}"
        if "kv_cache_gib" in p.observed:
            cases.append(Case(p.row, p.source, p.model.name, version, "kv_cache_gib",
                              p.observed["kv_cache_gib"], stage0.kv_cache_bytes / GIB,
                              _why(pred, p.raw_observed)))  # fmt: skip
        if "weights_gib" in p.observed:
            cases.append(Case(p.row, p.source, p.model.name, version, "weights_gib",
                              p.observed["weights_gib"], stage0.weights_bytes / GIB,
                              pred.weights.basis))  # fmt: skip
    return cases, refused


def _stats(errs: list[float]) -> tuple[float, float]:
    errs = sorted(errs)
    median = statistics.median(errs)
    p90 = errs[min(len(errs) - 1, int(round(0.9 * (len(errs) - 1))))]
    return median, p90


# --------------------------------------------------------------------------------------------
# refitting the estimated-term coefficients (leave-one-source-out)

_Getter = Callable[[Coefficients], float]
_Setter = Callable[[Coefficients, float], Coefficients]


def _dict_param(attr: str, key: Any) -> tuple[_Getter, _Setter]:
    def get(c: Coefficients) -> float:
        return float(getattr(c, attr)[key])

    def put(c: Coefficients, v: float) -> Coefficients:
        table = dict(getattr(c, attr))
        table[key] = v
        changes: dict[str, Any] = {attr: table}
        return replace(c, **changes)

    return get, put


def _scalar_param(attr: str) -> tuple[_Getter, _Setter]:
    def get(c: Coefficients) -> float:
        return float(getattr(c, attr))

    def put(c: Coefficients, v: float) -> Coefficients:
        changes: dict[str, Any] = {attr: v}
        return replace(c, **changes)

    return get, put


# name → (getter, setter, finite-difference step, (low, high)). The bounds are physical, not
# fitted: a sampler keeps at least the fp32 logits (4 B) and at most a full sort's temporaries
# (~64 B) per logit; a gated MLP holds between 1 and 12 intermediate-sized activations per
# token; non-torch growth lies between 0 and a few GiB (NCCL buffers at TP ≤ 8).
PARAMS: dict[str, tuple[_Getter, _Setter, float, tuple[float, float]]] = {
    "sampler B/logit (pytorch)": (
        *_dict_param("sampler_bytes_per_logit", "pytorch"),
        1.0,
        (4.0, 64.0),
    ),
    "sampler B/logit (triton)": (
        *_dict_param("sampler_bytes_per_logit", "triton"),
        1.0,
        (4.0, 64.0),
    ),
    "forward intermediate factor": (
        *_scalar_param("forward_intermediate_factor"),
        0.5,
        (1.0, 12.0),
    ),
    **{
        f"non-torch GiB {g}/{k}": (*_dict_param("non_torch_gib", (g, k)), 0.1, (0.0, 4.0))
        for g in ("v0", "early", "late")
        for k in ("single", "tp", "pp")
        if (g, k) in DEFAULT_COEFFICIENTS.non_torch_gib
    },
}


def _weighted_median(values: list[float], weights: list[float]) -> float:
    pairs = sorted(zip(values, weights, strict=True))
    half, acc = sum(weights) / 2, 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


def _kv_bytes(p: Prepared, coef: Coefficients) -> float | None:
    try:
        return float(_predict(p, coef).stages[0].kv_cache_bytes)
    except OomguardError:
        return None


def sensitivities(prepared: list[Prepared]) -> dict[int, dict[str, float]]:
    """d(KV bytes)/d(coefficient) of each KV row at the built-in coefficients (finite differences)."""
    out: dict[int, dict[str, float]] = {}
    base = DEFAULT_COEFFICIENTS
    for p in prepared:
        if "kv_cache_gib" not in p.observed:
            continue
        kv0 = _kv_bytes(p, base)
        if kv0 is None:
            continue
        out[p.row] = {"_pred": kv0}
        for name, (get, put, step, _bounds) in PARAMS.items():
            kv1 = _kv_bytes(p, put(base, get(base) + step))
            if kv1 is not None and kv1 != kv0:
                out[p.row][name] = (kv1 - kv0) / step
    return out


def refit(
    train: list[Prepared], sens: dict[int, dict[str, float]]
) -> tuple[Coefficients, list[str]]:
    """Coefficients refitted on ``train`` (KV residuals, linearised); names left unrefitted.

    Each coefficient in turn takes the median of the values each informed row implies,
    weighted by the row's sensitivity (a row that barely depends on a coefficient says little
    about it), clamped to the physical bounds of :data:`PARAMS`.
    """
    coef = DEFAULT_COEFFICIENTS
    rows = [p for p in train if p.row in sens]
    # residual of each row under the current coefficients (linear model around the defaults)
    delta = {name: 0.0 for name in PARAMS}

    def residual(p: Prepared) -> float:
        s = sens[p.row]
        pred = s["_pred"] + sum(s.get(n, 0.0) * d for n, d in delta.items())
        return p.observed["kv_cache_gib"] * GIB - pred

    unrefitted: list[str] = []
    for _pass in range(2):
        for name, (get, _put, _step, (low, high)) in PARAMS.items():
            informed = [p for p in rows if abs(sens[p.row].get(name, 0.0)) > 1e-3]
            if not informed:
                if _pass == 0:
                    unrefitted.append(name)
                continue
            implied = [delta[name] + residual(p) / sens[p.row][name] for p in informed]
            raw = [abs(sens[p.row][name]) for p in informed]
            # one row must not decide a coefficient for everyone: cap each weight at three times
            # the median weight (a row priced at a huge batch has a huge sensitivity)
            cap = 3 * statistics.median(raw)
            weights = [min(w, cap) for w in raw]
            base_value = get(DEFAULT_COEFFICIENTS)
            fitted = base_value + _weighted_median(implied, weights)
            delta[name] = min(high, max(low, fitted)) - base_value
    for name, (get, put, _step, _bounds) in PARAMS.items():
        coef = put(coef, get(DEFAULT_COEFFICIENTS) + delta[name])
    return coef, unrefitted


def held_out(prepared: list[Prepared]) -> list[tuple[str, list[Case], list[str], Coefficients]]:
    """Leave-one-source-out: refit on the other sources, score the held-out one."""
    sens = sensitivities(prepared)
    folds = []
    for src in sorted({p.source for p in prepared}):
        test = [p for p in prepared if p.source == src and "kv_cache_gib" in p.observed]
        if not test:
            continue
        train = [p for p in prepared if p.source != src]
        coef, unrefitted = refit(train, sens)
        cases, _ = score(test, coef)
        used = [n for n in PARAMS if any(abs(sens.get(p.row, {}).get(n, 0.0)) > 1e-3 for p in test)]
        folds.append((src, [c for c in cases if c.metric == "kv_cache_gib"],
                      [n for n in used if n in unrefitted], coef))  # fmt: skip
    return folds


# --------------------------------------------------------------------------------------------


def _print_metric(cases: list[Case], metric: str, verbose: bool) -> bool:
    median_target, p90_target = TARGETS[metric]
    mine = [c for c in cases if c.metric == metric]
    if not mine:
        print(f"{metric}: no cases")
        return True
    median, p90 = _stats([c.rel_err_pct for c in mine])
    target = f"target median ≤ {median_target}%" + (f", p90 ≤ {p90_target}%" if p90_target else "")
    ok = median <= median_target and (p90_target is None or p90 <= p90_target)
    print(f"{metric}: n={len(mine)}  median |rel err| {median:.2f}%  p90 {p90:.2f}%  "
          f"({target}: {'met' if ok else 'NOT met'})")  # fmt: skip
    worst = sorted(mine, key=lambda c: -c.rel_err_pct)
    for c in worst[: len(mine) if verbose else 5]:
        print(f"  row {c.row:2d} {c.model[:48]:48s} {c.version:9s} obs {c.observed:7.2f} "
              f"pred {c.predicted:7.2f} ({c.rel_err_pct:5.1f}%)  {c.why}")  # fmt: skip
    print()
    return ok


def _print_per_source(cases: list[Case]) -> None:
    print("per source (in-sample coefficients):")
    print(f"  {'source':44s} {'KV n':>4s} {'median':>7s} {'p90':>7s}   {'W n':>3s} {'median':>7s}")
    for src in sorted({c.source for c in cases}):
        kv = [c.rel_err_pct for c in cases if c.source == src and c.metric == "kv_cache_gib"]
        w = [c.rel_err_pct for c in cases if c.source == src and c.metric == "weights_gib"]
        kv_txt = (
            f"{len(kv):4d} {_stats(kv)[0]:6.2f}% {_stats(kv)[1]:6.2f}%"
            if kv
            else f"{0:4d} {'-':>7s} {'-':>7s}"
        )
        w_txt = f"{len(w):3d} {_stats(w)[0]:6.2f}%" if w else f"{0:3d} {'-':>7s}"
        print(f"  {src[:44]:44s} {kv_txt}   {w_txt}")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--verbose", action="store_true", help="print every case")
    ap.add_argument("--no-holdout", action="store_true", help="skip the leave-one-source-out view")
    args = ap.parse_args(argv)
    try:
        import oomguard.facts.resolve  # noqa: F401
    except ImportError:
        print(
            "oomguard.facts.resolve is not available: cannot resolve models offline; nothing scored."
        )
        return 2
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    prepared, skipped = prepare(rows)
    cases, refused = score(prepared)
    skipped += refused
    used_rows = sorted({c.row for c in cases})
    print(f"data: {args.data}")
    print(f"rows: {len(rows)} total, {len(used_rows)} used, {len(skipped)} skipped")
    for line in skipped:
        print(f"  skipped {line}")
    print()
    print("IN-SAMPLE: the activation and non-torch coefficients were calibrated on these rows;")
    print("the per-source and leave-one-source-out views below show how far that flatters them.")
    print()
    status = 0
    for metric in TARGETS:
        status |= 0 if _print_metric(cases, metric, args.verbose) else 1
    _print_per_source(cases)
    if args.no_holdout:
        return status
    folds = held_out(prepared)
    print("leave-one-source-out (coefficients refitted without the held-out source), KV cache GiB:")
    all_errs: list[float] = []
    for src, fold_cases, unrefitted, coef in folds:
        errs = [c.rel_err_pct for c in fold_cases]
        all_errs += errs
        med, p90 = _stats(errs) if errs else (float("nan"), float("nan"))
        note = f"  [not refittable without it: {', '.join(unrefitted)}]" if unrefitted else ""
        print(f"  {src[:44]:44s} n={len(errs):2d} median {med:6.2f}% p90 {p90:6.2f}%{note}")
        if args.verbose:
            print(f"      sampler {coef.sampler_bytes_per_logit}, forward {coef.forward_intermediate_factor:.2f}, "
                  f"non-torch { {f'{g}/{k}': round(v, 3) for (g, k), v in coef.non_torch_gib.items()} }")  # fmt: skip
    if all_errs:
        med, p90 = _stats(all_errs)
        print(f"  held-out overall: n={len(all_errs)}  median |rel err| {med:.2f}%  p90 {p90:.2f}%  "
              f"(in-sample targets: median ≤ 3.0%, p90 ≤ 10.0%)")  # fmt: skip
    return status


if __name__ == "__main__":
    sys.exit(main())
