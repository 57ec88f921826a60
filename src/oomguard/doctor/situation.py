"""The numbers a diagnosis reasons with: what the log states, what the user told us, and what
model and GPU facts add — each marked with where it came from."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from oomguard.logs.parsed import Evidence, ParsedLog
from oomguard.logs.parser import ARG_FIELDS
from oomguard.units import GIB


@dataclass(frozen=True)
class Context:
    """What the user knows that the log may not say."""

    model: str | None = None
    gpu: str | None = None
    command: str | None = None  # the original ``vllm serve …`` line
    args: dict[str, Any] = field(default_factory=dict)  # extra settings (underscore names)
    expect_cotenant: bool = False  # another workload is meant to share the GPU
    free_gib: float | None = None  # memory free on the device now, when measured (serve)


@dataclass(frozen=True)
class Known:
    """A number with its origin: ``log`` (evidence line), ``command``, ``facts``, ``default``,
    ``name`` (estimated from a model name) or ``said`` (stated in prose, not a log line)."""

    value: Any
    origin: str
    evidence: Evidence | None = None

    @property
    def stated(self) -> bool:
        return self.origin in ("log", "command")


@dataclass
class Situation:
    """Everything the rules read. Missing numbers are simply absent (never guessed silently)."""

    parsed: ParsedLog
    context: Context
    values: dict[str, Known] = field(default_factory=dict)
    model_spec: Any = None  # ModelSpec when the model resolved offline
    gpu_spec: Any = None  # GPUSpec when the GPU resolved

    def get(self, name: str) -> Any:
        known = self.values.get(name)
        return known.value if known is not None else None

    def known(self, name: str) -> Known | None:
        return self.values.get(name)

    def set(self, name: str, value: Any, origin: str, evidence: Evidence | None = None) -> None:
        if value is None or name in self.values:
            return
        self.values[name] = Known(value, origin, evidence)

    # --- derived quantities --------------------------------------------------------------
    @property
    def total_gib(self) -> float | None:
        return self.get("gpu_total_gib")

    @property
    def tp(self) -> int:
        return int(self.get("tensor_parallel_size") or 1)

    @property
    def util(self) -> float | None:
        return self.get("gpu_memory_utilization")

    @property
    def util_stated(self) -> bool:
        """Whether the user set the utilization (the log, the command, or the text says so)."""
        known = self.known("gpu_memory_utilization")
        return known is not None and (known.stated or known.origin == "said")

    @property
    def block_size(self) -> int:
        size = self.get("block_size")
        if size:
            return int(size)
        return 128 if self.get("platform") == "cpu" else 16

    @property
    def sleep_mode(self) -> bool:
        return (
            self.parsed.has("sleep_mode")
            or self.parsed.has("cumem_allocator")
            or bool(self.context.args.get("enable_sleep_mode"))
        )

    @property
    def weights_per_gpu_gib(self) -> Known | None:
        return self.known("weights_per_gpu_gib")


_GPU_TOTAL_IN_TEXT = re.compile(r"(\d+(?:\.\d+)?)\s?GiB")
_GPU_GB_IN_TEXT = re.compile(r"(\d+(?:\.\d+)?)\s?GB\b", re.IGNORECASE)
_GPU_COUNT_IN_TEXT = re.compile(r"^\s*(\d+)\s?[x×]\s?", re.IGNORECASE)
# a count elsewhere in the text: "(4x A10G 24GB)", "80GB*2", "8 GPUs"; not "g5.12xlarge"
_GPU_COUNT_ANYWHERE = re.compile(
    r"(?<![\w.])(\d{1,2})\s?[x×]\s?(?=[A-Z])|(?<=\d)\s?G(?:i?B)?\s?[*x×]\s?(\d{1,2})\b"
    r"|(?<![\w.])(\d{1,2})\s+GPUs\b"
)
_MULTI_GPU_WORDS = re.compile(r"(?i)\bmulti-?GPU\b|\bGPUs\b")
_PARAMS_IN_NAME = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?)\s?[bB](?![a-zA-Z])")
_ACTIVE_PARAMS = re.compile(r"-A\d+(?:\.\d+)?[bB]\b")


def _default_util(version: str | None) -> float:
    """vLLM's default gpu_memory_utilization: 0.9 up to 0.19, 0.92 since 0.20 (§3.1)."""
    if version:
        m = re.match(r"v?0\.(\d+)", version)
        if m and int(m.group(1)) >= 20:
            return 0.92
    return 0.9


