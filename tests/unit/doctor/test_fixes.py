"""Fixes: sized with a margin, never at the edge, never one the memory model predicts to fail."""

from __future__ import annotations

import pytest

from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.findings import Finding
from oomguard.doctor.fixes import FREE_DRIFT_GIB, margin_gib, util_within_free
from oomguard.doctor.outcome import apply_fix, current_settings, predict_run
from oomguard.doctor.situation import Context, build_situation
from oomguard.logs import parse_stream

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"


def _top(lines: list[str], **context: object) -> Finding:
    top = diagnose(parse_stream(lines), Context(**context)).top  # type: ignore[arg-type]
    assert top is not None
    return top


def _startup(free: float, total: float, util: float) -> str:
    return (
        f"ValueError: Free memory on device cuda:0 ({free}/{total} GiB) on startup is less than "
        f"desired GPU memory utilization ({util}, {round(util * total, 2)} GiB). Decrease GPU "
        "memory utilization or reduce GPU memory used by other processes."
    )


@pytest.mark.parametrize(
    ("free", "total"), [(20.5, 22.03), (78.1, 79.18), (10.91, 12.59), (3.2, 7.6)]
)
def test_a_utilization_sized_to_free_memory_survives_half_a_gib_less(
    free: float, total: float
) -> None:
    util = util_within_free(free, total)
    assert util * total <= free - margin_gib(total) + 1e-9
    assert util * total <= free - FREE_DRIFT_GIB  # still passes vLLM's start-up check
    assert util * total >= free - margin_gib(total) - 0.01 * total  # and wastes at most 1 %


def test_startup_overshoot_fix_has_the_margin() -> None:
    top = _top([_startup(78.1, 79.18, 0.99)])
    fix = top.fixes[0]
    assert fix.flag == "--gpu-memory-utilization"
    assert float(str(fix.value)) * 79.18 <= 78.1 - 1.0


def test_a_fix_that_then_fails_the_length_check_carries_the_fitting_length() -> None:
    # Llama-3.1-8B on an L4: at the utilization that fits the free memory the default
    # 131,072-token context no longer fits, so the fix sets both
    top = _top([_startup(20.5, 22.03, 0.95)], model=LLAMA_8B, gpu="L4")
    changes = top.flag_changes()
    assert set(changes) == {"--gpu-memory-utilization", "--max-model-len"}
    s = build_situation(
        parse_stream([_startup(20.5, 22.03, 0.95)]), Context(model=LLAMA_8B, gpu="L4")
    )
    settings = apply_fix(current_settings(s), top.fixes[0])
    assert settings is not None
    prediction = predict_run(s, settings, 20.5 - FREE_DRIFT_GIB)
    assert prediction is not None and prediction.fits


def test_a_utilization_the_model_predicts_to_fail_is_not_printed() -> None:
    # another process holds 16 of 22 GiB: no utilization leaves the 8B model room
    top = _top([_startup(6.0, 22.03, 0.9)], model=LLAMA_8B, gpu="L4")
    assert top.cause == "leak_or_other_process" and top.sure
    assert not top.flag_changes()
    assert top.fixes[0].flag == "action" and "memory model predicts" in str(top.fixes[0].value)


def test_another_process_at_startup_first_gives_serve_a_flag_to_start_beside_it() -> None:
    top = _top([_startup(30.0, 79.18, 0.9)], model=LLAMA_8B, gpu="H100")
    assert top.cause == "leak_or_other_process"
    assert top.fixes[0].flag == "--gpu-memory-utilization"
    assert float(str(top.fixes[0].value)) * 79.18 <= 30.0 - margin_gib(79.18)
    assert any(f.flag == "action" and "nvidia-smi" in str(f.value) for f in top.fixes)


def test_length_fix_keeps_ten_percent_of_the_capacity_and_whole_blocks() -> None:
    line = (
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens "
        "that can be stored in KV cache (7344). Try increasing `gpu_memory_utilization` or "
        "decreasing `max_model_len` when initializing the engine."
    )
    fix = _top([line]).fixes[0]
    assert fix.flag == "--max-model-len"
    assert int(str(fix.value)) <= 0.9 * 7344 and int(str(fix.value)) % 16 == 0


def test_an_explicit_pool_is_raised_to_hold_a_request_with_a_quarter_more() -> None:
    lines = [
        "INFO [api_server.py:100] non-default args: {'max_model_len': 8192, "
        "'kv_cache_memory_bytes': 268435456}",
        "ValueError: To serve at least one request with the model's max seq len (8192), (1.0 GiB "
        "KV cache is needed, which is larger than the available KV cache memory (0.25 GiB).",
    ]
    top = _top(lines)
    # a shorter length never needs more memory, so it comes first; then the larger pool
    assert [f.flag for f in top.fixes[:2]] == ["--max-model-len", "--kv-cache-memory-bytes"]
    assert top.fixes[1].value == "1280M"
    no_blocks = [
        lines[0],
        "ValueError: No available memory for the cache blocks. Try "
        "increasing `gpu_memory_utilization` when initializing the engine.",
    ]
    top = _top(no_blocks)
    assert top.mechanism == "explicit_kv_pool" and top.sure


