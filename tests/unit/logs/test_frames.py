"""What the parser reads from traceback frames and process listings: the CUDA-graph capture
phase, the kinds of code a failing traceback ran through, GPU process tables, ``ps`` rows, the
engine a PyTorch OOM text dates the log to, and the one-scan trigger index."""

from __future__ import annotations

import random

import pytest

from oomguard.logs import Phase, parse_stream
from oomguard.logs import catalogue as cat

SITE = "/opt/venv/lib/python3.12/site-packages"
PREFIX = "(VllmWorker rank=1 pid=4711) ERROR 07-02 14:03:11 [multiproc_executor.py:527] "

# V1 with torch.compile: the piecewise backend captures inside ``with torch.cuda.graph(...)``
# and the driver reports the OOM when capture ends.
CAPTURE_DRIVER_OOM = [
    PREFIX + "Traceback (most recent call last):",
    PREFIX + f'  File "{SITE}/vllm/v1/worker/gpu_worker.py", line 311, in compile_or_warm_up_model',
    PREFIX + "    self.model_runner.capture_model()",
    PREFIX + f'  File "{SITE}/vllm/compilation/cuda_piecewise_backend.py", line 160, in __call__',
    PREFIX + "    with torch.cuda.graph(cudagraph, pool=self.graph_pool):",
    PREFIX + f'  File "{SITE}/torch/cuda/graphs.py", line 186, in __exit__',
    PREFIX + "    self.cuda_graph.capture_end()",
    PREFIX + f'  File "{SITE}/torch/cuda/graphs.py", line 84, in capture_end',
    PREFIX + "    super().capture_end()",
    PREFIX + "RuntimeError: CUDA error: out of memory",
    PREFIX + "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.",
]


def test_capture_end_in_torch_graphs_marks_the_capture_phase() -> None:
    parsed = parse_stream(CAPTURE_DRIVER_OOM)
    assert parsed.has("driver_oom")
    assert parsed.failure_phase is not None
    assert parsed.failure_phase.value == Phase.CUDA_GRAPH_CAPTURE


@pytest.mark.parametrize(
    "frame",
    [
        f'  File "{SITE}/vllm/v1/worker/gpu_model_runner.py", line 2901, in _capture_cudagraphs',
        f'  File "{SITE}/vllm/compilation/cuda_graph.py", line 190, in __call__ (CUDAGraphWrapper)',
        f'  File "{SITE}/torch/cuda/graphs.py", line 70, in capture_begin',
        "    with torch.cuda.graph(self._graph, pool=memory_pool, stream=stream):",
    ],
)
def test_each_capture_helper_is_a_capture_frame(frame: str) -> None:
    lines = [
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/v1/engine/core.py", line 80, in __init__',
        frame,
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a "
        "total capacity of 23.54 GiB of which 41.06 MiB is free.",
    ]
    parsed = parse_stream(lines)
    assert parsed.failure_phase is not None
    assert parsed.failure_phase.value == Phase.CUDA_GRAPH_CAPTURE


def test_graph_replay_is_not_capture() -> None:
    lines = [
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/engine/llm_engine.py", line 1386, in step',
        f'  File "{SITE}/torch/cuda/graphs.py", line 88, in replay',
        "    super().replay()",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
    ]
    parsed = parse_stream(lines)
    assert Phase.CUDA_GRAPH_CAPTURE not in parsed.phases


def test_truncated_traceback_inside_a_vision_tower_is_remembered() -> None:
    lines = [
        f'  File "{SITE}/vllm/model_executor/models/qwen2_5_vl.py", line 1102, in '
        "_process_image_input",
        "    image_embeds = self.visual(pixel_values, grid_thw=grid_thw)",
        f'  File "{SITE}/vllm/model_executor/models/qwen2_5_vl.py", line 712, in forward',
        "    hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens)",
    ]
    parsed = parse_stream(lines)
    assert parsed.has("truncated_traceback")
    assert parsed.has("failing_in_mm_encoder")


@pytest.mark.parametrize(
    "path",
    [
        "vllm/model_executor/models/moonvit.py",
        "vllm/model_executor/models/intern_vit.py",
        "vllm/model_executor/models/siglip.py",
        "vllm/model_executor/models/idefics2_vision_model.py",
        "vllm/model_executor/models/whisper.py",
        "vllm/model_executor/models/qwen2_audio.py",
        "vllm/model_executor/models/some_new_encoder.py",
    ],
)
def test_vision_and_audio_model_files_are_encoder_frames(path: str) -> None:
    parsed = parse_stream([f'  File "{SITE}/{path}", line 300, in forward', "    x = self.mlp(x)"])
    assert parsed.has("failing_in_mm_encoder"), path