def estimate_weights_from_name(name: str) -> tuple[float, str] | None:
    """A rough checkpoint size from a model name (``Llama-2-13b`` → 13e9 × 2 bytes).

    Used only when the model is not in the catalogue; returns (GiB, basis) or None. Reads
    the parameter count ("70B", "7b", "1.5B"; MoE "-A3B" active counts are ignored) and the
    precision from quantization words in the name (AWQ/GPTQ/INT4/4bit → ~0.56 bytes,
    FP8/INT8/8bit → ~1.03 bytes, else 2 bytes).
    """
    cleaned = _ACTIVE_PARAMS.sub("", name)
    counts = [float(m.group(1)) for m in _PARAMS_IN_NAME.finditer(cleaned)]
    counts = [c for c in counts if 0.05 <= c <= 2000]
    if not counts:
        return None
    params_b = max(counts)
    low = name.lower()
    if re.search(r"awq|gptq|int4|4bit|4-bit|w4a16|nf4|q4|mxfp4|nvfp4|autoround", low):
        bytes_per, label = 0.56, "4-bit"
    elif re.search(r"fp8|int8|8bit|8-bit|w8a8|w8a16|q8", low):
        bytes_per, label = 1.03, "8-bit"
    else:
        bytes_per, label = 2.0, "16-bit"
    gib = params_b * 1e9 * bytes_per / GIB
    return gib, f"{params_b:g}B parameters at {label} (from the name)"


def _parse_gpu_text(text: str) -> tuple[float | None, int, str]:
    """Total GiB, count and name from text like ``2x V100 16GB`` or ``A100 80GB (79.35 GiB)``."""
    count = 1
    m = _GPU_COUNT_IN_TEXT.match(text)
    if m:
        count = int(m.group(1))
        text = text[m.end() :]
    else:
        anywhere = _GPU_COUNT_ANYWHERE.search(text)
        if anywhere:
            count = int(next(g for g in anywhere.groups() if g))
        elif _MULTI_GPU_WORDS.search(text):
            count = 2  # "multi-GPU", "80GB GPUs": several, at least two
    total = None
    g = _GPU_TOTAL_IN_TEXT.search(text)
    if g:
        total = float(g.group(1))
    else:
        gb = _GPU_GB_IN_TEXT.search(text)
        if gb:
            # CUDA reports a little less than the marketing size (80 GB → 79.2 GiB)
            total = float(gb.group(1)) * 0.985
    return total, count, text.strip()


def build_situation(parsed: ParsedLog, context: Context) -> Situation:
    """Merge the log, the user's context and offline model/GPU facts into one Situation.

    The log wins over the command line (it is what actually ran); the command line wins over
    facts; facts over defaults. Never raises on unknown models or GPUs: the fact is skipped.
    """
    s = Situation(parsed=parsed, context=context)
    for name, obs in parsed.fields.items():
        s.set(name, obs.value, "log", obs.evidence)
    _add_command(s, context)
    _add_gpu(s, context, parsed)
    _add_utilization(s, parsed)
    _add_weights(s, parsed)
    return s


_INT_SETTINGS = (
    "tensor_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
)
_FLOAT_SETTINGS = ("gpu_memory_utilization", "cpu_offload_gib", "swap_space_gib")


