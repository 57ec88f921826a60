"""The log parser on every format: real rows from the data files and the texts of vllm-memory.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.errors import BadInput
from oomguard.logs import Phase, parse_file, parse_stream

DATA = Path("/work/shared/data")
STARTUP_ROWS = [
    json.loads(line)
    for line in (DATA / "vllm-startup-logs.jsonl").read_text().splitlines()
    if line.strip()
]
OOM_ROWS = [
    json.loads(line) for line in (DATA / "oom-cases.jsonl").read_text().splitlines() if line.strip()
]

# observed key in the data file → ParsedLog field
_CHECKS = {
    "weights_gib": "weights_gib",
    "kv_cache_gib": "available_kv_gib",
    "kv_tokens": "kv_tokens",
    "max_concurrency": "max_concurrency",
    "activation_peak_gib": "activation_gib",
    "non_torch_gib": "non_torch_gib",
    "gpu_blocks": "gpu_blocks",
    "cpu_blocks": "cpu_blocks",
    "cudagraph_gib": "cudagraph_actual_gib",
    "non_kv_total_gib": "non_kv_total_gib",
}
# rows whose "raw" is a summary table or prose rather than log output
_NOT_LOG_FORMAT = {2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 65}


def _log_rows() -> list[tuple[int, dict]]:
    return [(i, r) for i, r in enumerate(STARTUP_ROWS) if i not in _NOT_LOG_FORMAT]


@pytest.mark.parametrize(
    ("index", "row"), _log_rows(), ids=lambda v: str(v) if isinstance(v, int) else ""
)
def test_startup_rows_parse_to_their_observed_numbers(index: int, row: dict) -> None:
    parsed = parse_stream(row["raw"].splitlines())
    checked = 0
    for key, field in _CHECKS.items():
        expected = row["observed"].get(key)
        if expected is None:
            continue
        got = parsed.get(field)
        assert got is not None, f"row {index}: {field} not parsed"
        assert got == pytest.approx(expected, rel=0.011, abs=0.011), f"row {index}: {field}"
        checked += 1
    assert checked > 0
    assert not parsed.shows_failure


def test_startup_rows_args_give_model_tp_and_utilization() -> None:
    row = STARTUP_ROWS[19]  # TP=2 Llama-3.3-70B fp8 on H100, 0.19.0
    parsed = parse_stream(row["raw"].splitlines())
    assert parsed.get("model") == "RedHatAI/Llama-3.3-70B-Instruct-fp8-dynamic"
    assert parsed.get("tensor_parallel_size") == 2
    assert parsed.get("gpu_memory_utilization") == 0.95
    assert parsed.get("max_model_len") == 8192
    assert parsed.get("engine") == "v1"
    assert parsed.evidence("weights_gib").line == 2
    assert parsed.args["enable_prefix_caching"] is False


def test_v0_multiline_profiling_record() -> None:
    text = (
        "INFO 12-01 10:00:00 worker.py:267] Memory profiling takes 5.21 seconds\n"
        "the current vLLM instance can use total_gpu_memory (79.22GiB) x gpu_memory_utilization "
        "(0.90) = 71.29GiB\n"
        "model weights take 14.96GiB; non_torch_memory takes 1.79GiB; PyTorch activation peak "
        "memory takes 1.26GiB; the rest of the memory reserved for KV Cache is 53.29GiB.\n"
        "INFO 12-01 10:00:01 executor_base.py:110] # cuda blocks: 27284, # CPU blocks: 2048\n"
        "INFO 12-01 10:00:01 executor_base.py:115] Maximum concurrency for 8192 tokens "
        "per request: 53.29x\n"
    )
    p = parse_stream(text.splitlines())
    assert p.get("gpu_total_gib") == 79.22
    assert p.get("gpu_memory_utilization") == 0.9
    assert p.get("requested_gib") == 71.29
    assert p.get("weights_gib") == 14.96
    assert p.get("non_torch_gib") == 1.79
    assert p.get("activation_gib") == 1.26
    assert p.get("available_kv_gib") == 53.29
    assert p.get("gpu_blocks") == 27284
    assert p.get("concurrency_max_model_len") == 8192
    assert p.get("engine") == "v0"
    assert p.evidence("gpu_blocks").line == 4


def test_v1_recent_formats_with_process_tags_and_timestamps() -> None:
    text = [
        "2025-11-02T10:00:00.123456789Z (APIServer pid=7) INFO 11-02 10:00:00 [utils.py:233] "
        "non-default args: {'model_tag': 'Qwen/Qwen3-8B', 'model': 'Qwen/Qwen3-8B', "
        "'max_model_len': 32768, 'tensor_parallel_size': 2}",
        "(APIServer pid=7) INFO 11-02 10:00:01 [api_server.py:1] vLLM API server version 0.31.0",
        "\x1b[1;36m(Worker_TP1 pid=41)\x1b[0;0m INFO 11-02 10:00:30 [gpu_model_runner.py:2] Model "
        "loading took 7.63 GiB memory and 12.000000 seconds",
        "(Worker_TP0 pid=40) INFO 11-02 10:00:30 [gpu_model_runner.py:2] Model loading took 7.64 "
        "GiB memory and 12.000000 seconds",
        "(Worker_TP0 pid=40) INFO 11-02 10:00:40 [gpu_model_runner.py:3] Estimated CUDA graph "
        "memory: 0.84 GiB total",
        "(Worker_TP1 pid=41) INFO 11-02 10:00:41 [gpu_worker.py:4] Available KV "
        "cache memory: 60.1 GiB",
        "(Worker_TP0 pid=40) INFO 11-02 10:00:41 [gpu_worker.py:4] Available KV "
        "cache memory: 59.87 GiB",
        "(EngineCore_DP0 pid=30) INFO 11-02 10:00:42 [kv_cache_utils.py:5] GPU KV cache size: "
        "1,234,560 tokens, Maximum concurrency for 32,768 tokens per request: 37.68x",
        "(Worker_TP0 pid=40) INFO 11-02 10:00:50 [gpu_model_runner.py:6] CUDA graph pool memory: "
        "0.9 GiB (actual), 0.84 GiB (estimated), difference: 0.06 GiB (7.1%).",
    ]
    p = parse_stream(text)
    assert p.get("vllm_version") == "0.31.0"
    assert p.get("model") == "Qwen/Qwen3-8B"
    assert p.get("tensor_parallel_size") == 2
    assert p.get("weights_gib") == 7.63  # first rank stated
    assert p.get("available_kv_gib") == 59.87  # vLLM uses the minimum over ranks
    assert p.get("kv_tokens") == 1_234_560
    assert p.get("max_concurrency") == 37.68
    assert p.get("concurrency_max_model_len") == 32768
    assert p.get("cudagraph_estimate_gib") == 0.84
    assert p.get("cudagraph_actual_gib") == 0.9
    assert p.get("engine") == "v1"
    assert p.phase_reached == Phase.CUDA_GRAPH_CAPTURE
    assert not p.shows_failure


def test_cpu_backend_lines() -> None:
    text = [
        "(EngineCore_DP0 pid=1) INFO 01-01 00:00:00 [cpu_worker.py:1] Auto set (12.5/31.2) GiB for "
        "KV cache on node 0, with 28.7 GiB requested memory for the worker. 2.1 GiB memory was "
        "consumed by non-kv usages.",
        "(EngineCore_DP0 pid=1) INFO 01-01 00:00:01 [kv_cache_utils.py:2] CPU KV cache size: "
        "409,600 tokens, Maximum concurrency for 4,096 tokens per request: 100.00x",
    ]
    p = parse_stream(text)
    assert p.get("platform") == "cpu"
    assert p.get("available_kv_gib") == 12.5
    assert p.get("kv_tokens") == 409_600


@pytest.mark.parametrize(
    ("line", "expect"),
    [
        (
            "ValueError: To serve at least one request with the models's max seq len (32768), (4.0 "
            "GiB KV cache is needed, which is larger than the available KV cache memory (2.5 GiB). "
            "Based on the available memory, the estimated maximum model length is 20480. Try "
            "increasing `gpu_memory_utilization`",
            {
                "kv_error_max_model_len": 32768,
                "kv_needed_gib": 4.0,
                "kv_available_gib": 2.5,
                "estimated_max_model_len": 20480,
            },
        ),
        (
            "ValueError: To serve at least one request with the models's max seq len (131072), "
            "(16.00 GiB KV cache is needed, which is larger than the available KV cache memory "
            "(-1.44 GiB).  Try increasing",
            {"kv_error_max_model_len": 131072, "kv_needed_gib": 16.0, "kv_available_gib": -1.44},
        ),
        (
            "ValueError: Free memory on device cuda:0 (61.88/79.18 GiB) on startup is less than "
            "desired GPU memory utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or "
            "reduce GPU memory used by other processes.",
            {
                "startup_free_gib": 61.88,
                "startup_total_gib": 79.18,
                "gpu_memory_utilization": 0.9,
                "requested_gib": 71.27,
            },
        ),
        (
            "ValueError: Free memory on device (6.44/11.63 GiB) on startup is less than desired "
            "GPU memory utilization (0.9, 10.47 GiB).",
            {"startup_free_gib": 6.44, "gpu_memory_utilization": 0.9},
        ),
        (
            "ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks (524)",
            {"mamba_max_num_seqs": 1024, "mamba_cache_blocks": 524},
        ),
        (
            "INFO Auto-fit max_model_len: reduced from 131072 to 40960 to fit in available KV "
            "cache memory (12.5 GiB GPU)",
            {"auto_fit_reduced_to": 40960},
        ),
        (
            "INFO Initial free memory 78.5 GiB, reserved 20.0 GiB memory for KV Cache as specified "
            "by kv_cache_memory_bytes config",
            {"startup_free_gib": 78.5, "available_kv_gib": 20.0},
        ),
        (
            "INFO Free memory on device (78.6/79.19 GiB) on startup. Desired GPU memory "
            "utilization is (0.9, 71.27 GiB). Actual usage is 14.99 GiB for weight, 1.89 GiB for "
            "peak activation, 0.25 GiB for non-torch memory, and 0.91 GiB for CUDAGraph memory. "
            "Replace gpu_memory_utilization config with `--kv-cache-memory=1` (1 GiB)",
            {
                "weights_gib": 14.99,
                "activation_gib": 1.89,
                "non_torch_gib": 0.25,
                "cudagraph_actual_gib": 0.91,
            },
        ),
        (
            "DEBUG Memory profiling takes 3.10 seconds. Total non KV cache memory: 17.5GiB; torch "
            "peak memory increase: 1.9GiB; total consumed (from mem_get_info): 15.6GiB; "
            "weights memory: 14.99GiB.",
            {
                "non_kv_total_gib": 17.5,
                "activation_gib": 1.9,
                "total_consumed_gib": 15.6,
                "weights_gib": 14.99,
            },
        ),
        (
            "INFO 11-22 07:19:26 model_runner.py:1067] Loading model weights took 19.9073 GB",
            {"weights_gib": 19.9073},
        ),
        (
            "RuntimeError: CUDA out of memory occurred when warming up sampler with "
            "1024 dummy requests.",
            {"sampler_warmup_oom_seqs": 1024},
        ),
    ],
)
def test_message_texts(line: str, expect: dict) -> None:
    p = parse_stream([line])
    for field, value in expect.items():
        assert p.get(field) == pytest.approx(value), field


def test_cudagraph_hint_recovers_graph_memory() -> None:
    text = [
        "INFO Free memory on device (78.6/79.19 GiB) on startup is fine",
        "INFO CUDA graph memory profiling is enabled (default since v0.21.0). The current "
        "--gpu-memory-utilization=0.9200 is equivalent to --gpu-memory-utilization=0.9094 without "
        "CUDA graph memory profiling.",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.00 MiB is free.",
    ]
    p = parse_stream(text)
    assert p.get("cudagraph_estimate_gib") == pytest.approx((0.92 - 0.9094) * 79.19)


def test_pytorch_oom_new_format() -> None:
    row = OOM_ROWS[21]
    p = parse_stream(row["log"].splitlines())
    oom = p.first_oom
    assert oom is not None
    assert oom.tried_gib == pytest.approx(960 / 1024)
    assert oom.total_gib == 79.14
    assert oom.free_gib == pytest.approx(712.75 / 1024)
    assert oom.processes_gib == ((854401, 78.43),)
    assert oom.allocated_gib == 74.06
    assert oom.reserved_unallocated_gib == 2.22
    assert oom.private_pools_gib == pytest.approx(159.88 / 1024)
    assert oom.other_processes_gib == pytest.approx(0.0, abs=0.05)
    assert p.has("expandable_segments_hint")
    assert p.failure_phase is not None and p.failure_phase.value == Phase.SERVING


def test_pytorch_oom_old_format_and_co_tenant() -> None:
    p = parse_stream(OOM_ROWS[9]["log"].splitlines())
    oom = p.first_oom
    assert oom is not None
    assert oom.tried_gib == 1.63 and oom.total_gib == 44.56
    assert oom.reserved_gib == 27.93 and oom.allocated_gib == 27.91
    assert oom.reserved_unallocated_gib == pytest.approx(0.02)
    # 44.56 − 27.93 reserved − 0.55 free − 0.5 context ≈ 15.6 GiB held by others
    assert oom.other_processes_gib == pytest.approx(15.58, abs=0.05)


def test_reporter_wrapped_lines_are_joined() -> None:
    p = parse_stream(OOM_ROWS[0]["log"].splitlines())  # "KV cach\ne is needed"
    assert p.get("kv_needed_gib") == 4.26
    assert p.get("kv_available_gib") == 4.25
    p = parse_stream(OOM_ROWS[11]["log"].splitlines())  # "of which\n    120.88 MiB is free"
    assert p.first_oom is not None
    assert p.first_oom.free_gib == pytest.approx(120.88 / 1024)
    p = parse_stream(
        OOM_ROWS[31]["log"].splitlines()
    )  # "82.94 GiB,\ncurrent free memory 90.17 GiB"
    assert p.get("profiling_free_increase") == pytest.approx(90.17 - 82.94)


def test_ray_prefixes_and_repeats() -> None:
    p = parse_stream(OOM_ROWS[12]["log"].splitlines())
    assert p.get("gpu_memory_utilization") == 0.98
    assert p.get("weights_gib") == 20.64
    assert p.get("available_kv_gib") == 21.2
    assert p.failure_phase is not None and p.failure_phase.value == Phase.CUDA_GRAPH_CAPTURE


def test_interleaved_processes_keep_their_numbers() -> None:
    a = [
        f"(Worker_TP0 pid=1) INFO 01-01 00:00:0{i} [x.py:1] Model loading took 7.5 GiB "
        "memory and 1.0 seconds"
        for i in range(1)
    ]
    b = "(Worker_TP1 pid=2) INFO 01-01 00:00:01 [x.py:1] Available KV cache memory: 30.5 GiB"
    c = "(Worker_TP0 pid=1) INFO 01-01 00:00:01 [x.py:1] Available KV cache memory: 30.25 GiB"
    d = "(EngineCore_DP0 pid=3) INFO 01-01 00:00:02 [x.py:1] GPU KV cache size: 500,000 tokens"
    p = parse_stream([b, *a, d, c])
    assert p.get("available_kv_gib") == 30.25
    assert p.get("kv_tokens") == 500_000
    assert p.get("weights_gib") == 7.5


@pytest.mark.parametrize(
    ("line", "signature"),
    [
        ("Killed", "host_ram_kill"),
        ("[12345.6] Out of memory: Killed process 4242 (python3)", "host_ram_kill"),
        ("Worker exited with exit code -9", "host_ram_kill"),
        (
            "RuntimeError: Engine core initialization failed. Engine core proc "
            "EngineCore_DP0 died unexpectedly",
            "died_unexpectedly",
        ),
        (
            "RuntimeError: Aborted due to the lack of CPU swap space. Please "
            "increase the swap space",
            "cpu_swap_exhausted",
        ),
        (
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5",
            "nccl_error",
        ),
        ("ncclUnhandledCudaError: Call to CUDA function failed.", "nccl_error"),
        ("non-default args: {'model': 'x', 'enable_sleep_mode': True}", "sleep_mode"),
        (
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.",
            "expandable_segments_hint",
        ),
        ("env: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "expandable_segments_in_use"),
        (
            "INFO Encoder cache will be initialized with a budget of 16384 tokens, and profiled "
            "with 16 image items of the maximum feature size.",
            "mm_encoder_profile",
        ),
        (
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.",
            "no_cache_blocks",
        ),
        (
            'AssertionError: assert "expandable_segments:True" not in conf',
            "sleep_expandable_conflict",
        ),
    ],
)
def test_signatures(line: str, signature: str) -> None:
    assert parse_stream([line]).has(signature)


def test_expandable_hint_is_not_expandable_in_use() -> None:
    p = parse_stream(
        [
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
        ]
    )
    assert not p.has("expandable_segments_in_use")


def test_healthy_logs_show_no_failure() -> None:
    for row in STARTUP_ROWS:
        assert not parse_stream(row["raw"].splitlines()).shows_failure


def test_every_oom_case_shows_a_failure() -> None:
    for i, row in enumerate(OOM_ROWS):
        p = parse_stream(row["log"].splitlines())
        assert p.shows_failure or p.has("truncated_traceback"), i


def test_parse_file_errors(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="not found"):
        parse_file(tmp_path / "missing.log")
    with pytest.raises(BadInput, match="directory"):
        parse_file(tmp_path)


def test_parse_file_streams_with_invalid_utf8_and_long_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.log"
    path.write_bytes(
        b"\xff\xfe garbage \x00\x01\n"
        + b"A" * 500_000
        + b"\n"
        + b"INFO 01-01 00:00:00 [x.py:1] Available KV cache memory: 3.5 GiB\n"
    )
    p = parse_file(path)
    assert p.get("available_kv_gib") == 3.5
    assert p.evidence("available_kv_gib").line == 3
    assert p.lines == 3


def test_engine_config_dump_does_not_start_graph_capture() -> None:
    """vLLM prints its compilation config (with a ``cudagraph_capture_sizes`` key) before the
    weights load: an OOM in weight loading must not read as one after graph capture."""
    text = [
        "INFO [core.py:93] Initializing a V1 LLM engine (v0.32.0) with config: model='m', "
        "compilation_config={'cudagraph_num_of_warmups': 0, 'cudagraph_capture_sizes': [1, 2], "
        "'cudagraph_copy_inputs': False}",
        "INFO [gpu_model_runner.py:2007] Starting to load model m...",
    ]
    p = parse_stream(text)
    assert p.phase_reached == Phase.WEIGHT_LOADING
    assert Phase.CUDA_GRAPH_CAPTURE not in p.phases
    v0 = parse_stream(
        [
            "Graph capturing finished in 5 secs, took 0.47 GiB",
            "cudagraph_capture_sizes [2,1] (max_capture_size 2)",
        ]
    )
    assert Phase.CUDA_GRAPH_CAPTURE in v0.phases
