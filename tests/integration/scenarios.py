"""Named vLLM CPU configurations used by the integration tests and the recorded logs.

Every byte count is derived from the tiny model's KV facts (``tinymodel.py``): the engines the
tests start serve it in float32 (``ENGINE_ARGS``) with vLLM 0.32.0 CPU's 128-token blocks, so
one block over both layers holds 128 x 1,024 B = 128 KiB. (The logs in ``data/`` were recorded
in bfloat16, 64 KiB a block; their tests read the flags from each log.) vLLM keeps one block back as
the null block, so a pool of B blocks serves B - 1 blocks of requests (the fit check since 0.29).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinymodel import CPU_BLOCK_SIZE_TOKENS, KV_BYTES_PER_TOKEN, MEDIUM, ModelShape

BLOCK_BYTES = CPU_BLOCK_SIZE_TOKENS * KV_BYTES_PER_TOKEN  # 131,072 B

# The guard scenario of issue 4: about 2,000 tokens of KV (16 blocks = 2,048 tokens).
GUARD_POOL_BLOCKS = 16
# The model the guard burst runs on: chosen for a decode step and a recompute that cost, relative
# to each other and to the gateway's own per-request work, what they cost on a GPU (README.md).
GUARD_SHAPE = MEDIUM
GUARD_KV_BYTES = GUARD_POOL_BLOCKS * BLOCK_BYTES  # 2,097,152 B
GUARD_MAX_MODEL_LEN = 1024
GUARD_BURST_REQUESTS = 32
GUARD_PROMPT_TOKENS = 180
GUARD_MAX_TOKENS = 300


def guard_kv_bytes(shape: ModelShape) -> int:
    """``--kv-cache-memory-bytes`` giving ``shape`` the guard scenario's pool of 2,048 tokens."""
    return GUARD_POOL_BLOCKS * CPU_BLOCK_SIZE_TOKENS * shape.kv_bytes_per_token


@dataclass(frozen=True)
class Scenario:
    """One vLLM start: the flags, and whether it must come up."""

    name: str
    kv_cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    starts: bool = True
    note: str = ""
    extra_args: tuple[str, ...] = field(default_factory=tuple)


# Starts whose "CPU KV cache size … Maximum concurrency" line the planner must reproduce.
FITTING = (
    Scenario(
        "guard_pool_2048_tokens",
        kv_cache_memory_bytes=GUARD_KV_BYTES,
        max_model_len=GUARD_MAX_MODEL_LEN,
        note="the guard scenario's pool: 16 blocks, 2 requests of 1,024 tokens",
    ),
    Scenario(
        "partial_block_len_1000",
        kv_cache_memory_bytes=3_000_000,
        max_model_len=1000,
        max_num_seqs=8,
        note="pool not a whole number of blocks; max_model_len not a multiple of 128",
    ),
    Scenario(
        "default_len_10mib",
        kv_cache_memory_bytes=10 * 2**20,
        max_num_seqs=4,
        note="max_model_len left to the model's 2,048",
    ),
)

# A pool of 6 blocks: 5 usable, 8 needed for 1,024 tokens → fit error, estimate 5 x 128 = 640.
KV_TOO_SMALL = Scenario(
    "kv_too_small_for_max_len",
    kv_cache_memory_bytes=6 * BLOCK_BYTES,
    max_model_len=GUARD_MAX_MODEL_LEN,
    starts=False,
    note="fit error with 'estimated maximum model length is 640'",
)
# Less than one usable block after the null block: the fit error has no estimate.
KV_TOO_SMALL_NO_ESTIMATE = Scenario(
    "kv_too_small_no_estimate",
    kv_cache_memory_bytes=BLOCK_BYTES * 3 // 2,  # one block and a half: the null block only
    max_model_len=GUARD_MAX_MODEL_LEN,
    starts=False,
    note="fit error without an estimate (less than one usable block)",
)
# Exactly one block: nothing left once the null block is reserved.
NO_CACHE_BLOCKS = Scenario(
    "no_cache_blocks",
    kv_cache_memory_bytes=BLOCK_BYTES,
    max_model_len=GUARD_MAX_MODEL_LEN,
    starts=False,
    note="'No available memory for the cache blocks'",
)
# Utilization below what the worker process already holds: requested - RSS < 0.
UTIL_BELOW_RSS = Scenario(
    "cpu_util_below_process_rss",
    gpu_memory_utilization=0.02,
    max_model_len=GUARD_MAX_MODEL_LEN,
    starts=False,
    note="CPU 'on kv cache allocation is less than requested memory for kv' (negative)",
)
# Utilization 1.0 always exceeds the node's available memory at startup.
FREE_MEMORY_CHECK = Scenario(
    "cpu_startup_free_memory_check",
    gpu_memory_utilization=1.0,
    max_model_len=GUARD_MAX_MODEL_LEN,
    starts=False,
    note="CPU 'on startup is less than desired CPU memory utilization'",
)
# Auto-sized pool (no explicit bytes), small utilization: the "Auto set" line.
AUTO_UTIL = Scenario(
    "startup_auto_kv_util",
    gpu_memory_utilization=0.25,
    max_model_len=GUARD_MAX_MODEL_LEN,
    max_num_seqs=16,
    note="pool = util x node memory - process RSS",
)

FAILING = (
    KV_TOO_SMALL,
    KV_TOO_SMALL_NO_ESTIMATE,
    NO_CACHE_BLOCKS,
    UTIL_BELOW_RSS,
    FREE_MEMORY_CHECK,
)
ALL = (*FITTING, AUTO_UTIL, *FAILING)