def test_weights_that_fill_the_device_get_a_smaller_checkpoint_sized_by_the_model() -> None:
    lines = [
        "INFO [gpu_model_runner.py:100] Model loading took 70.5 GiB memory and 10 seconds",
        "INFO [api_server.py:100] non-default args: {'gpu_memory_utilization': 0.9}",
        "ValueError: No available memory for the cache blocks. Try increasing "
        "`gpu_memory_utilization` when initializing the engine.",
    ]
    top = _top(lines, model=LLAMA_70B, gpu="H100")
    assert top.cause == "weights_dont_fit" and top.sure
    first = top.fixes[0]
    assert first.flag in ("--model", "--quantization", "--tensor-parallel-size")
    assert "GiB per GPU" in first.why


def test_graph_memory_in_the_log_sizes_the_utilization_step() -> None:
    lines = [
        "INFO [api_server.py:100] non-default args: {'gpu_memory_utilization': 0.95}",
        "INFO [gpu_model_runner.py:100] Graph capturing finished in 12 secs, took 3.50 GiB",
        "Traceback (most recent call last):",
        '  File "/x/vllm/v1/worker/gpu_model_runner.py", line 3300, in capture_model',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 79.18 GiB of which 3.31 MiB is free.",
    ]
    top = _top(lines)
    assert top.cause == "cuda_graph"
    util = float(str(top.fixes[0].value))
    assert top.fixes[0].flag == "--gpu-memory-utilization"
    assert (0.95 - util) * 79.18 >= 3.5  # the graphs' memory, plus a margin


def test_sampler_warmup_gets_a_quarter_of_the_sequences() -> None:
    top = _top(
        [
            "RuntimeError: CUDA out of memory occurred when warming up sampler with 1024 "
            "dummy requests. Please try lowering max_num_seqs or gpu_memory_utilization when "
            "initializing the engine."
        ]
    )
    assert top.fixes[0].flag == "--max-num-seqs" and top.fixes[0].value == "256"


def test_a_kv_budget_far_below_the_model_s_prediction_is_said_to_be_held_elsewhere() -> None:
    lines = [
        "INFO [gpu_model_runner.py:100] Model loading took 14.99 GiB memory and 10 seconds",
        "INFO [gpu_worker.py:100] Available KV cache memory: 2.00 GiB",
        "ValueError: To serve at least one request with the model's max seq len (131072), (16.0 "
        "GiB KV cache is needed, which is larger than the available KV cache memory (2.00 GiB). "
        "Based on the available memory, the estimated maximum model length is 16384.",
    ]
    top = _top(lines, model=LLAMA_8B, gpu="H100")
    assert "held by something the model does not see" in top.explanation
    healthy = _top(
        lines[:1] + [lines[1].replace("2.00", "53.00"), lines[2]], model=LLAMA_8B, gpu="H100"
    )
    assert "does not see" not in healthy.explanation


def test_free_memory_within_the_margin_gets_no_utilization() -> None:
    # 0.41 of 79.18 GiB free: every utilization leaves less than the 1.58 GiB margin unrequested
    top = _top([_startup(0.41, 79.18, 0.9)])
    assert top.cause == "leak_or_other_process"
    assert top.fixes and all(f.flag == "action" for f in top.fixes), top.fixes
    shared = _top([_startup(0.41, 79.18, 0.9)], expect_cotenant=True)
    assert shared.cause == "util_overshoot" and len(shared.fixes) == 1
    assert shared.fixes[0].flag == "action" and "1.6 GiB" in str(shared.fixes[0].value)


def test_a_utilization_is_sized_to_the_memory_free_now_when_less_than_the_logs() -> None:
    line = _startup(78.1, 79.18, 0.99)
    logged = _top([line]).fixes[0]
    now = _top([line], free_gib=60.0).fixes[0]
    more = _top([line], free_gib=79.0).fixes[0]
    assert float(str(logged.value)) * 79.18 <= 78.1 - margin_gib(79.18)
    now_gib, logged_gib = float(str(now.value)) * 79.18, float(str(logged.value)) * 79.18
    assert now_gib <= 60.0 - margin_gib(79.18) < logged_gib
    assert "are free now" in now.why and "were free" in logged.why
    assert more == logged  # more free now than at the failure: the log's figure holds
