"""Tier 1: each mechanism check fires with the numbers it needs, and not without them.

The log lines are vLLM's and PyTorch's own message texts (vllm-memory.md §2, §7, §11) with
figures chosen to sit clearly on one side of each check's threshold.
"""

from __future__ import annotations

from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.mechanisms import (
    Verdict,
    check_budget,
    check_failed_allocation,
    check_kv_fit,
    check_rank_asymmetry,
    check_startup_free_memory,
    run_mechanisms,
)
from oomguard.doctor.situation import Context, Situation, build_situation
from oomguard.logs import parse_stream

SITE = "/usr/local/lib/python3.12/dist-packages/vllm"


def _situation(lines: list[str], **context: object) -> Situation:
    return build_situation(parse_stream(lines), Context(**context))  # type: ignore[arg-type]


def _verdict(lines: list[str], **context: object) -> Verdict | None:
    verdicts = run_mechanisms(_situation(lines, **context))
    return verdicts[0] if verdicts else None


KV_FIT = (
    "ValueError: To serve at least one request with the model's max seq len (32768), (4.0 GiB "
    "KV cache is needed, which is larger than the available KV cache memory (1.5 GiB). Based on "
    "the available memory, the estimated maximum model length is 12288. Try increasing "
    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
)


def test_kv_fit_check_proves_the_length_with_its_numbers() -> None:
    verdict = check_kv_fit(_situation([KV_FIT]))
    assert verdict is not None and verdict.cause == "kv_too_small_for_max_len"
    assert verdict.numbers["max_model_len"] == 32768
    assert verdict.numbers["kv_capacity_tokens"] == 12288


def test_kv_fit_message_with_elided_numbers_is_left_to_the_ranking() -> None:
    text = (
        "ValueError: The model's max seq len (...) is larger than the maximum number of "
        "tokens that can be stored in KV cache (...)"
    )
    assert check_kv_fit(_situation([text])) is None
    diagnosis = diagnose(parse_stream([text]))
    assert diagnosis.top is not None and not diagnosis.top.sure
    assert diagnosis.top.cause == "kv_too_small_for_max_len"


def _startup(free: float, total: float, util: float) -> str:
    return (
        f"ValueError: Free memory on device cuda:0 ({free}/{total} GiB) on startup is less than "
        f"desired GPU memory utilization ({util}, {round(util * total, 2)} GiB). Decrease GPU "
        "memory utilization or reduce GPU memory used by other processes."
    )


def test_startup_check_with_most_of_the_gpu_held_is_another_process() -> None:
    verdict = check_startup_free_memory(_situation([_startup(22.65, 79.18, 0.9)]))
    assert verdict is not None and verdict.cause == "leak_or_other_process"
    assert round(verdict.numbers["others_gib"], 2) == 56.53


def test_startup_check_with_only_the_context_held_is_the_utilization() -> None:
    verdict = check_startup_free_memory(_situation([_startup(78.1, 79.18, 0.99)]))
    assert verdict is not None and verdict.cause == "util_overshoot"


def test_startup_check_beside_a_planned_co_tenant_is_the_budget() -> None:
    # utilization 0.35: the GPU was meant to be shared, so the others are budgeted co-tenants
    verdict = check_startup_free_memory(_situation([_startup(38.74, 121.63, 0.35)]))
    assert verdict is not None and verdict.cause == "util_overshoot"
    told = check_startup_free_memory(
        _situation([_startup(22.65, 79.18, 0.9)], expect_cotenant=True)
    )
    assert told is not None and told.cause == "util_overshoot"


def test_startup_check_in_between_proves_nothing() -> None:
    assert check_startup_free_memory(_situation([_startup(52.0, 79.18, 0.9)])) is None


def _torch_oom(tried: str, total: float, free: str, rest: str) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a "
        f"total capacity of {total} GiB of which {free} is free. {rest} If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )


def test_allocation_failing_where_other_processes_hold_the_gpu() -> None:
    line = _torch_oom(
        "64.00 MiB",
        79.2,
        "48.62 MiB",
        "Including non-PyTorch memory, this process "
        "has 2.46 GiB memory in use. Of the allocated memory 1.15 GiB is allocated "
        "by PyTorch, and 13.45 MiB is reserved by PyTorch but unallocated.",
    )
    verdict = check_failed_allocation(_situation([line]))
    assert verdict is not None and verdict.cause == "leak_or_other_process"
    assert verdict.numbers["other_processes_gib"] > 70


def test_a_container_that_hides_the_process_usage_is_not_another_process() -> None:
    # "this process has 0 bytes": PyTorch cannot see it inside a container, it is not empty
    line = _torch_oom(
        "1.47 GiB",
        79.11,
        "1.25 GiB",
        "Including non-PyTorch memory, this process "
        "has 0 bytes memory in use. Of the allocated memory 70.03 GiB is allocated "
        "by PyTorch, and 21.60 MiB is reserved by PyTorch but unallocated.",
    )
    assert check_failed_allocation(_situation([line])) is None


