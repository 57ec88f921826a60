"""The doctor's mechanisms on realistic synthetic logs: graph capture seen from PyTorch's own
frames, phase-less OOMs told apart by the allocation and the frames, V0's full-length profiling
batch, encoder tracebacks cut short, allocations larger than the GPU, runtime headroom, tensor
parallelism before quantizing on multi-GPU machines, and process listings."""

from __future__ import annotations

import re

import pytest

from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.findings import Diagnosis
from oomguard.doctor.situation import Context
from oomguard.logs import parse_stream

SITE = "/usr/local/lib/python3.10/dist-packages"


def _diag(lines: list[str], **context: object) -> Diagnosis:
    return diagnose(parse_stream(lines), Context(**context))  # type: ignore[arg-type]


def _first(d: Diagnosis) -> tuple[str, str | None]:
    assert d.top is not None
    fix = d.top.ordered_fixes()[0]
    return fix.flag, fix.value


def _oom(tried: str, total: str, free: str, held: str, unalloc: str = "12.00 MiB") -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried}. GPU 0 has a "
        f"total capacity of {total} of which {free} is free. Including non-PyTorch memory, this "
        f"process has {held} memory in use. Of the allocated memory {held} is allocated by "
        f"PyTorch, and {unalloc} is reserved by PyTorch but unallocated. If reserved but "
        "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "to avoid fragmentation."
    )


# --- 1. CUDA-graph capture seen from torch/cuda/graphs.py --------------------------------------


