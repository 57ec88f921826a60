"""Score the memory model against real vLLM startup logs.

For every usable row of the startup-log data set (observed "Available KV cache memory" and/or
"Model loading took"), resolve the model offline, rebuild the engine settings the log ran with,
predict, and print count, median and p90 absolute relative error of KV-cache GiB and weights GiB,
plus the five worst cases with the terms that explain them.

Usage: python bench/planner_accuracy.py [--data PATH] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from oomguard.errors import OomguardError
from oomguard.memory.engine import EngineSettings, MemoryPrediction, predict
from oomguard.memory.spec import GPUSpec, ModelSpec
from oomguard.memory.versions import parse_version

GIB = 2**30
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "vllm-startup-logs.jsonl"
TARGETS = {"kv_cache_gib": (3.0, 10.0), "weights_gib": (1.5, None)}

# compute capability by GPU family, for block sizes and bf16 support (public NVIDIA specs)
_CAPABILITY = (("b200", "10.0"), ("h100", "9.0"), ("h200", "9.0"), ("h20", "9.0"), ("a100", "8.0"),
               ("l40s", "8.9"), ("l4", "8.9"), ("4090", "8.9"), ("3090", "8.6"), ("a6000", "8.6"),
               ("a10", "8.6"), ("t4", "7.5"), ("v100", "7.0"))  # fmt: skip


@dataclass
class Case:
    row: int
    model: str
    version: str
    metric: str
    observed: float
    predicted: float
    why: str

    @property
    def rel_err_pct(self) -> float:
        return abs(self.predicted - self.observed) / abs(self.observed) * 100


def _capability(name: str) -> str:
    low = name.lower()
    for key, cc in _CAPABILITY:
        if key in low:
            return cc
    return ""


def _gpu(row: dict) -> GPUSpec:
    name = row.get("gpu") or "unknown GPU"
    if row.get("gpu_total_gib"):
        return GPUSpec(
            name=name,
            total_bytes=int(row["gpu_total_gib"] * GIB),
            marketing_gb=0,
            compute_capability=_capability(name),
            device_name=name.lower(),
        )
    from oomguard.facts.gpus import resolve_gpu

    return resolve_gpu(name)


def _settings(row: dict) -> EngineSettings:
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
    quant = row.get("quantization")
    online = "fp8" if quant == "fp8" else None
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
        quantization=online,
        enforce_eager=bool(row.get("enforce_eager")),
        block_size=row.get("block_size"),
        enable_prefix_caching=row.get("enable_prefix_caching"),
    )


def _model(ref: str) -> ModelSpec:
    from oomguard.facts.resolve import resolve_model

    return resolve_model(ref, allow_hub=False)


def _why(p: MemoryPrediction, obs: dict, metric: str) -> str:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--verbose", action="store_true", help="print every case")
    args = ap.parse_args(argv)
    try:
        import oomguard.facts.resolve  # noqa: F401
    except ImportError:
        print(
            "oomguard.facts.resolve is not available yet: cannot resolve models offline; nothing scored."
        )
        return 2
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    cases: list[Case] = []
    skipped: list[str] = []
    for i, row in enumerate(rows):
        obs = row.get("observed") or {}
        wanted = {k: obs[k] for k in ("kv_cache_gib", "weights_gib") if obs.get(k) is not None}
        if obs.get("kv_cache_gib") is not None and obs["kv_cache_gib"] <= 0:
            wanted.pop("kv_cache_gib")  # a failed start: no budget to compare
        if not wanted:
            skipped.append(f"row {i} {row['model']}: no observed KV cache or weights GiB")
            continue
        try:
            settings = _settings(row)
        except (ValueError, OomguardError) as exc:
            msg = exc.one_line() if isinstance(exc, OomguardError) else str(exc)
            skipped.append(f"row {i} {row['model']}: settings not usable ({msg})")
            continue
        try:
            model = _model(row["model"])
        except OomguardError as exc:
            skipped.append(
                f"row {i} {row['model']}: model not resolvable offline ({exc.message[:90]})"
            )
            continue
        try:
            gpu = _gpu(row)
        except (ImportError, OomguardError) as exc:
            skipped.append(
                f"row {i} {row['model']}: GPU {row.get('gpu')!r} unknown and no total given ({exc})"
            )
            continue
        try:
            pred = predict(model, gpu, settings, strict=False)
        except OomguardError as exc:
            skipped.append(f"row {i} {row['model']}: prediction refused ({exc.one_line()[:100]})")
            continue
        stage0 = pred.stages[0]  # the logged rank (rank 0 prints first)
        version = f"{settings.engine} {pred.vllm_version}"
        why = _why(pred, obs, "")
        if "kv_cache_gib" in wanted:
            cases.append(
                Case(
                    i,
                    row["model"],
                    version,
                    "kv_cache_gib",
                    wanted["kv_cache_gib"],
                    stage0.kv_cache_bytes / GIB,
                    why,
                )
            )
        if "weights_gib" in wanted:
            cases.append(
                Case(
                    i,
                    row["model"],
                    version,
                    "weights_gib",
                    wanted["weights_gib"],
                    stage0.weights_bytes / GIB,
                    pred.weights.basis,
                )
            )
    used_rows = sorted({c.row for c in cases})
    print(f"data: {args.data}")
    print(f"rows: {len(rows)} total, {len(used_rows)} used, {len(skipped)} skipped")
    for line in skipped:
        print(f"  skipped {line}")
    print()
    status = 0
    for metric, (median_target, p90_target) in TARGETS.items():
        mine = [c for c in cases if c.metric == metric]
        if not mine:
            print(f"{metric}: no cases")
            continue
        errs = sorted(c.rel_err_pct for c in mine)
        median = statistics.median(errs)
        p90 = errs[min(len(errs) - 1, int(round(0.9 * (len(errs) - 1))))]
        target = f"target median ≤ {median_target}%" + (
            f", p90 ≤ {p90_target}%" if p90_target else ""
        )
        ok = median <= median_target and (p90_target is None or p90 <= p90_target)
        status |= 0 if ok else 1
        print(
            f"{metric}: n={len(mine)}  median |rel err| {median:.2f}%  p90 {p90:.2f}%  ({target}: {'met' if ok else 'NOT met'})"
        )
        worst = sorted(mine, key=lambda c: -c.rel_err_pct)
        for c in worst[: len(mine) if args.verbose else 5]:
            print(
                f"  row {c.row:2d} {c.model[:48]:48s} {c.version:9s} obs {c.observed:7.2f} pred {c.predicted:7.2f} "
                f"({c.rel_err_pct:5.1f}%)  {c.why}"
            )
        print()
    return status


if __name__ == "__main__":
    sys.exit(main())