def test_a_large_cached_remainder_is_fragmentation_and_a_small_one_is_not() -> None:
    fragmented = _torch_oom(
        "0.94 GiB",
        79.14,
        "0.70 GiB",
        "Including non-PyTorch memory, this "
        "process has 78.43 GiB memory in use. Of the allocated memory 75.10 GiB "
        "is allocated by PyTorch, and 2.22 GiB is reserved by PyTorch but "
        "unallocated.",
    )
    verdict = check_failed_allocation(_situation([fragmented]))
    assert verdict is not None and verdict.cause == "fragmentation"
    normal = _torch_oom(
        "138.00 MiB",
        23.56,
        "110.50 MiB",
        "Including non-PyTorch memory, this "
        "process has 23.44 GiB memory in use. Of the allocated memory 22.57 GiB is "
        "allocated by PyTorch, and 529.27 MiB is reserved by PyTorch but "
        "unallocated.",
    )
    assert check_failed_allocation(_situation([normal])) is None


def test_tensor_parallel_ranks_with_unequal_free_memory() -> None:
    rank0 = _torch_oom(
        "2.00 GiB",
        79.2,
        "1.10 GiB",
        "Including non-PyTorch memory, this process has 40.00 GiB memory in use.",
    )
    rank1 = rank0.replace("GPU 0", "GPU 1").replace(
        "this process has 40.00", "this process has 78.00"
    )
    verdict = check_rank_asymmetry(_situation([rank0, rank1]))
    assert verdict is not None and verdict.cause == "leak_or_other_process"
    assert verdict.numbers["gpu_index"] == 0
    assert check_rank_asymmetry(_situation([rank1, rank1.replace("GPU 1", "GPU 2")])) is None


NO_BLOCKS = (
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)


def _budget_log(weights_gib: float, util: float = 0.9, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        f"INFO 05-01 12:00:00 [model_runner.py:1100] Model loading took {weights_gib} GiB and "
        "12.5 seconds",
        "INFO 05-01 12:00:00 [api_server.py:100] non-default args: "
        f"{{'gpu_memory_utilization': {util}}}",
        *extra,
        NO_BLOCKS,
    ]


def test_budget_arithmetic_names_the_term_that_took_the_budget() -> None:
    weights = check_budget(_situation(_budget_log(21.5), gpu="RTX 4090"))
    assert weights is not None and weights.cause == "weights_dont_fit"
    low_util = check_budget(_situation(_budget_log(13.0, util=0.5), gpu="RTX 4090"))
    assert low_util is not None and low_util.cause == "kv_too_small_for_max_len"
    assert check_budget(_situation(_budget_log(8.0), gpu="RTX 4090")) is None
    assert check_budget(_situation(_budget_log(21.5))) is None  # no device total: no arithmetic


def test_budget_with_a_large_graph_estimate_is_the_graphs() -> None:
    graphs = ("INFO [gpu_model_runner.py:4000] Estimated CUDA graph memory: 9.50 GiB total",)
    verdict = check_budget(_situation(_budget_log(8.0, extra=graphs), gpu="RTX 4090"))
    assert verdict is not None and verdict.cause == "cuda_graph"


def test_host_memory_kill() -> None:
    verdict = _verdict(
        [
            "Loading safetensors checkpoint shards:  40% Completed | 2/5",
            "Killed",
            "[process exited with code 137]",
        ]
    )
    assert verdict is not None and verdict.cause == "cpu_ram"


def test_sampler_warmup_is_the_number_of_sequences() -> None:
    verdict = _verdict(
        [
            "RuntimeError: CUDA out of memory occurred when warming up sampler with "
            "1024 dummy requests. Please try lowering max_num_seqs or "
            "gpu_memory_utilization when initializing the engine."
        ]
    )
    assert verdict is not None
    assert (verdict.mechanism, verdict.cause) == ("failure_phase", "concurrency_or_batch")


def test_graph_capture_phase_is_the_graphs() -> None:
    lines = [
        "INFO 05-01 12:00:00 [gpu_model_runner.py:2000] Capturing CUDA graphs (mixed "
        "prefill-decode, PIECEWISE)",
        "Traceback (most recent call last):",
        f'  File "{SITE}/v1/worker/gpu_model_runner.py", line 3300, in capture_model',
        _torch_oom(
            "20.00 MiB",
            23.56,
            "3.31 MiB",
            "Including non-PyTorch memory, this process has 23.55 GiB memory in use.",
        ),
    ]
    verdict = _verdict(lines)
    assert verdict is not None and verdict.cause == "cuda_graph"


def test_mamba_state_blocks_cap_the_sequences() -> None:
    verdict = _verdict(
        [
            "ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks "
            "(658). Each decode sequence requires one Mamba cache block, so CUDA graph "
            "capture cannot proceed. Please lower max_num_seqs to at most 658 or "
            "increase gpu_memory_utilization."
        ]
    )
    assert verdict is not None and verdict.cause == "concurrency_or_batch"
    assert verdict.numbers == {"max_num_seqs": 1024.0, "state_blocks": 658.0}


def test_expandable_segments_inside_sleep_mode_is_the_setting() -> None:
    verdict = _verdict(
        [
            "AssertionError: Expandable segments are not compatible with memory pool. "
            'assert "expandable_segments:True" not in conf'
        ]
    )
    assert verdict is not None and verdict.cause == "other"


def test_a_bare_cuda_oom_proves_nothing() -> None:
    assert run_mechanisms(_situation(["torch.OutOfMemoryError: CUDA out of memory."])) == []
