"""From the highest safe concurrency to settings: ``--max-num-seqs``, the guard's watermarks,
the measured KV per request and per token, as a runnable ``vllm serve`` line and a guard
config. Pure: no I/O.

- ``--max-num-seqs``: the highest safe concurrency, or fewer when the server never ran that
  many at once (its own cap held the rest in its queue: only what ran was proven). Through a
  gateway that admits by KV (the guard), the server never meets the load alone and the
  requests it runs are staggered by the gateway, so the cap is what the pool holds of the
  peak shape under the high watermark, computed from the pool the server states.
- Watermarks: the guard prices a request at ``ceil((prompt + max_tokens) / block_size)``
  blocks and admits while its reservations stay under ``high × usable blocks``. The high
  watermark admits exactly the safe number of peak requests (and not one more); the low one
  resumes admission once one request's worth has drained.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from typing import Any

from oomguard.bench.server import Capacity


@dataclass(frozen=True)
class BenchRecommendation:
    """The settings bench recommends, and what they rest on."""

    max_num_seqs: int | None
    high_watermark: float | None
    low_watermark: float | None
    kv_bytes_per_token: float | None
    kv_bytes_per_token_source: str
    blocks_per_request: int | None  # as the guard prices the peak request
    kv_tokens_per_request_measured: float | None  # from the KV usage at the safe point
    vllm_command: str | None
    guard_config: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {
            "max_num_seqs": self.max_num_seqs,
            "high_watermark": self.high_watermark,
            "low_watermark": self.low_watermark,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_bytes_per_token_source": self.kv_bytes_per_token_source,
            "blocks_per_request": self.blocks_per_request,
            "kv_tokens_per_request_measured": self.kv_tokens_per_request_measured,
            "vllm_command": self.vllm_command,
            "guard_config": self.guard_config,
            "notes": list(self.notes),
        }


def watermarks(
    safe: int, blocks_per_request: int, usable_blocks: int, ceiling: float
) -> tuple[float, float, list[str]]:
    """(high, low, notes): high admits ``safe`` requests of ``blocks_per_request`` and not
    ``safe + 1``; low is one request below it. As few decimals as that allows (3 or more),
    within (0, 1]."""
    notes: list[str] = []
    exact = safe * blocks_per_request / usable_blocks
    next_one = (safe + 1) * blocks_per_request / usable_blocks
    digits = 3
    while True:
        scale = 10**digits
        high = math.ceil(exact * scale - 1e-9) / scale
        if high < next_one - 1e-12 or digits >= 9:
            break
        digits += 1
    if high > 1.0:
        notes.append(
            f"the guard prices a peak request at {blocks_per_request} blocks; {safe} of them need "
            f"{exact:.2f} of the pool, so with high_watermark 1.0 it admits "
            f"{int(usable_blocks // blocks_per_request)} (fewer than the server holds)"
        )
        high = 1.0
    if high > ceiling + 1e-9:
        notes.append(f"high watermark {high:g} is above the KV limit the search used ({ceiling:g})")
    low = math.floor((safe - 1) * blocks_per_request / usable_blocks * scale + 1e-9) / scale
    if low <= 0 or low >= high:
        low = math.floor(high * scale * 5) / (scale * 10)
    return round(high, digits), round(low, digits + 1), notes


def vllm_command(
    model: str, max_num_seqs: int, *, max_model_len: int | None, capacity: Capacity | None
) -> str:
    """A ``vllm serve`` line with the recommended cap and the pool the run measured."""
    parts = ["vllm", "serve", model, "--max-num-seqs", str(max_num_seqs)]
    if max_model_len:
        parts += ["--max-model-len", str(max_model_len)]
    if capacity is not None and capacity.kv_cache_memory_bytes:
        parts += ["--kv-cache-memory-bytes", str(capacity.kv_cache_memory_bytes)]
    elif capacity is not None and capacity.gpu_memory_utilization:
        parts += ["--gpu-memory-utilization", f"{capacity.gpu_memory_utilization:g}"]
    return shlex.join(parts)


def _guard_config(
    capacity: Capacity, high: float, low: float, backend_url: str, max_model_len: int | None
) -> dict[str, Any]:
    """The guard's config for one backend with the recommended watermarks."""
    backend: dict[str, Any] = {"url": backend_url}
    if capacity.num_gpu_blocks:
        backend["num_gpu_blocks"] = capacity.num_gpu_blocks
    backend["block_size"] = capacity.block_size
    if max_model_len:
        backend["max_model_len"] = max_model_len
    return {"backends": [backend], "high_watermark": high, "low_watermark": low}


def recommend(
    *,
    max_safe: int | None,
    proven_running: int | None,
    capacity: Capacity | None,
    peak_sequence_tokens: int,
    kv_peak_at_safe: float | None,
    kv_limit: float,
    model: str,
    max_model_len: int | None,
    backend_url: str,
    gateway: bool = False,
) -> BenchRecommendation:
    """The settings for a safe concurrency ``max_safe`` (None: nothing was safe).

    ``proven_running``: the most requests the server ran at once in a safe stage (None when
    it does not say); ``kv_peak_at_safe``: the KV fraction held at the safe point.
    """
    notes: list[str] = []
    kv_per_token = capacity.kv_bytes_per_token if capacity else None
    source = (
        "the server's pool (kv_cache_memory_bytes ÷ blocks × block size)"
        if kv_per_token
        else "not stated: the server was not started with --kv-cache-memory-bytes; "
        "`oomguard plan MODEL` computes it from the model's config"
    )
    if max_safe is None:
        return BenchRecommendation(
            None,
            None,
            None,
            kv_per_token,
            source,
            None,
            None,
            None,
            None,
            ["no concurrency was proven safe: nothing to recommend"],
        )
    seqs = max_safe
    pool_holds = (
        int(kv_limit * capacity.usable_blocks + 1e-9)
        // -(-peak_sequence_tokens // capacity.block_size)
        if capacity is not None
        else None
    )
    if gateway and pool_holds:
        seqs = min(max_safe, max(1, pool_holds))
        notes.append(
            f"measured through a gateway that holds requests back: --max-num-seqs {seqs} is what "
            f"the pool holds of the peak shape under the high watermark, not a measurement of the "
            "server alone (bench it directly, or with --metrics-url, to measure that)"
        )
    elif proven_running is not None and 0 < proven_running < max_safe:
        seqs = proven_running
        notes.append(
            f"the server never ran more than {proven_running} requests at once (its own "
            f"--max-num-seqs, or a gateway's admission, queued the rest): only "
            f"{proven_running} are proven"
        )
    blocks = high = low = None
    measured_tokens = None
    if capacity is not None:
        blocks = -(-peak_sequence_tokens // capacity.block_size)
        high, low, more = watermarks(seqs, blocks, capacity.usable_blocks, kv_limit)
        notes += more
        if kv_peak_at_safe is not None:
            measured_tokens = round(kv_peak_at_safe * capacity.usable_tokens / seqs, 1)
    command = vllm_command(model, seqs, max_model_len=max_model_len, capacity=capacity)
    guard = None
    if capacity is not None and high is not None and low is not None:
        guard = _guard_config(capacity, high, low, backend_url, max_model_len)
    return BenchRecommendation(
        seqs, high, low, kv_per_token, source, blocks, measured_tokens, command, guard, notes
    )
