"""Mechanisms that decide the ranking when several causes are plausible: a message wrapped
between two words, host memory named through a container or Ray, a sleep-mode wake-up beside
a trainer, and weights that exceed the GPU whatever else holds it. Synthetic texts only."""

from __future__ import annotations

from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.findings import Diagnosis
from oomguard.doctor.situation import Context
from oomguard.logs import parse_stream
from oomguard.logs.lines import iter_records

SITE = "/usr/lib/python3/dist-packages"


def _diag(lines: list[str], **context: object) -> Diagnosis:
    return diagnose(parse_stream(lines), Context(**context))  # type: ignore[arg-type]


def test_wrap_between_words_keeps_the_space_and_inside_a_word_does_not() -> None:
    between = [r.text for r in iter_records(["the check on startup is", "less than desired"])]
    assert between == ["the check on startup is less than desired"]
    wrapped = "ValueError: To serve at least one request with the model's max seq len (8192), (4.2 GiB KV cach"
    inside = [r.text for r in iter_records([wrapped, "e is needed"])]
    assert inside == [wrapped + "e is needed"]
    # a short line ended where its writer ended it: never glued to the next one
    short = [r.text for r in iter_records(["weights took 27.2 GB", "then got OOM"])]
    assert short == ["weights took 27.2 GB then got OOM"]


def test_startup_check_wrapped_by_the_reporter_is_recognised() -> None:
    d = _diag(
        [
            "ValueError: Free memory on device cuda:0 (21.40/23.99 GiB) on startup is",
            "less than desired GPU memory utilization (0.92, 22.07 GiB). Decrease GPU memory",
            "utilization or reduce GPU memory used by other processes.",
        ]
    )
    assert d.oom_found and d.top is not None
    assert d.top.cause == "util_overshoot"
    util = [f for f in d.top.ordered_fixes() if f.flag == "--gpu-memory-utilization"]
    assert util and float(str(util[0].value)) < 0.92


def test_container_memory_limit_is_host_ram() -> None:
    d = _diag(
        [
            "Serving a 14B model in docker run --gpus all --memory 8g; the container gets "
            "OOM-killed while the shards load, exit code 137.",
        ]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_ray_oom_is_host_ram() -> None:
    d = _diag(["Ray OOM when starting the engine with tensor parallel 4 on one node"])
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_oom_while_the_gpu_is_not_full_is_host_ram() -> None:
    d = _diag(
        [
            "The server dies with an OOM during loading, but nvidia-smi does not show it's "
            "using all the memory on the card."
        ]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_wake_up_beside_a_trainer_is_its_cached_memory_not_expandable_segments() -> None:
    d = _diag(
        [
            "After the GRPO trainer step the rollout engine hits CUDA OOM in wake_up.",
            "Traceback (most recent call last):",
            f'  File "{SITE}/vllm/entrypoints/llm.py", line 1300, in wake_up',
            "    self.llm_engine.wake_up(tags)",
        ]
    )
    assert d.top is not None and d.top.cause == "fragmentation"
    fixes = d.top.ordered_fixes()
    assert "empty_cache" in str(fixes[0].value)
    assert all("expandable_segments:True" not in str(f.value) for x in d.findings for f in x.fixes)


def test_wake_up_without_trainer_or_cache_words_is_not_fragmentation() -> None:
    d = _diag(["CUDA OOM in wake_up after switching the served model"])
    assert d.top is None or d.top.cause != "fragmentation"


def _oom(total: str, free: str, others: str, this: str) -> list[str]:
    return [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB. GPU 0 has "
        f"a total capacity of {total} GiB of which {free} MiB is free. {others}Including "
        f"non-PyTorch memory, this process has {this} GiB memory in use. Of the allocated "
        f"memory {this} GiB is allocated by PyTorch, and 9.50 MiB is reserved by PyTorch but "
        "unallocated."
    ]


def test_weights_beyond_the_gpu_outrank_other_processes() -> None:
    lines = [
        "INFO 05-02 10:11:12 llm_engine.py:237] Initializing an LLM engine (v0.5.4) with "
        "config: model='/models/Acme-110B-Chat', tokenizer='/models/Acme-110B-Chat', "
        "dtype=torch.bfloat16, max_seq_len=8192, tensor_parallel_size=1, "
        "pipeline_parallel_size=1, quantization=None, enforce_eager=False",
        *_oom("79.15", "612.00", "Process 4411 has 45.20 GiB memory in use. ", "32.80"),
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    assert d.top.ordered_fixes()[0].flag in {"--tensor-parallel-size", "--quantization", "--model"}
    assert [f.cause for f in d.findings][1] == "leak_or_other_process"  # reported, below


def test_weights_that_fit_leave_the_other_process_first() -> None:
    lines = [
        "INFO 05-02 10:11:12 llm_engine.py:237] Initializing an LLM engine (v0.5.4) with "
        "config: model='/models/Acme-7B-Chat', dtype=torch.bfloat16, max_seq_len=8192, "
        "tensor_parallel_size=1, pipeline_parallel_size=1",
        *_oom("79.15", "612.00", "Process 4411 has 52.20 GiB memory in use. ", "25.80"),
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "leak_or_other_process"


def test_weights_beyond_an_80gb_card_when_no_gpu_is_named() -> None:
    lines = [
        "INFO 05-02 10:11:12 llm_engine.py:237] Initializing an LLM engine (v0.6.4) with "
        "config: model='/data/Acme-VL-90B-Instruct', dtype=torch.bfloat16, "
        "tensor_parallel_size=1, pipeline_parallel_size=1",
        "torch.OutOfMemoryError: CUDA out of memory.",
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "weights_dont_fit"
