"""What the load looks like: one fixed peak shape, a length distribution, or real requests.

A workload hands out request shapes by index, deterministically: the same index gives the same
shape in every run, so a stage can be repeated and two tools can be fed the same requests.

Three ways to state it:

- ``--prompt-tokens N --max-tokens M``: every request is the peak shape (the worst case the
  operator wants proven).
- a YAML/JSON file of length distributions::

      prompt_tokens: {mean: 800, stdev: 200, min: 100, max: 2000}   # normal, clamped
      max_tokens: {min: 50, max: 400}                               # uniform
      # a number (fixed), {values: [...], weights: [...]}, or
      # {distribution: lognormal, mean: ..., stdev: ..., min: ..., max: ...}

- a JSONL file of real requests, one per line: ``{"prompt": "...", "max_tokens": 256}`` or
  ``{"prompt_tokens": 812, "max_tokens": 256}``; the lines are replayed in order, cycling.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from oomguard.documents import parse_document, read_document
from oomguard.errors import BadInput, MalformedConfig


@dataclass(frozen=True)
class RequestShape:
    """One request: prompt length, tokens to generate, and the prompt itself when replayed."""

    prompt_tokens: int  # exact for generated prompts; the file's count (or 0) for real ones
    max_tokens: int
    prompt_text: str | None = None

    @property
    def sequence_tokens(self) -> int:
        """Prompt plus output: what the request holds in KV at its end."""
        return self.prompt_tokens + self.max_tokens


class LoadProfile(Protocol):
    """Request shapes by index, and the figures the search plans with."""

    @property
    def description(self) -> str:
        """One line for tables and the report."""
        ...

    @property
    def shared_prefix_tokens(self) -> int:
        """Tokens every prompt shares at its start (0: none)."""
        ...

    def shape(self, index: int) -> RequestShape:
        """The shape of request ``index`` (deterministic)."""
        ...

    def longest_sequence_tokens(self) -> int:
        """The longest prompt + output any request of this workload can have."""
        ...

    def typical_sequence_tokens(self) -> float:
        """The mean prompt + output, which sets how many requests the pool holds at once."""
        ...


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """KV blocks ``tokens`` tokens occupy (whole blocks)."""
    return -(-max(tokens, 0) // block_size)


@dataclass(frozen=True)
class FixedWorkload:
    """Every request is the same peak shape."""

    prompt_tokens: int
    max_tokens: int
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise BadInput(
                f"--prompt-tokens {self.prompt_tokens}: must be at least 1",
                "pass the peak prompt length in tokens",
            )
        if self.max_tokens < 1:
            raise BadInput(
                f"--max-tokens {self.max_tokens}: must be at least 1",
                "pass the peak output length in tokens",
            )
        if not 0 <= self.shared_prefix_tokens < self.prompt_tokens:
            raise BadInput(
                f"--shared-prefix {self.shared_prefix_tokens} is not shorter than the prompt "
                f"({self.prompt_tokens} tokens)",
                "pass a shared prefix shorter than --prompt-tokens",
            )

    @property
    def description(self) -> str:
        """One line for tables and the report."""
        prefix = f", {self.shared_prefix_tokens} shared" if self.shared_prefix_tokens else ""
        return f"{self.prompt_tokens} prompt tokens{prefix} + {self.max_tokens} generated"

    def shape(self, index: int) -> RequestShape:
        """The peak shape, whatever the index."""
        return RequestShape(self.prompt_tokens, self.max_tokens)

    def longest_sequence_tokens(self) -> int:
        """Prompt + output of the peak shape."""
        return self.prompt_tokens + self.max_tokens

    def typical_sequence_tokens(self) -> float:
        """Prompt + output of the peak shape."""
        return float(self.prompt_tokens + self.max_tokens)


@dataclass(frozen=True)
class LengthDistribution:
    """A token-length distribution: fixed, uniform, normal, lognormal or weighted values."""

    kind: str  # "fixed", "uniform", "normal", "lognormal", "values"
    low: int
    high: int
    mean: float = 0.0
    stdev: float = 0.0
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def sample(self, rng: random.Random) -> int:
        """One length, clamped to [low, high]."""
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        if self.kind == "values":
            return rng.choices(self.values, weights=self.weights or None)[0]
        if self.kind == "normal":
            value = rng.gauss(self.mean, self.stdev)
        else:  # lognormal with the given mean and stdev of the lengths themselves
            sigma2 = math.log(1 + (self.stdev / self.mean) ** 2)
            value = rng.lognormvariate(math.log(self.mean) - sigma2 / 2, math.sqrt(sigma2))
        return int(min(max(round(value), self.low), self.high))

    def expected(self) -> float:
        """The mean length (clamping ignored for normal and lognormal)."""
        if self.kind in ("fixed",):
            return float(self.low)
        if self.kind == "uniform":
            return (self.low + self.high) / 2
        if self.kind == "values":
            weights = self.weights or tuple(1.0 for _ in self.values)
            return sum(v * w for v, w in zip(self.values, weights, strict=True)) / sum(weights)
        return min(max(self.mean, self.low), self.high)

    def describe(self) -> str:
        """Short text for tables."""
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"uniform {self.low}-{self.high}"
        if self.kind == "values":
            return "one of " + "/".join(str(v) for v in self.values)
        return f"{self.kind} {self.mean:g}±{self.stdev:g} in [{self.low}, {self.high}]"


def parse_distribution(value: Any, field: str, source: str) -> LengthDistribution:
    """A :class:`LengthDistribution` from a workload file's entry (see the module docstring)."""

    def bad(why: str) -> BadInput:
        return MalformedConfig(
            f"{source}: {field} {why}",
            "write a number, {min, max}, {mean, stdev, min, max} or {values: [...]}",
        )

    if isinstance(value, bool):
        raise bad("must be a number of tokens or a mapping")
    if isinstance(value, int | float):
        if value < 1 or value != int(value):
            raise bad(f"{value} is not a positive whole number of tokens")
        return LengthDistribution("fixed", int(value), int(value))
    if not isinstance(value, dict):
        raise bad("must be a number of tokens or a mapping")
    known = {"distribution", "mean", "stdev", "min", "max", "values", "weights"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise bad(f"has unknown key(s) {', '.join(unknown)}")
    try:
        if "values" in value:
            values = tuple(int(v) for v in value["values"])
            weights = tuple(float(w) for w in value.get("weights") or ())
            if not values or min(values) < 1 or (weights and len(weights) != len(values)):
                raise bad("values must be positive and weights, if given, one per value")
            return LengthDistribution(
                "values", min(values), max(values), values=values, weights=weights
            )
        low = int(value.get("min", 1))
        high = int(value.get("max", 0)) or None
        if "mean" in value:
            mean = float(value["mean"])
            stdev = float(value.get("stdev", 0.0))
            kind = str(value.get("distribution", "normal")).lower()
            if kind not in ("normal", "lognormal"):
                raise bad(f"distribution {kind!r} is not normal or lognormal")
            if mean < 1 or stdev < 0:
                raise bad("needs mean >= 1 and stdev >= 0")
            top = high if high is not None else int(mean + 4 * stdev) + 1
            if stdev == 0:
                return LengthDistribution("fixed", int(mean), int(mean))
            return LengthDistribution(kind, max(low, 1), top, mean=mean, stdev=stdev)
        if high is None:
            raise bad("needs max (and optionally min) or mean")
        if not 1 <= low <= high:
            raise bad(f"needs 1 <= min <= max (got {low}, {high})")
        return LengthDistribution("uniform", low, high)
    except (TypeError, ValueError):
        raise bad("has a value that is not a number") from None


@dataclass(frozen=True)
class DistributionWorkload:
    """Prompt and output lengths drawn from distributions (seeded per request index)."""

    prompt: LengthDistribution
    output: LengthDistribution
    seed: int = 0
    shared_prefix_tokens: int = 0
    source: str = ""

    @property
    def description(self) -> str:
        """One line for tables and the report."""
        return f"prompt {self.prompt.describe()} + output {self.output.describe()} tokens"

    def shape(self, index: int) -> RequestShape:
        """Lengths drawn for ``index`` (the same in every run)."""
        rng = random.Random(f"{self.seed}:{index}")
        prompt = max(self.prompt.sample(rng), self.shared_prefix_tokens + 1)
        return RequestShape(prompt, self.output.sample(rng))

    def longest_sequence_tokens(self) -> int:
        """The largest prompt + the largest output the distributions allow."""
        return self.prompt.high + self.output.high

    def typical_sequence_tokens(self) -> float:
        """Mean prompt + mean output."""
        return self.prompt.expected() + self.output.expected()


@dataclass(frozen=True)
class ReplayWorkload:
    """Real requests from a JSONL file, replayed in order (cycling)."""

    requests: tuple[RequestShape, ...]
    source: str = ""
    shared_prefix_tokens: int = 0

    @property
    def description(self) -> str:
        """One line for tables and the report."""
        return f"{len(self.requests)} requests replayed from {Path(self.source).name}"

    def shape(self, index: int) -> RequestShape:
        """Line ``index`` modulo the file's length."""
        return self.requests[index % len(self.requests)]

    def longest_sequence_tokens(self) -> int:
        """The longest known prompt + output (prompt texts count once measured)."""
        return max(r.sequence_tokens for r in self.requests)

    def typical_sequence_tokens(self) -> float:
        """Mean prompt + output of the file's requests."""
        return sum(r.sequence_tokens for r in self.requests) / len(self.requests)


def load_workload(path: Path, *, default_max_tokens: int | None, seed: int = 0) -> LoadProfile:
    """Read a workload file: ``.jsonl`` replays real requests, YAML/JSON states distributions.

    Raises :class:`MalformedConfig` naming the line or field that is wrong.
    """
    text = read_document(path, "workload", "check the path")
    if path.suffix.lower() == ".jsonl":
        return _replay_from_jsonl(text, str(path), default_max_tokens)
    data = parse_document(
        text, f"workload {path}", "fix the syntax (see `oomguard bench --help`)", yaml=True
    )
    if not isinstance(data, dict) or "prompt_tokens" not in data:
        raise MalformedConfig(
            f"workload {path} must be a mapping with prompt_tokens and max_tokens",
            "e.g. `prompt_tokens: {mean: 800, stdev: 200, max: 2000}` and `max_tokens: 256`",
        )
    unknown = sorted(set(data) - {"prompt_tokens", "max_tokens", "shared_prefix_tokens", "seed"})
    if unknown:
        raise MalformedConfig(
            f"workload {path} has unknown key(s): {', '.join(unknown)}",
            "use prompt_tokens, max_tokens, shared_prefix_tokens and seed",
        )
    output_spec = data.get("max_tokens", default_max_tokens)
    if output_spec is None:
        raise MalformedConfig(
            f"workload {path} has no max_tokens", "add `max_tokens:` or pass --max-tokens"
        )
    prompt = parse_distribution(data["prompt_tokens"], "prompt_tokens", str(path))
    output = parse_distribution(output_spec, "max_tokens", str(path))
    shared = int(data.get("shared_prefix_tokens") or 0)
    if shared >= prompt.low:
        raise MalformedConfig(
            f"workload {path}: shared_prefix_tokens {shared} is not shorter than the shortest "
            f"prompt ({prompt.low})",
            "lower shared_prefix_tokens or raise prompt_tokens' min",
        )
    return DistributionWorkload(prompt, output, int(data.get("seed", seed)), shared, str(path))


def _replay_from_jsonl(text: str, source: str, default_max_tokens: int | None) -> ReplayWorkload:
    shapes: list[RequestShape] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise MalformedConfig(
                f"{where} is not JSON ({exc.msg})", "one JSON object per line"
            ) from None
        if not isinstance(row, dict):
            raise MalformedConfig(f"{where} is not a JSON object", "one JSON object per line")
        shapes.append(_shape_from_row(row, where, default_max_tokens))
    if not shapes:
        raise MalformedConfig(f"{source} holds no request", "one JSON object per line")
    return ReplayWorkload(tuple(shapes), source)


def _shape_from_row(
    row: dict[str, Any], where: str, default_max_tokens: int | None
) -> RequestShape:
    if "messages" in row and "prompt" not in row:
        raise MalformedConfig(
            f"{where} is a chat request (messages)",
            "give the rendered prompt as `prompt`, or its length as `prompt_tokens`",
        )
    max_tokens = row.get("max_tokens", row.get("output_tokens", default_max_tokens))
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise MalformedConfig(
            f"{where} has no positive max_tokens",
            "add `max_tokens` to the line or pass --max-tokens",
        )
    prompt = row.get("prompt")
    if isinstance(prompt, str) and prompt:
        count = row.get("prompt_tokens")
        return RequestShape(int(count) if isinstance(count, int) else 0, max_tokens, prompt)
    count = row.get("prompt_tokens")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise MalformedConfig(
            f"{where} has neither a prompt text nor a positive prompt_tokens",
            "give `prompt` (text) or `prompt_tokens` (a length)",
        )
    return RequestShape(count, max_tokens)


def describe_lengths(shapes: Sequence[RequestShape]) -> dict[str, float]:
    """p50/p99/max of prompt and sequence lengths of ``shapes`` (for the report)."""
    if not shapes:
        return {}
    prompts = sorted(s.prompt_tokens for s in shapes)
    seqs = sorted(s.sequence_tokens for s in shapes)

    def pick(values: list[int], q: float) -> float:
        return float(values[min(len(values) - 1, int(q * len(values)))])

    return {
        "prompt_p50": pick(prompts, 0.5),
        "prompt_p99": pick(prompts, 0.99),
        "sequence_p50": pick(seqs, 0.5),
        "sequence_p99": pick(seqs, 0.99),
        "sequence_max": float(seqs[-1]),
    }