def _add_command(s: Situation, context: Context) -> None:
    """The settings the user's command line and arguments state."""
    ctx_args = dict(context.args)
    if context.command:
        from oomguard.logs.parser import command_args

        ctx_args = {**command_args(context.command), **ctx_args}
    arg_map = {**ARG_FIELDS, "enable_prefix_caching": "enable_prefix_caching"}
    for key, value in ctx_args.items():
        target = arg_map.get(key)
        if target is None or value is None:
            continue
        try:
            if target in _INT_SETTINGS:
                value = int(value)
            elif target in _FLOAT_SETTINGS:
                value = float(value)
        except (TypeError, ValueError):
            continue
        s.set(target, value, "command")
    if context.model:
        s.set("model", context.model, "command")
    if ctx_args.get("limit_mm_per_prompt"):
        s.set("mm_limits", ctx_args["limit_mm_per_prompt"], "command")
    s.context.args.update({k: v for k, v in ctx_args.items() if k not in s.context.args})


def _add_gpu(s: Situation, context: Context, parsed: ParsedLog) -> None:
    """The device: the user's --gpu, else the log's GPU name, else a GPU named in the text."""
    if context.gpu:
        total, count, name = _parse_gpu_text(context.gpu)
        gpu_spec = _resolve_gpu(name)
        if gpu_spec is not None:
            s.gpu_spec = gpu_spec
            s.set("gpu_total_gib", gpu_spec.total_bytes / GIB, "facts")
        if total is not None:
            s.set("gpu_total_gib", total, "command")
        if count > 1:
            s.set("gpu_count", count, "command")
        s.set("gpu_name", name, "command")
    elif s.get("gpu_name"):
        gpu_spec = _resolve_gpu(str(s.get("gpu_name")))
        if gpu_spec is not None:
            s.gpu_spec = gpu_spec
            s.set("gpu_total_gib", gpu_spec.total_bytes / GIB, "facts")
    elif parsed.get("said_gpu_name"):
        # a GPU named in the text ("8 A100-40Gs", "8xNVIDIA-H200"): weaker than a log line
        said = parsed.evidence("said_gpu_name")
        count_said = parsed.get("said_gpu_count")
        total, _count, name = _parse_gpu_text(str(parsed.get("said_gpu_name")))
        gpu_spec = _resolve_gpu(name)
        if gpu_spec is not None and total is None:
            s.gpu_spec = gpu_spec
            s.set("gpu_total_gib", gpu_spec.total_bytes / GIB, "facts", said)
        if total is not None:
            s.set("gpu_total_gib", total, "said", said)
        if count_said:
            s.set("gpu_count", int(count_said), "said", said)
        s.set("gpu_name", name, "said", said)


def _add_utilization(s: Situation, parsed: ParsedLog) -> None:
    """The utilization in force: stated, else said in the text, else vLLM's default."""
    if s.known("gpu_memory_utilization") is None and parsed.get("said_util") is not None:
        # a utilization the text states ("--gpu-memory-utilization 0.5", "set it to 1.0")
        s.set(
            "gpu_memory_utilization", parsed.get("said_util"), "said", parsed.evidence("said_util")
        )
    if s.known("gpu_memory_utilization") is None:
        s.set("gpu_memory_utilization", _default_util(s.get("vllm_version")), "default")


def _add_weights(s: Situation, parsed: ParsedLog) -> None:
    """Weights per GPU: observed, else model facts, else the model's name, else the text."""
    weights = s.known("weights_gib")
    if weights is not None:
        s.set("weights_per_gpu_gib", weights.value, weights.origin, weights.evidence)
    model = s.get("model")
    if model:
        spec = _resolve_model(str(model))
        if spec is None and s.context.model and s.context.model != model:
            # the log's model is a path from another machine: the user's --model is here
            spec = _resolve_model(s.context.model)
        if spec is not None:
            s.model_spec = spec
            weights_total = _weights_from_spec(spec, s)
            if weights_total is not None:
                s.set("weights_total_gib", weights_total, "facts")
                s.set("weights_per_gpu_gib", weights_total / s.tp, "facts")
        if "weights_per_gpu_gib" not in s.values:
            estimate = estimate_weights_from_name(str(model))
            if estimate is not None:
                s.set("weights_total_gib", estimate[0], "name")
                s.set("weights_per_gpu_gib", estimate[0] / s.tp, "name")
    if "weights_per_gpu_gib" not in s.values and parsed.get("said_weights_gib") is not None:
        # the writer's own figure ("the model is only 1.6G"): the checkpoint's size
        said_w = float(parsed.get("said_weights_gib"))
        s.set("weights_total_gib", said_w, "said", parsed.evidence("said_weights_gib"))
        s.set("weights_per_gpu_gib", said_w / s.tp, "said", parsed.evidence("said_weights_gib"))
    if "weights_total_gib" not in s.values and weights is not None:
        s.set("weights_total_gib", weights.value * s.tp, weights.origin, weights.evidence)


