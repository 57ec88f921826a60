"""vLLM's CUDA-graph settings as they reach the memory profiler (§2.6, §14.4).

``--compilation-config`` (JSON), ``--cudagraph-capture-sizes`` and
``--max-cudagraph-capture-size`` decide whether graphs are captured at all (``cudagraph_mode``)
and how many sizes are captured, which is what the CUDA-graph estimate scales with. Facts from
vllm 0.32: ``config/compilation.py`` (``CUDAGraphMode``, the Mamba block check),
``config/vllm.py`` (``_set_cudagraph_sizes``), ``engine/arg_utils.py`` (the two top-level
flags are mutually exclusive with the same keys inside ``--compilation-config``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from oomguard.errors import BadInput

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
DEFAULT_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"  # vllm 0.32 V1 default without enforce_eager


@dataclass(frozen=True)
class GraphSettings:
    """The CUDA-graph choices the settings make (None: vLLM's default)."""

    mode: str | None = None
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int | None = None

    @property
    def captures(self) -> bool:
        """Whether any graph is captured (``cudagraph_mode`` other than NONE)."""
        return self.mode != "NONE"

    @property
    def has_full(self) -> bool:
        """Whether FULL graphs are captured (the mode vLLM checks Mamba blocks for)."""
        return (self.mode or DEFAULT_CUDAGRAPH_MODE).startswith("FULL")


def parse_json_object(text: str, flag: str) -> dict[str, Any]:
    """A flag's JSON object value, as vLLM's ``json.loads`` type reads it; one-line error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"{flag} is not valid JSON ({exc.msg} at column {exc.colno})",
            f"""quote the whole object: {flag} '{{"key": "value"}}'""",
        ) from None
    if not isinstance(value, dict):
        raise BadInput(f"{flag} must be a JSON object", f"""write {flag} '{{"key": value}}'""")
    return value


def _positive_ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise BadInput(f"{what} must be a non-empty list of sizes", f"write {what} [1, 2, 4, 8]")
    sizes: list[int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise BadInput(f"{what} holds {item!r}, not a positive size", "use whole numbers ≥ 1")
        sizes.append(item)
    return tuple(sizes)


def _mode(value: Any) -> str:
    name = str(value).strip().upper()
    if name not in CUDAGRAPH_MODES:
        raise BadInput(
            f"cudagraph_mode {value!r} is not a mode vLLM has",
            "use one of: " + ", ".join(CUDAGRAPH_MODES),
        )
    return name


def read_compilation_config(text: str | None) -> GraphSettings:
    """The graph keys of a ``--compilation-config`` JSON value (other keys are vLLM's own)."""
    if not text:
        return GraphSettings()
    data = parse_json_object(text, "--compilation-config")
    mode = data.get("cudagraph_mode")
    sizes = data.get("cudagraph_capture_sizes")
    largest = data.get("max_cudagraph_capture_size")
    if largest is not None and (isinstance(largest, bool) or not isinstance(largest, int)):
        raise BadInput(
            f"max_cudagraph_capture_size {largest!r} is not a whole number", "write e.g. 256"
        )
    return GraphSettings(
        mode=None if mode is None else _mode(mode),
        capture_sizes=None if sizes is None else _positive_ints(sizes, "cudagraph_capture_sizes"),
        max_capture_size=largest,
    )


def graph_settings(
    compilation_config: str | None,
    capture_sizes: tuple[int, ...] | None,
    max_capture_size: int | None,
) -> GraphSettings:
    """The graph settings of the compilation config and the two top-level flags.

    As vLLM's ``EngineArgs.create_engine_config``: a key given both ways is an error.
    """
    inner = read_compilation_config(compilation_config)
    if capture_sizes is not None and inner.capture_sizes is not None:
        raise BadInput(
            "--cudagraph-capture-sizes and compilation_config.cudagraph_capture_sizes are "
            "mutually exclusive",
            "give the capture sizes once",
        )
    if max_capture_size is not None and inner.max_capture_size is not None:
        raise BadInput(
            "--max-cudagraph-capture-size and compilation_config.max_cudagraph_capture_size "
            "are mutually exclusive",
            "give the largest capture size once",
        )
    sizes = capture_sizes if capture_sizes is not None else inner.capture_sizes
    largest = max_capture_size if max_capture_size is not None else inner.max_capture_size
    if sizes is not None and largest is not None and largest != max(sizes):
        raise BadInput(
            f"max_cudagraph_capture_size ({largest}) should be consistent with the max value "
            f"of cudagraph_capture_sizes ({max(sizes)})",
            "drop one of the two or make them agree",
        )
    return GraphSettings(inner.mode, sizes, largest)


def capture_sizes(
    graphs: GraphSettings,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    compute_capability: str = "",
) -> list[int]:
    """The sizes vLLM captures (vllm 0.32 ``config/vllm.py: _set_cudagraph_sizes``).

    Given sizes: de-duplicated, those ≤ ``max_num_batched_tokens``. Otherwise the grid
    ``[1, 2, 4] + 8…248 step 8 + 256… step 16`` up to the largest size: the given
    ``max_cudagraph_capture_size``, else ``min(2 × max_num_seqs, 512)`` (1024 on compute
    capability 10.x), capped by ``max_num_batched_tokens``. (Without speculative decoding.)
    """
    if not graphs.captures:
        return []
    if graphs.capture_sizes is not None:
        return sorted({s for s in graphs.capture_sizes if s <= max_num_batched_tokens})
    limit = 1024 if compute_capability.startswith("10") else 512
    largest = graphs.max_capture_size
    if largest is None:
        largest = min(max_num_seqs * 2, limit)
    largest = min(largest, max_num_batched_tokens)
    grid = [1, 2, 4, *range(8, 256, 8), *range(256, max(largest, limit) + 1, 16)]
    return [s for s in grid if s <= largest]