def test_driver_oom_at_capture_end_is_cuda_graph() -> None:
    tag = "(VllmWorker rank=0 pid=812) ERROR 06-11 08:15:02 [multiproc_executor.py:470] "
    lines = [
        tag + "Traceback (most recent call last):",
        tag + f'  File "{SITE}/vllm/v1/worker/gpu_model_runner.py", line 2011, in capture_model',
        tag + "    self._dummy_run(num_tokens, skip_attn=True)",
        tag + f'  File "{SITE}/vllm/compilation/cuda_piecewise_backend.py", line 160, in __call__',
        tag + "    with torch.cuda.graph(cudagraph, pool=self.graph_pool):",
        tag + f'  File "{SITE}/torch/cuda/graphs.py", line 186, in __exit__',
        tag + "    self.cuda_graph.capture_end()",
        tag + "RuntimeError: CUDA error: out of memory",
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "cuda_graph"
    assert {f.flag for f in d.top.fixes} >= {"--enforce-eager", "--max-cudagraph-capture-size"}


# --- 2. no phase: the allocation, the frames and the weights decide -------------------------------


def test_batch_sized_allocation_without_phase_is_activation_not_weights() -> None:
    d = _diag([_oom("4.20 GiB", "39.39 GiB", "2.05 GiB", "37.31 GiB")])
    assert d.top is not None and d.top.cause == "concurrency_or_batch"
    assert "batch-sized" in d.top.summary
    weights = [f for f in d.findings if f.cause == "weights_dont_fit"]
    assert all(f.confidence < d.top.confidence for f in weights)


def test_small_allocation_with_the_process_filling_the_gpu_stays_weights() -> None:
    d = _diag([_oom("112.00 MiB", "14.58 GiB", "21.31 MiB", "14.52 GiB")])
    assert d.top is not None and d.top.cause == "weights_dont_fit"


def test_sampler_frames_without_phase_are_activation() -> None:
    lines = [
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/v1/sample/sampler.py", line 91, in forward',
        "    logits = self.apply_penalties(logits, sampling_metadata)",
        _oom("640.00 MiB", "79.19 GiB", "301.44 MiB", "78.87 GiB"),
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "concurrency_or_batch"


def test_weights_that_fit_are_never_said_not_to_fit() -> None:
    """19.9 GiB of weights on a 31.7 GiB GPU: whatever the finding, no 'do not fit' claim."""
    d = _diag(
        [_oom("300.00 MiB", "31.73 GiB", "120.00 MiB", "31.10 GiB")],
        model="meta-llama/Llama-2-13b-hf",
        gpu="V100 32GB (31.73 GiB)",
        args={"tensor_parallel_size": 1},
    )
    for finding in d.findings:
        m = re.search(
            r"weights \(~([\d.]+) GiB per GPU\) do not fit in ([\d.]+) GiB", finding.summary
        )
        if m:
            assert float(m.group(1)) >= float(m.group(2)), finding.summary


# --- 3. V0 profiles max_model_len tokens without chunked prefill --------------------------------

V0_PROFILE = [
    "INFO 08-02 11:20:31 llm_engine.py:176] Initializing an LLM engine (v0.5.3.post1) with config: "
    "model='mistralai/Mistral-7B-Instruct-v0.3', tokenizer='mistralai/Mistral-7B-Instruct-v0.3', "
    "dtype=torch.bfloat16, max_seq_len=32768, download_dir=None, tensor_parallel_size=1, "
    "enforce_eager=False, seed=0)",
    "INFO 08-02 11:20:52 model_runner.py:692] Loading model weights took 13.5083 GB",
    "Traceback (most recent call last):",
    f'  File "{SITE}/vllm/worker/worker.py", line 179, in determine_num_available_blocks',
    "    self.model_runner.profile_run()",
    f'  File "{SITE}/vllm/worker/model_runner.py", line 896, in profile_run',
    "    self.execute_model(model_input, kv_caches, intermediate_tensors)",
    _oom("3.00 GiB", "21.99 GiB", "1.12 GiB", "20.85 GiB"),
]


def test_v0_profiling_oom_with_a_long_context_lowers_max_model_len() -> None:
    d = _diag(V0_PROFILE)
    assert d.top is not None and d.top.cause == "concurrency_or_batch"
    flag, value = _first(d)
    assert flag == "--max-model-len"
    # 32768 tokens × 1.12/3.00 of the failed allocation = 12,233 → 8192
    assert value == "8192"
    assert not any(f.flag in ("--quantization", "--model") for f in d.top.fixes)


def test_v0_with_chunked_prefill_sizes_the_batch_instead() -> None:
    lines = [
        *V0_PROFILE[:1],
        "INFO 08-02 11:20:31 config.py:806] Chunked prefill is enabled with "
        "max_num_batched_tokens=4096.",
        *V0_PROFILE[1:],
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "concurrency_or_batch"
    assert "--max-model-len" not in {f.flag for f in d.top.fixes}
    assert ("--max-num-batched-tokens", "1024") in {(f.flag, f.value) for f in d.top.fixes}


# --- 4. tracebacks cut off inside an encoder -------------------------------------------------------


@pytest.mark.parametrize(
    "frames",
    [
        [
            f'  File "{SITE}/vllm/model_executor/models/mllama.py", line 1310, in forward',
            "    cross_attention_states = self.vision_model(pixel_values, aspect_ratio_ids,",
        ],
        [
            f'  File "{SITE}/vllm/v1/worker/gpu_model_runner.py", line 1120, in _execute_mm_encoder',
            "    curr_group_outputs = self.model.get_multimodal_embeddings(**batched_mm_inputs)",
            f'  File "{SITE}/vllm/model_executor/models/kimi_vl.py", line 401, in _process_image_input',
            f'  File "{SITE}/vllm/model_executor/models/moonvit.py", line 530, in forward',
            "    hidden_states = block(hidden_states, cu_seqlens)",
        ],
    ],
)
def test_truncated_encoder_traceback_is_multimodal(frames: list[str]) -> None:
    d = _diag(["ERROR 05-11 09:41:40 [core.py:396] EngineCore hit an exception:", *frames])
    assert d.oom_found
    assert d.top is not None and d.top.cause == "multimodal_encoder"
    assert "--max-num-seqs" in {f.flag for f in d.top.fixes}


def test_truncated_text_model_traceback_without_phase_is_not_an_oom() -> None:
    d = _diag(
        [
            f'  File "{SITE}/vllm/model_executor/models/llama.py", line 310, in forward',
            "    hidden_states = self.mlp(hidden_states)",
        ]
    )
    assert not d.oom_found


# --- 5. one allocation larger than the GPU ---------------------------------------------------------


def test_allocation_larger_than_the_gpu_is_not_a_full_gpu() -> None:
    d = _diag([_oom("118.52 GiB", "79.19 GiB", "52.40 GiB", "26.79 GiB")])
    assert d.top is not None and d.top.cause == "other"
    assert "larger than the whole device" in d.top.summary
    assert d.top.ordered_fixes()[0].flag == "action"
    assert "flash-attn" in str(d.top.ordered_fixes()[0].value)
    assert "--gpu-memory-utilization" not in {f.flag for f in d.top.fixes}


def test_allocation_larger_than_the_gpu_in_a_vision_tower_is_multimodal() -> None:
    lines = [
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/model_executor/models/siglip.py", line 377, in forward',
        "    attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) * self.scale",
        _oom("61.03 GiB", "44.40 GiB", "30.11 GiB", "14.29 GiB"),
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "multimodal_encoder"
    assert "--gpu-memory-utilization" not in {f.flag for f in d.top.fixes}


# --- 6. runtime headroom, graded ---------------------------------------------------------------------

RUNTIME = [
    "INFO 10-11 12:00:00 api_server.py:528] vLLM API server version 0.6.3",
    "INFO 10-11 12:20:11 metrics.py:351] Avg prompt throughput: 812.3 tokens/s, Avg generation "
    "throughput: 1630.2 tokens/s, Running: 212 reqs, GPU KV cache usage: 97.1%, CPU KV cache usage: 0.0%.",
    "ERROR 10-11 12:27:29 engine.py:157] Traceback (most recent call last):",
    f'ERROR 10-11 12:27:29 engine.py:157]   File "{SITE}/vllm/engine/multiprocessing/engine.py", '
    "line 218, in run_engine_loop",
    "ERROR 10-11 12:27:29 engine.py:157]     request_outputs = self.engine_step()",
]


def test_small_runtime_allocation_with_the_headroom_gone_is_utilization() -> None:
    d = _diag([*RUNTIME, _oom("96.00 MiB", "79.15 GiB", "4.19 MiB", "79.11 GiB")])
    assert d.top is not None and d.top.cause == "util_overshoot"
    flag, value = _first(d)
    assert flag == "--gpu-memory-utilization" and value is not None and float(value) < 0.9


def test_runtime_allocation_that_takes_the_headroom_is_a_batch_spike() -> None:
    d = _diag([*RUNTIME, _oom("6.10 GiB", "79.15 GiB", "1.02 GiB", "78.10 GiB")])
    assert d.top is not None and d.top.cause == "concurrency_or_batch"


def test_multi_step_buffers_count_as_runtime_consumers() -> None:
    lines = [*RUNTIME, _oom("4.50 GiB", "79.15 GiB", "1.02 GiB", "78.10 GiB")]
    without = _diag(lines)
    assert without.top is not None and without.top.cause == "concurrency_or_batch"
    d = _diag(lines, args={"num_scheduler_steps": 16, "gpu_memory_utilization": 0.94})
    assert d.top is not None and d.top.cause == "util_overshoot"
    batch = next(f for f in d.findings if f.cause == "concurrency_or_batch")
    assert ("--num-scheduler-steps", "8") in {(f.flag, f.value) for f in batch.fixes}


# --- 7. tensor parallelism first when the GPUs are there ------------------------------------------

WEIGHTS_OOM = [
    "INFO 02-01 10:00:00 llm_engine.py:70] Initializing an LLM engine with config: "
    "model='meta-llama/Llama-2-13b-hf', dtype=torch.float16, tensor_parallel_size=1",
    "Traceback (most recent call last):",
    f'  File "{SITE}/vllm/model_executor/model_loader.py", line 80, in get_model',
    "    model.load_weights(model_config.model, model_config.download_dir)",
    _oom("270.00 MiB", "14.58 GiB", "101.31 MiB", "14.48 GiB"),
]


def test_one_gpu_quantizes_first() -> None:
    d = _diag(WEIGHTS_OOM, gpu="Tesla T4 16GB (14.58 GiB)")
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    flags = [f.flag for f in d.top.ordered_fixes()]
    assert flags.index("--tensor-parallel-size") > min(
        flags.index(f) for f in ("--quantization", "--model") if f in flags
    )


@pytest.mark.parametrize("gpu", ["4x Tesla T4 16GB (14.58 GiB)", "AWS g4dn.12xlarge (4x T4 16GB)"])
def test_several_gpus_offer_tensor_parallelism_first(gpu: str) -> None:
    d = _diag(WEIGHTS_OOM, gpu=gpu)
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    flag, value = _first(d)
    assert flag == "--tensor-parallel-size" and value is not None and int(value) <= 4


def test_tensor_parallel_already_in_use_puts_tensor_parallelism_first() -> None:
    lines = [WEIGHTS_OOM[0].replace("tensor_parallel_size=1", "tensor_parallel_size=2")]
    d = _diag([*lines, *WEIGHTS_OOM[1:]], gpu="Tesla T4 16GB (14.58 GiB)")
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    assert _first(d)[0] == "--tensor-parallel-size"


# --- 8. process listings --------------------------------------------------------------------------

STARTUP_SHORT = (
    "(EngineCore_0 pid=2210) ERROR 09-03 11:03:37 [core.py:712] ValueError: Free memory on device "
    "(48.61/79.25 GiB) on startup is less than desired GPU memory utilization (0.9, 71.33 GiB). "
    "Decrease GPU memory utilization or reduce GPU memory used by other processes."
)


def test_listed_engine_holding_memory_at_startup_is_a_leftover() -> None:
    without = _diag([STARTUP_SHORT])
    assert without.top is not None and without.top.cause == "util_overshoot"
    listing = [
        "$ nvidia-smi",
        "|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |",
        "|    0   N/A  N/A     17733      C   VLLM::EngineCore                            30312MiB |",
    ]
    d = _diag([*listing, STARTUP_SHORT])
    assert d.top is not None and d.top.cause == "leak_or_other_process"
    assert d.top.ordered_fixes()[0].flag == "action"
    assert "17733" in str(d.top.ordered_fixes()[0].value)


def test_ps_listing_of_a_running_server_at_startup_is_a_leftover() -> None:
    ps = (
        "root       17733  3.1  2.0 60213344 3322104 ?  Sl  Sep02 131:10 /usr/bin/python3 -m "
        "vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-32B-Instruct"
    )
    d = _diag(["$ ps aux | grep vllm", ps, STARTUP_SHORT])
    assert d.top is not None and d.top.cause == "leak_or_other_process"


def test_listing_with_an_expected_cotenant_stays_a_budget_question() -> None:
    listing = "|    0   N/A  N/A     17733      C   python3                                     30312MiB |"
    d = _diag([listing, STARTUP_SHORT], expect_cotenant=True)
    assert d.top is not None and d.top.cause == "util_overshoot"


def test_prose_and_listing_without_an_oom_line_are_weak_evidence() -> None:
    # a stated failure is a failure (exit 0), but without a log line every finding stays
    # below what a log line earns; a host-memory table (MEM(GB) per process) points to RAM
    lines = [
        "I deployed the model and right after the service started it hit an out-of-memory (OOM) er",
        "|    0   N/A  N/A     17733      C   python3                                     10312MiB |",
        "PID     MEM(GB) COMMAND",
        "40126   11.20   ray::WorkerDict.actor_rollout_generate_sequences",
    ]
    d = _diag(lines)
    assert d.oom_found and d.top is not None
    assert all(f.confidence <= 0.62 for f in d.findings)
    assert d.top.cause == "cpu_ram"


# --- 9. the scorers' reading of a recorded fix ------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "lever"),
    [
        ("lower --gpu-memory-utilization (reporter's finding)", ("util", "down")),
        ("smaller --max-model-len", ("max_model_len", "down")),
        ("Fixed by setting max_seq_len=8192", ("max_model_len", "down")),
        ("--max-num-seqs lowered", ("max_num_seqs", "down")),
        ("install flash-attention", ("action", "change")),
        ("more host RAM", ("action", "change")),
        ("raise gpu_memory_utilization", ("util", "up")),
    ],
)
def test_scorer_reads_common_fix_phrasings(text: str, lever: tuple[str, str]) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    from doctor_accuracy import worked_levers

    assert lever in worked_levers(text)


# --- empty KV pool stated by numbers, cut OOM messages, unbounded allocations in a VLM --------


def _v0_profile(total: str, util: str, weights: str, act: str, kv: str, blocks: int) -> list[str]:
    pre = "INFO 03-02 10:11:12 worker.py:267] "
    return [
        f"INFO 03-02 10:11:09 model_runner.py:1115] Loading model weights took {weights} GB",
        pre + f"the current vLLM instance can use total_gpu_memory ({total}GiB) x "
        f"gpu_memory_utilization ({util}) = {float(total) * float(util):.2f}GiB",
        pre + f"model weights take {weights}GiB; non_torch_memory takes 0.05GiB; PyTorch "
        f"activation peak memory takes {act}GiB; the rest of the memory reserved for KV Cache "
        f"is {kv}GiB.",
        f"INFO 03-02 10:11:12 executor_base.py:111] # cuda blocks: {blocks}, # CPU blocks: 2048",
        "[rank0]: Traceback (most recent call last):",
    ]


def test_negative_kv_budget_without_the_error_line_is_a_failure_a_raise_fixes() -> None:
    # 16 GiB card at 0.6: weights 7.5 + activations 2.1 exceed 9.6 GiB, but fit well under 0.9
    d = _diag(_v0_profile("16.00", "0.60", "7.50", "2.10", "-0.05", 0))
    assert d.oom_found and d.top is not None
    assert d.top.cause == "kv_too_small_for_max_len"
    flag, value = _first(d)
    assert flag == "--gpu-memory-utilization" and value is not None
    assert 0.6 < float(value) <= 0.9
    assert any("KV Cache is -0.05GiB" in e.text for e in d.top.evidence)


def test_negative_kv_budget_at_a_high_utilization_with_heavy_weights_is_weights() -> None:
    # 16 GiB card at 0.9: weights 14.2 leave no room at any utilization vLLM accepts
    d = _diag(_v0_profile("16.00", "0.90", "14.20", "1.10", "-0.95", 0))
    assert d.top is not None and d.top.cause == "weights_dont_fit"


def test_a_positive_pool_is_not_an_empty_one() -> None:
    d = _diag(_v0_profile("16.00", "0.90", "7.50", "2.10", "4.70", 2406)[:-1])
    assert not d.oom_found


def test_oom_message_cut_inside_the_sampler_warmup_traceback() -> None:
    tag = "(Worker pid=4411) ERROR 10-02 09:00:01 [multiproc_executor.py:671] "
    lines = [
        tag + "Traceback (most recent call last):",
        tag
        + f'  File "{SITE}/vllm/v1/worker/gpu_worker.py", line 390, in compile_or_warm_up_model',
        tag + "    self.model_runner._dummy_sampler_run(",
        tag
        + f'  File "{SITE}/vllm/v1/worker/gpu_model_runner.py", line 3221, in _dummy_sampler_run',
        tag + "    raise RuntimeError(",
        tag + "RuntimeError: CUDA out of",
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "concurrency_or_batch"
    assert "--max-num-seqs" in [f.flag for f in d.top.ordered_fixes()]
    assert "1024 dummy requests" not in d.top.summary  # the count was not stated
    # the same cut message outside any traceback is still a stated failure
    assert _diag(["RuntimeError: CUDA out of"]).oom_found


def test_allocation_larger_than_the_gpu_in_a_vision_language_model_is_the_encoder() -> None:
    line = "RuntimeError: Worker failed with error '" + _oom(
        "812.00 GiB", "79.35 GiB", "19.23 GiB", "58.52 GiB"
    )
    text_only = _diag([line])
    assert text_only.top is not None and text_only.top.cause == "other"
    by_name = _diag([line], model="Qwen/Qwen2.5-VL-7B-Instruct")
    assert by_name.top is not None and by_name.top.cause == "multimodal_encoder"
    by_args = _diag([line], args={"limit_mm_per_prompt": {"image": 32}})
    assert by_args.top is not None and by_args.top.cause == "multimodal_encoder"
    assert by_args.top.ordered_fixes()[0].flag == "action"  # the attention backend first


def _v0_blocks_then(tail: list[str]) -> list[str]:
    return [
        "INFO 03-20 19:18:21 llm_engine.py:72] Initializing an LLM engine with config: "
        "model='/models/chat-4b', dtype=torch.bfloat16, max_seq_len=32768, "
        "tensor_parallel_size=1, enforce_eager=True, kv_cache_dtype=auto, seed=0)",
        "INFO 03-20 19:18:27 llm_engine.py:322] # GPU blocks: 1842, # CPU blocks: 655",
        *tail,
    ]


def test_kv_capacity_below_max_len_then_a_traceback_is_the_fit_check() -> None:
    # 1842 blocks × 16 = 29,472 tokens < 32,768; the launcher's logger prefixes the traceback
    d = _diag(
        _v0_blocks_then(
            [
                "2024-03-20 19:18:27 | ERROR | stderr | Traceback (most recent call last):",
                '2024-03-20 19:18:27 | ERROR | stderr |   File "/srv/worker.py", line 290, in <module>',
                "2024-03-20 19:18:27 | ERROR | stderr |     engine = AsyncLLMEngine.from_engine_args(a)",
            ]
        )
    )
    assert d.top is not None and d.top.cause == "kv_too_small_for_max_len"
    assert "29,472" in d.top.summary
    flag, value = _first(d)
    assert flag == "--max-model-len" and value is not None and int(value) <= 29472


def test_kv_capacity_below_max_len_without_a_failure_is_not_diagnosed() -> None:
    assert not _diag(
        _v0_blocks_then(["INFO 03-20 19:18:30 api_server.py:1] Started server"])
    ).oom_found
    # vLLM itself counting a whole request as fitting (a sliding-window pool) is no failure
    v1 = [
        "(EngineCore_DP0 pid=1) INFO 08-06 10:00:00 [core.py:77] Initializing a V1 LLM engine "
        "(v0.10.1) with config: model='m', max_seq_len=131072, tensor_parallel_size=1",
        "(EngineCore_DP0 pid=1) INFO 08-06 10:00:09 [kv_cache_utils.py:833] GPU KV cache size: "
        "90,000 tokens",
        "(EngineCore_DP0 pid=1) INFO 08-06 10:00:09 [kv_cache_utils.py:837] Maximum concurrency "
        "for 131,072 tokens per request: 2.95x",
        "(APIServer pid=1) ERROR 08-06 10:05:00 [serving_chat.py:1] Traceback (most recent call last):",
        '(APIServer pid=1) ERROR 08-06 10:05:00 [serving_chat.py:1]   File "/x/serving_chat.py", line 9, in f',
        "(APIServer pid=1) ERROR 08-06 10:05:00 [serving_chat.py:1] KeyError: 'tool_calls'",
    ]
    assert not _diag(v1).oom_found


def test_a_warmup_over_the_vocabulary_outranks_the_change_that_introduced_it() -> None:
    d = _diag(
        [
            "The warmup allocation is 4.64 GiB (max_num_seqs=1024 × 8 positions × vocab_size "
            "151,936 × 4 bytes), introduced by the PR that added spec-decode-aware warmup.",
            "CI fails with CUDA OOM in that step.",
        ]
    )
    assert d.top is not None and d.top.cause == "concurrency_or_batch"


# --- mechanisms read from words and from the log's own headers ---------------------------------


def test_kv_cache_said_to_be_insufficient_is_the_length_check() -> None:
    d = _diag(
        [
            "The engine crashes immediately at startup due to insufficient KV cache memory; "
            "the server never starts.",
        ]
    )
    assert d.oom_found and d.top is not None
    assert d.top.cause == "kv_too_small_for_max_len"
    assert _first(d)[0] == "--max-model-len"
    # the same words in Chinese
    d = _diag(["启动时报错, KV cache 不足, 服务起不来"])
    assert d.top is not None and d.top.cause == "kv_too_small_for_max_len"


def test_v1_logger_file_dates_a_bare_no_blocks_error_and_the_batch_comes_first() -> None:
    """`[core.py:…]` is the V1 engine core: with a short max_model_len at utilization 0.9 and
    TP 2, the profiling batch is the term to cut, not NCCL fragmentation (a V0-era mechanism)."""
    lines = [
        "vllm serve some/model --tensor-parallel-size 2 --gpu-memory-utilization 0.9 "
        "--max-model-len 4096 --enforce-eager",
        "ERROR 04-27 11:08:32 [core.py:340] ValueError: No available memory for the cache "
        "blocks. Try increasing `gpu_memory_utilization` when initializing the engine.",
    ]
    d = _diag(lines)
    assert d.parsed.get("engine") == "v1"
    assert d.top is not None and d.top.cause == "concurrency_or_batch"
    flag, value = _first(d)
    assert flag == "--max-num-seqs" and value is not None and int(value) < 1024
    assert "fragmentation" not in {f.cause for f in d.findings}
    # the same error from V0's worker keeps the TP fragmentation reading
    v0 = [lines[0], lines[1].replace("[core.py:340]", "[worker.py:340]")]
    d0 = _diag(v0)
    assert d0.parsed.get("engine") == "v0"
    assert d0.top is not None and d0.top.cause == "fragmentation"


def test_a_large_co_tenant_outranks_a_small_fragmented_remainder() -> None:
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 320.00 MiB. GPU 0 has a "
        "total capacity of 22.05 GiB of which 113.62 MiB is free. Process 198 has 13.57 GiB "
        "memory in use. Including non-PyTorch memory, this process has 7.79 GiB memory in use. "
        "Of the allocated memory 6.79 GiB is allocated by PyTorch, and 778.05 MiB is reserved "
        "by PyTorch but unallocated."
    )
    d = _diag([text])
    causes = [f.cause for f in d.findings]
    assert causes[0] in ("leak_or_other_process", "util_overshoot")
    assert causes.index("fragmentation") > 0
    # without the co-tenant the same remainder is fragmentation
    alone = text.replace("Process 198 has 13.57 GiB memory in use. ", "").replace(
        "this process has 7.79 GiB", "this process has 21.79 GiB"
    )
    assert _diag([alone]).top.cause == "fragmentation"  # type: ignore[union-attr]


def test_a_worker_that_exits_with_minus_9_was_killed_for_host_ram() -> None:
    d = _diag(["vLLM crashes with ChildProcessError: worker died. One worker exits with code -9."])
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_memory_said_insufficient_beside_swap_space_is_host_ram() -> None:
    d = _diag(
        ["My memory is insufficient. Setting --swap-space 0 alleviates it; the host has 30GB."]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_chinese_overflow_on_the_first_card_only_is_weights_on_one_gpu() -> None:
    d = _diag(
        [
            "机器：8*a100 40g",
            "发现第一张卡的显存增加直到溢出，其他卡的显存不变。",
            "INFO 12-26 08:53:29 llm_engine.py:72] Initializing an LLM engine with config: "
            "model='Qwen/Qwen-72B-Chat-Int4', tokenizer='Qwen/Qwen-72B-Chat-Int4', "
            "dtype=torch.float16, max_seq_len=32768, tensor_parallel_size=1, quantization=gptq",
        ]
    )
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    assert _first(d)[0] == "--tensor-parallel-size"


def test_chinese_solution_lowering_the_token_length_is_the_context() -> None:
    d = _diag(
        ["运行时遇到了OOM,显存空间不够的崩溃。解决方案就是设置降低模型的token长度,就可解决。"]
    )
    assert d.top is not None and d.top.cause == "kv_too_small_for_max_len"


def test_a_code_fix_that_resolved_it_is_not_a_setting() -> None:
    d = _diag(
        [
            "Ran out of memory shortly after launching. Will try a shorter context length.",
            "Edit: the branch didn't include the fix mentioned in his PR yet. It works with the "
            "fixes!",
        ]
    )
    assert d.top is not None and d.top.cause == "other"


def test_failure_that_outlives_every_setting_is_the_weights() -> None:
    d = _diag(
        [
            "The target loads, then the drafter loads and OOM.",
            "I drop memory utilization to 0.92, I reload. OOM. I switch to --enforce-eager to "
            "save the CUDA graphs. OOM. I test max-model-len at 8K to shrink the buffers. OOM, "
            "every time, at the same height.",
        ]
    )
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    # one setting that did help names its cause instead
    helped = _diag(
        [
            "I drop memory utilization to 0.92, I reload. OOM. I switch to --enforce-eager. "
            "OOM. Setting --max-model-len 8192 fixed it.",
        ]
    )
    assert helped.top is not None and helped.top.cause == "kv_too_small_for_max_len"


def test_tried_every_listed_parameter_eliminates_the_settings() -> None:
    d = _diag(
        [
            'extraArgs: ["--enforce-eager", "--max_num_seqs=1", "--gpu-memory-utilization=0.99", '
            '"--max-model-len=1000"]',
            "I tried multiple combinations of the above parameters, all of which result in this:",
            _oom("1.25 GiB", "93.02 GiB", "1.18 GiB", "91.82 GiB"),
        ]
    )
    assert d.top is not None and d.top.cause == "weights_dont_fit"


def test_curly_quotes_in_a_pasted_args_line_are_read() -> None:
    d = _diag(
        [
            "INFO 09-13 13:31:16 [cli_args.py:261] non-default args: {‘model’: "
            "‘mistralai/Mistral-7B-Instruct-v0.2’, ‘max_model_len’: 16384, "
            "‘max_num_batched_tokens’: 200000}",
        ]
    )
    assert d.parsed.get("max_num_batched_tokens") == 200000
    assert d.parsed.get("max_model_len") == 16384


def test_rocm_out_of_resources_after_graph_capture_is_cuda_graph() -> None:
    d = _diag(
        [
            'The engine aborted at init with HSA_STATUS_ERROR_OUT_OF_RESOURCES ("Available Free '
            'mem : 0 MB") right after CUDA graph capture.',
        ]
    )
    assert d.top is not None and d.top.cause == "cuda_graph"
    assert _first(d)[0] == "--enforce-eager"


def test_chinese_gpu_memory_not_released_after_a_failed_launch_is_a_leftover() -> None:
    d = _diag(["启动失败后发现oom了, 将后台任务杀掉之后gpu并没有得到释放, 还在被占用"])
    assert d.top is not None and d.top.cause == "leak_or_other_process"


def test_chinese_ram_used_up_and_killed_is_host_memory() -> None:
    d = _diag(["推理时mem会用完，并自动kill。500G内存都不够吗？"])
    assert d.top is not None and d.top.cause == "cpu_ram"
    # GPU memory (显存) exceeded is not host memory
    d = _diag(["部署7b模型总是会报超过显存的问题"])
    assert d.oom_found and d.top is not None and d.top.cause != "cpu_ram"


def test_docker_command_gpu_in_chinese_and_a_local_path_find_the_weights() -> None:
    """`docker run … vllm/vllm-openai --model /data/…/Qwen2.5-VL-7B-Instruct` on a card named
    inside Chinese text: the catalogue's 8.3B-parameter model does not fit 16 GB in fp16."""
    d = _diag(
        [
            "启动vllm server 的时候显存爆了，显卡是GTX4060ti (16G)",
            "docker run --runtime nvidia --gpus all --name v -p 8110:8000 -d "
            "vllm/vllm-openai:latest --model /data/qwen2.5/Qwen2.5-VL-7B-Instruct --dtype "
            "float16 --gpu-memory-utilization 0.8 --max-num-seqs 32",
        ]
    )
    assert d.parsed.get("model") == "/data/qwen2.5/Qwen2.5-VL-7B-Instruct"
    assert d.derived["weights_per_gpu_gib"]["from"] == "facts"
    assert d.top is not None and d.top.cause == "weights_dont_fit"


def test_weights_quoted_as_gb_of_weights_are_read() -> None:
    d = _diag(
        ["Init OOMs with ~400 MiB free: the draft head is 5.11 GB on top of 25.42 GB of weights."]
    )
    assert d.parsed.get("said_weights_gib") == 25.42


def test_namespace_line_cut_by_the_reporter_is_still_read() -> None:
    d = _diag(
        [
            "INFO 05-13 21:09:20 [api_server.py:1044] args: Namespace(host=None, port=8000, "
            "model='/m/Qwen2.5-7B-Instruct', dtype='float16', max_model_len=None, ...",
        ]
    )
    assert d.parsed.get("model") == "/m/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize(
    "text",
    [
        # curly quotes and a mistyped "seq"
        "The model’s max sew len (32768) is larger than the maximum number of tokens that can be "
        "stored in KV cache (18896). Try increasing ‘gpu_memory_utilization’ or decreasing "
        "‘max_model_len’ when initializing the engine.",
        # abridged by the reporter
        "ValueError: 1.75 GiB KV cache is needed, available 0.13 GiB",
        # an issue title cut after the first figure
        "ValueError: The model's max seq len (32768)",
        # V0's scheduler refusing a prompt longer than the whole cache
        "Input prompt (3916 tokens) is too long and exceeds the capacity of block_manager",
        # told in words
        "The generated config sets max_model_len=131072 but does not allocate enough GPU memory "
        "for the corresponding KV cache; all prefill workers crash on startup.",
    ],
)
def test_forms_of_the_kv_fit_failure(text: str) -> None:
    d = _diag([text])
    assert d.oom_found and d.top is not None
    assert d.top.cause == "kv_too_small_for_max_len"


def test_kv_capacity_from_a_curly_quoted_message_gives_the_length_fix() -> None:
    d = _diag(
        [
            "The model’s max seq len (32768) is larger than the maximum number of tokens that can "
            "be stored in KV cache (18896)."
        ]
    )
    flag, value = _first(d)
    assert flag == "--max-model-len" and value is not None and int(value) <= 18896


@pytest.mark.parametrize(
    "text",
    [
        "总是报显存过小问题，设置了一些参数也没有用",
        "部署时max-model-len 128k报错cuda out of menory",
    ],
)
def test_more_ways_of_saying_memory_ran_out(text: str) -> None:
    assert _diag([text]).oom_found


def test_weight_loading_oom_on_a_gpu_another_process_fills_is_the_co_tenant() -> None:
    d = _diag(
        [
            _oom("64.00 MiB", "79.20 GiB", "48.62 MiB", "2.46 GiB"),
            "Loading safetensors checkpoint shards:  13% Completed | 2/15 [00:01<00:11,  1.12it/s]",
        ]
    )
    assert d.top is not None and d.top.cause == "leak_or_other_process"
    # the same failure with the GPU to itself is the weights
    alone = _diag(
        [
            _oom("64.00 MiB", "79.20 GiB", "48.62 MiB", "79.10 GiB"),
            "Loading safetensors checkpoint shards:  13% Completed | 2/15 [00:01<00:11,  1.12it/s]",
        ]
    )
    assert alone.top is not None and alone.top.cause == "weights_dont_fit"


def test_a_vision_encoder_in_the_model_s_own_code_is_the_encoder() -> None:
    d = _diag(
        [
            "Traceback (most recent call last):",
            '  File "/home/u/DeepSeek-OCR-vllm/deepencoder/sam_vary_sdpa.py", line 309, in forward',
            "    attn_bias = (rel_h + rel_w).view(B, self.num_heads, -1)",
            _oom("352.00 MiB", "11.75 GiB", "278.19 MiB", "10.65 GiB", unalloc="368.49 MiB"),
        ]
    )
    assert d.top is not None and d.top.cause == "multimodal_encoder"


def test_an_oversized_cuda_graph_estimate_that_left_no_blocks_is_cuda_graph() -> None:
    d = _diag(
        [
            "(Worker_TP0 pid=5) INFO 08-19 05:56:57 [gpu_model_runner.py:6936] Estimated CUDA "
            "graph memory: 118.65 GiB total",
            "(EngineCore_DP0 pid=4) ERROR 08-19 05:56:57 [core.py:1346] ValueError: No available "
            "memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine.",
        ]
    )
    assert d.top is not None and d.top.cause == "cuda_graph"
    flags = [f.flag for f in d.top.ordered_fixes()]
    assert "--enforce-eager" in flags and "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS" in flags
    # a small estimate is not blamed
    small = _diag(
        [
            "(Worker_TP0 pid=5) INFO 08-19 05:56:57 [gpu_model_runner.py:6936] Estimated CUDA "
            "graph memory: 0.40 GiB total",
            "(EngineCore_DP0 pid=4) ERROR 08-19 05:56:57 [core.py:1346] ValueError: No available "
            "memory for the cache blocks.",
        ]
    )
    assert "cuda_graph" not in {f.cause for f in small.findings}


def test_a_traceback_cut_inside_the_kv_cache_allocation_is_the_budget() -> None:
    site = "/opt/conda/lib/python3.10/site-packages/vllm"
    d = _diag(
        [
            "Traceback (most recent call last):",
            f'  File "{site}/engine/llm_engine.py", line 276, in __init__',
            "    self._initialize_kv_caches()",
            f'  File "{site}/engine/llm_engine.py", line 429, in _initialize_kv_caches',
            "    self.model_executor.initialize_cache(num_gpu_blocks, num_cpu_blocks)",
            f'  File "{site}/executor/executor_base.py", line 121, in initialize_cache',
            "    self.coll",
        ]
    )
    assert d.oom_found and d.top is not None and d.top.cause == "util_overshoot"
    assert _first(d)[0] == "--gpu-memory-utilization"


def test_dev_shm_too_small_is_host_memory_with_the_container_fix() -> None:
    d = _diag(
        [
            "[2026-03-25 05:44:29,435 W 39 39] (raylet) store_runner.cc:83: System memory "
            "request exceeds memory available in /dev/shm. The request is for 10200547328 bytes, "
            "and the amount available is 9663676416 bytes.",
        ]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"
    assert "--ipc=host" in (d.top.ordered_fixes()[0].value or "")


def test_memory_held_before_a_second_engine_started_is_the_other_process() -> None:
    d = _diag(
        [
            "INFO 11-21 10:00:00 worker.py:232] Memory profiling results: "
            "total_gpu_memory=79.15GiB initial_memory_usage=68.01GiB peak_torch_memory=70.2GiB",
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.",
        ]
    )
    assert d.top is not None and d.top.cause == "leak_or_other_process"
    # a co-tenant the user says is meant to be there is not a leftover
    meant = _diag(
        [
            "INFO 11-21 10:00:00 worker.py:232] Memory profiling results: "
            "total_gpu_memory=79.15GiB initial_memory_usage=68.01GiB peak_torch_memory=70.2GiB",
            "ValueError: No available memory for the cache blocks.",
        ],
        expect_cotenant=True,
    )
    assert "leak_or_other_process" not in {f.cause for f in meant.findings}


def test_wsl_refusing_to_make_memory_resident_turns_expandable_segments_off() -> None:
    d = _diag(
        [
            "Every failure coincides with this WSL kernel message:",
            "dxgkio_make_resident: Ioctl failed: -12",
            "RuntimeError: CUDA driver error: device not ready",
        ]
    )
    assert d.top is not None and d.top.cause == "other"
    assert d.top.ordered_fixes()[0].value == "expandable_segments:False"