def _resolve_gpu(name: str) -> Any:
    try:
        from oomguard.facts.gpus import find_gpu

        return find_gpu(name)
    except Exception:  # unknown GPU names and a facts module still in the works both mean "no fact"
        return None


def _resolve_model(ref: str) -> Any:
    try:
        from oomguard.facts.resolve import resolve_model
    except ImportError:
        return None
    for name in (ref, _name_in_path(ref)):
        if not name:
            continue
        try:
            return resolve_model(name, allow_hub=False)
        except Exception:  # not catalogued offline: try the path's model name, then the name
            continue
    return None


_HEX_DIR = re.compile(r"[0-9a-f]{20,}")


def _name_in_path(ref: str) -> str | None:
    """The model name inside a path from another machine: the hub cache's
    ``models--Org--Name`` directory, else the last directory that is not a snapshot hash or a
    ``checkpoint-N`` folder (``/data/qwen2.5/Qwen2.5-VL-7B-Instruct`` → that last part)."""
    if "/" not in ref and "\\" not in ref:
        return None
    parts = [p for p in re.split(r"[/\\]+", ref.strip()) if p]
    for part in parts:
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/")
    for part in reversed(parts):
        if _HEX_DIR.fullmatch(part) or re.fullmatch(
            r"(?:checkpoint|step|global_step)[-_]?\d+", part
        ):
            continue
        if part in ("snapshots", "merged", "final", "hf", "model"):
            continue
        return part
    return None


def _weights_from_spec(spec: Any, s: Situation) -> float | None:
    try:
        from oomguard.memory.weights import resolve_model_dtype, weight_bytes_per_stage

        dtype = resolve_model_dtype(spec, str(s.get("dtype") or "auto"))
        breakdown = weight_bytes_per_stage(
            spec, model_dtype=dtype, tp=1, quantization=s.get("quantization")
        )
        return float(breakdown.max_bytes) / GIB
    except Exception:  # weights of exotic formats: leave to the log or the name
        return None


# --- arithmetic shared by the rules -------------------------------------------------------------


def floor2(x: float) -> float:
    """Round down to two decimals (a utilization that never exceeds its bound)."""
    return math.floor(x * 100 + 1e-9) / 100


def ceil2(x: float) -> float:
    """Round up to two decimals."""
    return math.ceil(x * 100 - 1e-9) / 100


def nice_max_model_len(capacity_tokens: int, block_size: int) -> int:
    """A max_model_len safely below ``capacity_tokens``: keep ≥1 % margin, stay a multiple of
    the block size, and prefer a round number (7,344 → 7,200) when it costs ≤ 5 %."""
    if capacity_tokens <= block_size:
        return max(capacity_tokens, 1)
    ceiling = int(capacity_tokens * 0.99)
    floor_ok = capacity_tokens * 0.95
    best = (ceiling // block_size) * block_size
    rounded = [
        (ceiling // step) * step
        for step in (math.lcm(r, block_size) for r in (1000, 512, 400, 256, 128, 100))
    ]
    good = [c for c in rounded if c >= floor_ok and c > 0]
    return max(good) if good else max(best, block_size)
