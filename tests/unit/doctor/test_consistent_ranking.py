"""Ranking as a whole: equal confidences follow the checklist, a size estimated from a name
yields to a log that contradicts it, a small co-tenant weighs less than a sizeable one, a
hedged failure followed by the change that avoided it, and the V1 default's larger batch.
Synthetic texts only."""

from __future__ import annotations

from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.findings import CAUSES, CHECKLIST_ORDER, Diagnosis, rank_key
from oomguard.doctor.rules import Findings
from oomguard.doctor.situation import Context
from oomguard.logs import parse_stream

SITE = "/usr/lib/python3/dist-packages/vllm"


def _diag(lines: list[str], **context: object) -> Diagnosis:
    return diagnose(parse_stream(lines), Context(**context))  # type: ignore[arg-type]


def _causes(d: Diagnosis) -> list[str]:
    return [f.cause for f in d.findings]


def test_every_cause_has_a_checklist_place() -> None:
    assert set(CHECKLIST_ORDER) == set(CAUSES)


def test_equal_confidences_follow_the_checklist_whatever_the_order_found() -> None:
    out = Findings()
    out.add("weights_dont_fit", 0.5, "w", [])
    out.add("concurrency_or_batch", 0.5, "c", [])
    out.add("kv_too_small_for_max_len", 0.5000001, "k", [])
    out.add("util_overshoot", 0.49, "u", [])
    ranked = [f.cause for f in out.ranked()]
    assert ranked == [
        "kv_too_small_for_max_len",
        "concurrency_or_batch",
        "weights_dont_fit",
        "util_overshoot",
    ]
    assert rank_key("other", 0.9) < rank_key("leak_or_other_process", 0.8)


def test_kv_fit_error_in_gb_units_is_read_and_ranks_before_a_later_warmup_failure() -> None:
    d = _diag(
        [
            "ERROR 01-02 03:04:05 [core.py:343] ValueError: To serve at least one request with "
            "the models's max seq len (65536), (6.00 GB KV cache is needed, which is larger than "
            "the available KV cache memory (3.00 GB). Try increasing gpu_memory_utilization or "
            "decreasing max_model_len when initializing the engine.",
            "ERROR 01-02 04:04:05 [core.py:343] RuntimeError: CUDA out of memory occurred when "
            "warming up sampler with 1024 dummy requests. Please try lowering max_num_seqs or "
            "gpu_memory_utilization when initializing the engine.",
        ]
    )
    assert d.parsed.get("kv_needed_gib") == 6.0 and d.parsed.get("kv_available_gib") == 3.0
    assert _causes(d)[:2] == ["kv_too_small_for_max_len", "concurrency_or_batch"]
    first = d.findings[0].ordered_fixes()[0]
    assert first.flag == "--max-model-len" and int(str(first.value)) <= 32768


def test_hedged_failure_then_the_lowered_setting_reports_the_fix() -> None:
    d = _diag(
        [
            "Running the rollout engine with gpu_memory_utilization at 0.8 might run out of "
            "memory on a node shared with the trainer, so we lower it from 0.8 to 0.65."
        ]
    )
    assert d.oom_found and d.top is not None and d.top.cause == "util_overshoot"
    fix = d.top.ordered_fixes()[0]
    assert fix.flag == "--gpu-memory-utilization" and fix.value == "0.65"


def test_a_change_that_did_not_help_is_no_fix() -> None:
    d = _diag(
        [
            "The server goes OOM at start-up; even after I reduced max_num_seqs from 256 to 64 "
            "it still fails the same way."
        ]
    )
    assert d.top is None or d.top.confidence < 0.62
    assert not d.parsed.has("said_fix_concurrency_or_batch")


def test_raising_a_setting_is_not_read_as_the_fix_for_running_out() -> None:
    d = _diag(["This would cause OOM, so we increase max_model_len from 4096 to 8192."])
    assert not d.parsed.has("said_fix_kv_too_small_for_max_len")


def test_more_gpus_stated_as_a_change_is_the_weights_fix() -> None:
    d = _diag(["Loading gives OOM; tensor_parallel_size 1 -> 4 fixed it."])
    assert d.top is not None and d.top.cause == "weights_dont_fit"


def _serving_oom(total: str, free: str, procs: str, allocated: str, tried: str) -> list[str]:
    return [
        f'  File "{SITE}/v1/worker/gpu_model_runner.py", line 2100, in _get_prompt_logprobs_dict',
        "    logprobs = self.sampler.compute_logprobs(logits)",
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried} GiB. GPU 0 has a "
        f"total capacity of {total} GiB of which {free} GiB is free. {procs}Of the allocated "
        f"memory {allocated} GiB is allocated by PyTorch, and 120.00 MiB is reserved by PyTorch "
        "but unallocated.",
    ]


def test_a_name_estimate_beyond_the_gpu_yields_when_the_failure_came_after_loading() -> None:
    lines = _serving_oom(
        "22.30",
        "1.40",
        "Process 11 has 250.00 MiB memory in use. Process 12 has 20.50 GiB memory in use. ",
        "19.80",
        "1.90",
    )
    d = _diag(lines, model="/models/Acme-60B-Chat")  # ~110 GiB in bf16 by its name
    assert "weights_dont_fit" not in _causes(d)
    assert d.top is not None and d.top.cause == "concurrency_or_batch"


def test_a_small_co_tenant_that_tipped_the_allocation_is_weaker_than_a_sizeable_one() -> None:
    small = _diag(
        _serving_oom(
            "22.30",
            "1.40",
            "Process 11 has 250.00 MiB memory in use. Process 12 has 20.50 GiB memory in use. ",
            "19.80",
            "1.60",
        )
    )
    big = _diag(
        _serving_oom(
            "80.00",
            "1.40",
            "Process 11 has 9.00 GiB memory in use. Process 12 has 69.50 GiB memory in use. ",
            "68.80",
            "1.60",
        )
    )
    util_small = next(f for f in small.findings if f.cause == "util_overshoot")
    util_big = next(f for f in big.findings if f.cause == "util_overshoot")
    assert util_small.confidence < util_big.confidence
    assert big.top is not None and big.top.cause == "util_overshoot"


def test_upgrade_into_v1_with_default_seqs_points_at_the_batch_then_graphs() -> None:
    text = [
        "It served fine on vllm 0.7.3; after upgrading to 0.8.4 the same model goes OOM when "
        "the server starts."
    ]
    d = _diag(text)
    assert _causes(d)[:2] == ["concurrency_or_batch", "cuda_graph"]
    assert d.findings[0].ordered_fixes()[0].flag == "--max-num-seqs"
    stated = _diag(text, args={"max_num_seqs": 64})
    assert stated.top is not None and stated.top.cause == "cuda_graph"
    small_gpu = _diag(text, gpu="L4")
    assert small_gpu.top is not None and small_gpu.top.cause == "cuda_graph"
