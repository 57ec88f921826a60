"""The doctor on partial input (titles, summaries, descriptions) and on host-memory failures:
each mechanism on a realistic synthetic text, never a copy of a collected case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.cli import main
from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.findings import Diagnosis
from oomguard.doctor.situation import Context
from oomguard.logs import parse_stream

SITE = "/opt/conda/lib/python3.11/site-packages"


def _diag(lines: list[str], **context: object) -> Diagnosis:
    return diagnose(parse_stream(lines), Context(**context))  # type: ignore[arg-type]


def _flags(d: Diagnosis) -> list[str]:
    assert d.top is not None
    return [f.flag for f in d.top.ordered_fixes()]


# --- 1. statements in prose ---------------------------------------------------------------------


def test_stated_workaround_names_the_mechanism() -> None:
    d = _diag(
        [
            "vllm 0.9.1, Mixtral on 2x L40S",
            "Startup dies with CUDA OOM no matter the max-model-len. Running fine with "
            "--enforce-eager though, about 30% slower.",
        ]
    )
    assert d.oom_found and d.top is not None
    assert d.top.cause == "cuda_graph"
    assert d.top.confidence <= 0.62  # prose stays below what a log line earns
    assert set(_flags(d)) >= {"--enforce-eager", "--max-cudagraph-capture-size"}


def test_workaround_sentence_that_avoids_the_oom_still_states_one() -> None:
    d = _diag(["Had to reduce max_num_seqs to 16 to avoid the OOM during lm-eval runs"])
    assert d.oom_found and d.top is not None
    assert d.top.cause == "concurrency_or_batch"
    assert _flags(d)[0] == "--max-num-seqs"


def test_named_model_and_gpu_whose_weights_do_not_fit() -> None:
    d = _diag(
        [
            "`vllm serve org/chat-model-110b --dtype bfloat16` runs out of memory on a "
            "single L40S 48GB, what am I doing wrong?"
        ]
    )
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    assert {"--tensor-parallel-size", "--model", "--quantization"} & set(_flags(d))


def test_server_that_was_serving_is_not_a_weights_problem() -> None:
    d = _diag(["org/chat-model-110b on one H100: cuda out of memory after 3 hours of serving"])
    assert d.top is not None and d.top.cause == "util_overshoot"


def test_colocated_trainer_lowers_the_engines_share() -> None:
    d = _diag(["PPO run on 4x H100: vLLM rollout OOM as soon as the actor model is loaded"])
    assert d.top is not None and d.top.cause == "util_overshoot"
    first = d.top.ordered_fixes()[0]
    assert first.flag == "--gpu-memory-utilization" and float(first.value or 1) < 0.9


def test_quoted_reserved_but_unallocated_is_fragmentation_and_respects_sleep_mode() -> None:
    d = _diag(
        [
            "With --enable-sleep-mode the trainer OOMs right after wake_up at step 4, "
            "with 12.5 GiB reserved-but-unallocated on every rank."
        ]
    )
    assert d.top is not None and d.top.cause == "fragmentation"
    engine_env = [f for f in d.top.fixes if f.flag == "PYTORCH_CUDA_ALLOC_CONF"]
    assert engine_env == []  # never expandable segments for a sleep-mode engine
    assert any(f.flag == "action" and "trainer" in (f.value or "") for f in d.top.fixes)


def test_growing_residual_after_sleep_is_the_engine_holding_memory() -> None:
    d = _diag(
        [
            "INFO 07-02 11:00:01 [gpu_worker.py:120] Sleep mode freed 61.20 GiB memory, "
            "2.35 GiB memory is still in use.",
            "INFO 07-02 11:20:41 [gpu_worker.py:120] Sleep mode freed 55.02 GiB memory, "
            "8.53 GiB memory is still in use.",
            "INFO 07-02 11:41:13 [gpu_worker.py:120] Sleep mode freed 47.90 GiB memory, "
            "15.66 GiB memory is still in use.",
            "Then the policy update OOMs.",
        ]
    )
    assert d.top is not None and d.top.cause == "leak_or_other_process"
    assert "2.35 → 15.66" in d.top.summary


def test_healthy_sleep_cycles_are_not_a_failure() -> None:
    d = _diag(
        [
            "INFO 07-02 11:00:01 [gpu_worker.py:120] Sleep mode freed 61.20 GiB memory, "
            "2.35 GiB memory is still in use.",
            "INFO 07-02 11:20:41 [gpu_worker.py:120] Sleep mode freed 61.18 GiB memory, "
            "2.37 GiB memory is still in use.",
        ]
    )
    assert not d.oom_found


def test_images_named_point_to_the_encoder() -> None:
    d = _diag(
        [
            "Startup OOM on a 16GB card: vLLM profiles dummy images at max resolution for "
            "the vision tower even though I only send text."
        ]
    )
    assert d.top is not None and d.top.cause == "multimodal_encoder"
    assert _flags(d)[0] in ("--limit-mm-per-prompt", "--max-num-seqs")


@pytest.mark.parametrize(
    "text",
    [
        # on a < 70 GiB card the V1 default keeps 256 sequences: the graphs are what changed
        "Everything was fine on vllm 0.7.3; after upgrading to 0.8.1 the same command runs out "
        "of memory on our L4.",
        "Works on v0.2.5 but OOMs on v0.2.7 with an identical config",
    ],
)
def test_upgrade_across_a_graph_release_is_cuda_graph(text: str) -> None:
    d = _diag([text])
    assert d.top is not None and d.top.cause == "cuda_graph"


def test_upgrade_within_a_release_line_is_not_blamed_on_graphs() -> None:
    d = _diag(["Worked with vllm 0.9.1, but 0.9.2 runs out of memory on long context prompts"])
    assert d.top is not None and d.top.cause == "kv_too_small_for_max_len"


def test_stated_top_utilization() -> None:
    d = _diag(["If I pass --gpu-memory-utilization 0.99 the server OOMs under load; 0.9 works."])
    assert d.top is not None and d.top.cause == "util_overshoot"
    fix = d.top.ordered_fixes()[0]
    assert fix.flag == "--gpu-memory-utilization" and float(fix.value or 1) <= 0.9


def test_prompt_logprobs_are_outside_the_profile() -> None:
    d = _diag(
        ["Requests with prompt_logprobs=5 on a 150k-vocabulary model crash the engine (OOM)."]
    )
    assert d.top is not None and d.top.cause == "other"


def test_nothing_to_go_on_says_so() -> None:
    d = _diag(["[Bug]: OOM with vLLM"])
    assert d.oom_found and d.top is not None
    assert d.top.confidence <= 0.25
    assert "nothing to tell" in d.top.summary
    assert d.top.ordered_fixes()[0].flag == "action"


@pytest.mark.parametrize(
    "line",
    [
        "CUDA graphs can take additional 1~3 GiB memory per GPU. If you are running out of "
        "memory, consider decreasing `gpu_memory_utilization` or enforcing eager mode.",
        "WARNING 03-11 09:12:44 [gpu_worker.py:796] Without it, CUDA graph memory is not "
        "accounted for, which may require lowering --gpu-memory-utilization to avoid OOM.",
        "This may cause out-of-memory errors.",
        "Consider lowering max_num_seqs to avoid potential OOMs.",
        "Runs fine, thanks for the help!",
    ],
)
def test_advice_and_vllm_warnings_are_not_a_failure(line: str) -> None:
    assert not _diag([line]).oom_found


def test_cli_exit_codes_on_prose(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    said = tmp_path / "title.txt"
    said.write_text("Gives OOM on 2x A10 even with max-num-seqs 1. Works with enforce-eager.\n")
    assert main(["doctor", str(said), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["cause"] == "cuda_graph"
    calm = tmp_path / "calm.txt"
    calm.write_text("The server started and answered 1,000 requests.\n")
    assert main(["doctor", str(calm)]) == 3


# --- 2. the bare "No available memory for the cache blocks" --------------------------------------


def test_bare_no_cache_blocks_ranks_the_default_batch_first() -> None:
    d = _diag(
        [
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        ]
    )
    causes = [f.cause for f in d.findings]
    assert causes[:2] == ["concurrency_or_batch", "kv_too_small_for_max_len"]
    assert set(_flags(d)) >= {"--max-num-seqs", "--max-num-batched-tokens"}


def test_no_cache_blocks_from_v0_code_keeps_the_budget_reading() -> None:
    d = _diag(
        [
            f'  File "{SITE}/vllm/worker/worker.py", line 470, in raise_if_cache_size_invalid',
            '    raise ValueError("No available memory for the cache blocks. "',
            "ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.",
        ]
    )
    assert d.parsed.get("engine") == "v0"
    assert d.top is not None and d.top.cause == "kv_too_small_for_max_len"


def test_no_cache_blocks_with_a_low_utilization_stated_in_prose() -> None:
    d = _diag(
        [
            "Setup: `--gpu-memory-utilization 0.45` on a 24 GB card",
            "ValueError: No available memory for the cache blocks.",
        ]
    )
    assert d.top is not None and d.top.cause == "kv_too_small_for_max_len"
    fix = d.top.ordered_fixes()[0]
    assert fix.flag == "--gpu-memory-utilization" and float(fix.value or 0) > 0.45


# --- 3. structured messages: Mamba blocks, V0 KV capacity -----------------------------------------


def test_mamba_blocks_cap_max_num_seqs() -> None:
    d = _diag(
        [
            "(EngineCore_DP0 pid=311) ValueError: max_num_seqs (512) exceeds available Mamba "
            "cache blocks (300). Each decode sequence requires one Mamba cache block."
        ]
    )
    assert d.top is not None and d.top.cause == "concurrency_or_batch"
    fix = d.top.ordered_fixes()[0]
    assert fix.flag == "--max-num-seqs" and int(fix.value or 0) <= 300


def test_v0_kv_capacity_wording_gives_a_block_multiple() -> None:
    d = _diag(
        [
            "ValueError: The model's max seq len (16384) is larger than the maximum number of "
            "tokens that can be stored in KV cache (9872). Try increasing `gpu_memory_utilization` "
            "or decreasing `max_model_len` when initializing the engine."
        ]
    )
    assert d.top is not None and d.top.cause == "kv_too_small_for_max_len"
    fix = d.top.ordered_fixes()[0]
    assert fix.flag == "--max-model-len"
    value = int(fix.value or 0)
    assert value <= 9872 and value % 16 == 0


# --- 4. host memory ---------------------------------------------------------------------------------


def test_ray_memory_monitor_kill_wrapped_over_lines() -> None:
    d = _diag(
        [
            "(raylet) [2025-03-04 10:11:12,000 E 812 812] (raylet) node_manager.cc:3041: 3 "
            "Workers (tasks /",
            " actors) killed due to memory pressure (OOM), 0 Workers crashed due to other reasons "
            "at node (ID: 9f1e, IP: 10.1.2.3) over the last time period.",
            "(raylet) Refer to the documentation on how to address the out of memory issue: "
            "https://docs.ray.io/en/latest/ray-core/scheduling/ray-oom-prevention.html.",
        ]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"
    assert d.parsed.has("ray_oom")
    assert "Ray" in d.top.summary


def test_ray_task_killed_with_sleep_mode_explains_host_offload() -> None:
    d = _diag(
        ["Task was killed due to the node running low on memory"],
        args={"enable_sleep_mode": True},
    )
    assert d.top is not None and d.top.cause == "cpu_ram"
    assert any("level 2" in (f.value or "") for f in d.top.fixes)


def test_checkpoint_mmap_failure_is_host_ram() -> None:
    d = _diag(
        [
            "RuntimeError: unable to mmap 41234567890 bytes from file "
            "</models/big/model-00001-of-00002.safetensors>: Cannot allocate memory (12)"
        ]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_pinned_host_allocation_failure_is_host_ram() -> None:
    d = _diag(
        [
            "Traceback (most recent call last):",
            f'  File "{SITE}/vllm/worker/cache_engine.py", line 94, in _allocate_kv_cache',
            "    torch.zeros(kv_cache_shape, dtype=self.dtype, pin_memory=pin_memory, device=device)",
            "RuntimeError: CUDA error: out of memory",
        ]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"
    assert _flags(d)[0] == "--swap-space"


def test_swap_space_refused_as_too_large() -> None:
    d = _diag(
        [
            "ValueError: Too large swap space. 48.00 GiB out of the 62.00 GiB total CPU memory "
            "is allocated for the swap space."
        ],
        args={"swap_space": 12},
    )
    assert d.top is not None and d.top.cause == "cpu_ram"
    fix = d.top.ordered_fixes()[0]
    assert fix.flag == "--swap-space" and int(fix.value or 99) < 12


def test_free_listing_with_exhausted_ram() -> None:
    d = _diag(
        [
            "$ free -h",
            "               total        used        free      shared  buff/cache   available",
            "Mem:           125Gi       123Gi       612Mi        21Mi       1,4Gi       1,1Gi",
            "Swap:          8,0Gi       8,0Gi          0B",
        ]
    )
    assert d.parsed.has("host_ram_low")
    assert d.parsed.get("host_ram_available_gib") == pytest.approx(1.1)
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_free_listing_with_room_is_not_a_failure() -> None:
    d = _diag(
        [
            "Mem:            62Gi       5,8Gi        13Gi        45Mi        43Gi        56Gi",
            "Swap:           31Gi       787Mi        31Gi",
        ]
    )
    assert not d.oom_found


def test_kill_during_graph_capture_weighs_the_phase() -> None:
    capture = [
        "INFO 04-02 08:00:00 [gpu_model_runner.py:1800] Model loading took 14.92 GiB and "
        "12.1 seconds",
        "INFO 04-02 08:00:31 [gpu_worker.py:240] Available KV cache memory: 52.10 GiB",
        "INFO 04-02 08:00:32 [gpu_model_runner.py:2100] Capturing CUDA graphs (mixed "
        "prefill-decode, PIECEWISE): 40%|████      | 27/67",
        "Killed",
    ]
    d = _diag(capture)
    causes = [f.cause for f in d.findings]
    assert causes[:2] == ["cuda_graph", "cpu_ram"]
    assert _flags(d)[0] == "--enforce-eager"
    # the same kill once the server was serving is host RAM
    serving = [
        *capture[:3],
        "INFO 04-02 08:01:10 [api_server.py:1000] Application startup complete.",
        "Killed",
    ]
    d2 = _diag(serving)
    assert d2.top is not None and d2.top.cause == "cpu_ram"


# --- 5. PyTorch OOM figures on separate lines; a co-tenant that tipped a full budget --------------


def test_reformatted_oom_figures_are_read_and_weighed() -> None:
    d = _diag(
        [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB.",
            "GPU has 23.55 GiB total, 301.12 MiB free.",
            "PyTorch allocated: 21.90 GiB",
            "Reserved but unallocated: 640.50 MiB",
        ]
    )
    oom = d.parsed.first_oom
    assert oom is not None and oom.total_gib == pytest.approx(23.55)
    assert oom.reserved_unallocated_gib == pytest.approx(640.5 / 1024)
    assert d.top is not None and d.top.cause == "fragmentation"


def test_small_cotenant_that_covers_the_shortfall_is_a_budget_question() -> None:
    d = _diag(
        [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 410.00 MiB.",
            "GPU 0 has a total capacity of 23.57 GiB of which 396.00 MiB is free.",
            "Process 4411 has 870.00 MiB memory in use. Including non-PyTorch memory, this "
            "process has 22.30 GiB in use.",
        ]
    )
    oom = d.parsed.first_oom
    assert oom is not None and oom.this_process_gib == pytest.approx(22.30)
    assert d.top is not None and d.top.cause == "util_overshoot"


# --- 6. a vision-language model after its KV cache was sized -----------------------------------


def test_vlm_oom_after_kv_sizing_is_the_encoder() -> None:
    lines = [
        "INFO 01-20 09:00:00 executor_base.py:80] # GPU blocks: 18204, # CPU blocks: 2048",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 288.00 MiB. GPU 0 has a "
        "total capacity of 79.15 GiB of which 201.00 MiB is free.",
    ]
    d = _diag(lines, model="Qwen/Qwen2-VL-7B-Instruct")
    assert d.top is not None and d.top.cause == "multimodal_encoder"
    text_only = _diag(lines, model="Qwen/Qwen2-7B-Instruct")
    assert text_only.top is not None and text_only.top.cause != "multimodal_encoder"


# --- statements in other languages, engines built twice, cut Ray errors --------------------------


@pytest.mark.parametrize(
    "text",
    [
        "部署 Qwen2.5-14B 时启动就报OOM错误",  # "reports an OOM error at start-up"
        "服务跑了一天之后显存不足，进程退出",  # "after a day the GPU memory was insufficient"
        "一开始正常，后来爆显存了",  # "fine at first, then the GPU memory blew up"
    ],
)
def test_chinese_statements_of_a_memory_failure_are_failures(text: str) -> None:
    d = _diag([text])
    assert d.oom_found and d.top is not None
    assert any(e.line == 1 for e in d.top.evidence)


def test_oom_inside_a_latin_word_is_not_a_failure() -> None:
    assert not _diag(["ZOOM meetings were recorded; the BOOMBOX model loaded fine"]).oom_found


def test_a_second_engine_built_in_the_same_process_is_the_co_tenant() -> None:
    d = _diag(
        [
            "for path in checkpoints:",
            "    llm = LLM(model=path, tensor_parallel_size=2)",
            "    run_eval(llm)",
            "llm = LLM(model='final', tensor_parallel_size=2)",
            "The last line dies with CUDA out of memory.",
        ]
    )
    assert d.top is not None and d.top.cause == "leak_or_other_process"
    assert any("LLM(model='final'" in e.text for e in d.top.evidence)
    # one engine only: no co-tenant is read into it
    one = _diag(["llm = LLM(model='final', tensor_parallel_size=2)", "CUDA out of memory."])
    assert one.top is not None and one.top.cause != "leak_or_other_process"


def test_memory_not_properly_released_between_steps_is_a_leak() -> None:
    d = _diag(
        [
            "After each PPO step the GPU memory is not properly released, so the rollout "
            "engine hits an OOM when it wakes up for step 2."
        ]
    )
    assert d.top is not None and d.top.cause == "leak_or_other_process"


def test_ray_memory_error_cut_by_the_excerpt_is_host_memory() -> None:
    d = _diag(
        [
            "Traceback (most recent call last):",
            f'  File "{SITE}/vllm/engine/async_llm_engine.py", line 351, in run_engine_loop',
            "    has_requests_in_progress = await self.engine_step()",
            "ray.exceptions.OutOfMe",
        ]
    )
    assert d.top is not None and d.top.cause == "cpu_ram"


def test_weights_worked_out_per_gpu_against_a_lower_case_gpu_name() -> None:
    d = _diag(
        [
            "we have 2 * v100-16G and want to serve a MoE checkpoint",
            "model weights took 13.6 * 2 = 27.2 GB",
            "then got OOM on each gpu",
        ]
    )
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    assert "2 GPUs" in d.top.summary and "27.2 GiB" in d.top.summary
    # the same weights over GPUs with room to spare are not the cause
    roomy = _diag(
        [
            "we have 2 * a100-80G and want to serve a MoE checkpoint",
            "model weights took 13.6 * 2 = 27.2 GB",
            "then got OOM on each gpu",
        ]
    )
    assert roomy.top is None or roomy.top.cause != "weights_dont_fit"


def test_cannot_load_on_a_sized_gpu_at_full_utilisation_is_the_utilization() -> None:
    d = _diag(["cannot load llama 3.2 3b on a 16gb gpu when gpu_memory_utilisation=1"])
    assert d.oom_found and d.top is not None and d.top.cause == "util_overshoot"
    assert _flags(d)[0] == "--gpu-memory-utilization"
    # loading something that is not a GPU size claim is not a memory failure
    assert not _diag(["cannot load the tokenizer on a fresh install"]).oom_found


def test_gpu_memory_growing_until_oom_in_chinese_is_a_leak() -> None:
    # "as requests accumulate the GPU memory slowly grows, and in the end an OOM is reported"
    d = _diag(["随着请求增多，显存慢慢增大，最终报OOM错误"])
    assert d.top is not None and d.top.cause == "leak_or_other_process"


def test_sampler_warmup_named_in_prose_is_the_number_of_sequences() -> None:
    d = _diag(
        [
            "Fixes CUDA out of memory at start-up on 8x H100.",
            "The default max_num_seqs=1024 made the sampler warmup allocate far too much.",
        ]
    )
    assert d.top is not None and d.top.cause == "concurrency_or_batch"
    assert "--max-num-seqs" in _flags(d)


def test_a_failure_bisected_to_one_vllm_change_is_a_regression_not_a_setting() -> None:
    d = _diag(
        [
            "The 2-GPU data-parallel example now fails with CUDA OOM at default settings.",
            "I bisected it to the commit that switched the default attention backend.",
        ]
    )
    assert d.top is not None and d.top.cause == "other"
    assert _flags(d)[0] == "action"
    # naming a PR that fixed something else is no such statement
    plain = _diag(["CUDA OOM at start-up; PR #123 added a new flag I did not use."])
    assert plain.top is None or plain.top.cause != "other"


def test_hyphenated_host_ram_and_shared_gpus_are_read() -> None:
    host = _diag(
        ["Each TP worker holds the whole checkpoint in host-RAM while loading; it host-OOMs."]
    )
    assert host.top is not None and host.top.cause == "cpu_ram"
    shared = _diag(
        ["The default utilization claims half of an 80GB card and causes OOM on shared GPUs."]
    )
    assert shared.top is not None and shared.top.cause == "util_overshoot"
