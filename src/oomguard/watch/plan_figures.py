"""The figures of a plan that a running server is compared with.

A plan is the JSON object of ``oomguard plan … --json`` (a file, ``--plan FILE``) or the same
object computed on the spot from ``--model`` and plan flags. The watcher needs only a few of
its figures: the KV pool in tokens, and per GPU the budget vLLM may hold
(``gpu_memory_utilization × total``) with its parts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomguard.errors import BadInput
from oomguard.units import GIB

_HOW = "write it with: oomguard plan MODEL --gpu GPU … --json > plan.json"


@dataclass(frozen=True)
class PlanFigures:
    """What the plan says one server will hold. Byte figures are per GPU."""

    source: str  # the file, or "--model NAME"
    model: str
    gpu_name: str
    gpu_count: int
    gpu_total_bytes: int
    requested_bytes: int  # gpu_memory_utilization × total: vLLM's whole budget on one GPU
    weights_bytes: int
    kv_cache_bytes: int
    kv_cache_tokens: int
    gpu_memory_utilization: float | None
    max_num_seqs: int | None
    max_model_len: int | None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON output."""
        return {
            "source": self.source,
            "model": self.model,
            "gpu": self.gpu_name,
            "gpu_count": self.gpu_count,
            "gpu_total_gib": round(self.gpu_total_bytes / GIB, 2),
            "requested_gib": round(self.requested_bytes / GIB, 2),
            "weights_gib": round(self.weights_bytes / GIB, 2),
            "kv_cache_gib": round(self.kv_cache_bytes / GIB, 2),
            "kv_cache_tokens": self.kv_cache_tokens,
        }


def _number(data: dict[str, Any], path: str, source: str) -> float:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise BadInput(f"plan {source} has no {path}", f"it is not a plan's JSON; {_HOW}")
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise BadInput(f"plan {source}: {path} is {node!r}, not a number", _HOW)
    return float(node)


def figures_from_plan_dict(data: object, source: str) -> PlanFigures:
    """The figures of a plan object (the JSON of ``oomguard plan --json``)."""
    if not isinstance(data, dict):
        raise BadInput(f"plan {source} is not a JSON object", _HOW)
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else {}
    assert isinstance(settings, dict)
    gpu = data.get("gpu") if isinstance(data.get("gpu"), dict) else {}
    assert isinstance(gpu, dict)

    def optional_int(name: str) -> int | None:
        value = settings.get(name)
        return (
            int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        )

    util = settings.get("gpu_memory_utilization")
    return PlanFigures(
        source=source,
        model=str(data.get("model", "?")),
        gpu_name=str(gpu.get("name", "?")),
        gpu_count=int(_number(data, "gpu.count", source)),
        gpu_total_bytes=round(_number(data, "memory.total_gib", source) * GIB),
        requested_bytes=round(_number(data, "memory.requested_gib", source) * GIB),
        weights_bytes=round(_number(data, "memory.weights_gib", source) * GIB),
        kv_cache_bytes=round(_number(data, "memory.kv_cache_gib", source) * GIB),
        kv_cache_tokens=int(_number(data, "kv_cache_tokens", source)),
        gpu_memory_utilization=float(util) if isinstance(util, (int, float)) else None,
        max_num_seqs=optional_int("max_num_seqs"),
        max_model_len=optional_int("max_model_len"),
    )


def load_plan_file(path: Path) -> PlanFigures:
    """Read a plan file; a file that is missing or does not parse is one clear BadInput."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise BadInput(f"cannot read plan file {path}: {exc.strerror or exc}", _HOW) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"plan file {path} is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            _HOW,
        ) from exc
    return figures_from_plan_dict(data, str(path))


def plan_from_flags(plan_args: list[str]) -> PlanFigures:
    """Run ``oomguard plan ARGS --json`` in this process and read its figures.

    The plan command parses and checks its own flags, so ``--model`` with plan flags behaves
    exactly like ``oomguard plan``: a bad flag is the same one-line error.
    """
    import contextlib
    import io

    from oomguard.cli import build_app

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            build_app("plan")(
                args=["plan", *plan_args, "--json"], prog_name="oomguard", standalone_mode=False
            )
    except SystemExit:
        pass  # the plan command exits 0 (fits) or 1 (does not fit); both print the plan
    except Exception as exc:
        if hasattr(exc, "format_message"):  # the argument parser's usage error
            raise BadInput(
                f"plan flags: {exc.format_message()}", "see oomguard plan --help"
            ) from exc
        raise
    try:
        data = json.loads(out.getvalue())
    except json.JSONDecodeError as exc:
        raise BadInput(
            "the plan printed no JSON", "check the plan flags with oomguard plan"
        ) from exc
    return figures_from_plan_dict(data, f"--model {plan_args[0] if plan_args else '?'}")