def test_text_model_file_is_not_an_encoder_frame() -> None:
    parsed = parse_stream(
        [f'  File "{SITE}/vllm/model_executor/models/llama.py", line 300, in forward', "    x = 1"]
    )
    assert not parsed.has("mm_encoder_frames")
    assert not parsed.has("failing_in_mm_encoder")


def test_patch_unfold_is_a_vision_op_and_an_activation() -> None:
    lines = [
        "Traceback (most recent call last):",
        f'  File "{SITE}/torch/nn/modules/fold.py", line 298, in forward',
        "    return F.unfold(input, self.kernel_size, self.dilation,",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.10 GiB. GPU 0 has a total "
        "capacity of 23.55 GiB of which 1.31 GiB is free.",
    ]
    parsed = parse_stream(lines)
    assert parsed.has("failing_in_mm_encoder")
    assert parsed.has("failing_in_activation")


def test_frame_kinds_outside_tracebacks_and_closed_tracebacks_are_ignored() -> None:
    lines = [
        "INFO 05-02 10:00:00 [cuda.py:240] Using Flash Attention backend on V1 engine.",
        "INFO 05-02 10:00:01 [gpu_model_runner.py:1200] Encoder cache will be "
        "initialized for vision.",
        "Traceback (most recent call last):",
        f'  File "{SITE}/vllm/model_executor/models/siglip.py", line 400, in forward',
        "ValueError: unexpected image size",  # not a memory failure: closes it
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",
    ]
    parsed = parse_stream(lines)
    assert not parsed.has("failing_in_mm_encoder")
    assert not parsed.has("failing_in_activation")


def test_nvidia_smi_process_table_rows() -> None:
    lines = [
        "| Processes:                                                                              |",  # noqa: E501
        "|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |",  # noqa: E501
        "|    0   N/A  N/A     48213      C   VLLM::EngineCore                            30712MiB |",  # noqa: E501
        "|    1   N/A  N/A      9921      C   /usr/bin/python3                             1024MiB |",  # noqa: E501
        "|    0     51120      C   python                                        2048MiB |",
        "48213, VLLM::EngineCore, 30712 MiB",
    ]
    parsed = parse_stream(lines)
    rows = {(g.pid, g.gpu_index): g for g in parsed.gpu_processes}
    assert rows[(48213, 0)].gib == pytest.approx(29.99, abs=0.01)
    assert rows[(48213, 0)].is_inference_engine
    assert rows[(9921, 1)].is_python and not rows[(9921, 1)].is_inference_engine
    assert rows[(51120, 0)].gib == 2.0  # the older layout without GI/CI columns
    assert (48213, None) in rows  # the CSV query form has no GPU column


def test_ps_rows_name_engines_but_are_not_the_command() -> None:
    lines = [
        "$ ps aux | grep vllm",
        "root       48213 12.1  3.2 61234567 4212345 ?  Sl  09:12  35:10 /usr/bin/python3 -m "
        "vllm.entrypoints.openai.api_server --model meta-llama/Llama-3.1-8B-Instruct",
        "root       51200  0.0  0.0   6432   720 pts/0  S+  10:00   0:00 grep --color=auto vllm",
    ]
    parsed = parse_stream(lines)
    assert [e.line for e in parsed.engine_processes] == [2]
    assert "model" not in parsed.args  # a listed process's flags are not this engine's


@pytest.mark.parametrize(
    "oom",
    [
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; "
        "23.65 GiB total capacity; 20.1 GiB already allocated; 1.2 GiB free; 21.0 GiB reserved "
        "in total by PyTorch)",
        "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacty of 23.65 GiB of which 1.2 GiB is free.",
    ],
)
def test_old_pytorch_oom_text_dates_the_log_to_v0(oom: str) -> None:
    assert parse_stream([oom]).get("engine") == "v0"


def test_new_pytorch_oom_text_says_nothing_about_the_engine() -> None:
    oom = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 23.65 GiB of which 1.2 GiB is free."
    )
    assert parse_stream([oom]).get("engine") is None


def test_trigger_scan_finds_exactly_the_triggers_a_substring_test_finds() -> None:
    """The one-regex scan must enable the same patterns as testing every trigger."""
    rnd = random.Random(7)
    triggers = list(cat.TRIGGERS)
    words = [*triggers, "lorem", "ipsum", " ", "::", "1024", "error:", "out of"]
    for _ in range(400):
        text = "".join(rnd.choice(words) for _ in range(rnd.randint(0, 12))).lower()
        expected = sorted({i for t, ix in cat.TRIGGERS.items() if t in text for i in ix})
        found: set[int] = set()
        for hit in cat.TRIGGER_SCAN.findall(text):
            found.update(cat.TRIGGER_CLOSURE[hit])
        assert sorted(found) == expected, text
