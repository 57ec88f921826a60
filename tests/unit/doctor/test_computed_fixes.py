"""Fix values computed by the memory model, with their arithmetic, and never a made-up repo."""

from __future__ import annotations

import json
import re
from pathlib import Path

from oomguard.doctor.diagnose import diagnose
from oomguard.doctor.findings import Diagnosis, Fix
from oomguard.doctor.rules import NO_INT4_REPO
from oomguard.doctor.situation import Context
from oomguard.facts import known_quantized_variants, resolve_model
from oomguard.logs import parse_stream
from oomguard.memory.weights import weight_bytes_per_stage

GIB = 2**30
ROWS = [
    json.loads(line)
    for line in Path("/work/shared/data/oom-cases.jsonl").read_text().splitlines()
    if line.strip()
]
NO_BLOCKS = (
    "ValueError: No available memory for the cache blocks. Try increasing "
    "`gpu_memory_utilization` when initializing the engine."
)
LOAD_OOM = [
    "INFO Starting to load model {model}...",
    'File "/vllm/worker/gpu_model_runner.py", line 1, in load_model',
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has a total "
    "capacity of {total} GiB of which 512.00 MiB is free.",
]


def _diag(lines: list[str], **context: object) -> Diagnosis:
    return diagnose(parse_stream(lines), Context(**context))  # type: ignore[arg-type]


def _fix(d: Diagnosis, flag: str) -> Fix:
    assert d.top is not None
    found = [f for f in d.top.fixes if f.flag == flag]
    assert found, f"no {flag} fix in {d.top.fixes}"
    return found[0]


def _all_fixes(d: Diagnosis) -> list[Fix]:
    return [f for finding in d.findings for f in finding.fixes]


def test_a_catalogued_4bit_repo_is_named_with_its_computed_size() -> None:
    model = "meta-llama/Llama-3.1-70B-Instruct"
    lines = [line.format(model=model, total="79.19") for line in LOAD_OOM]
    d = _diag(lines, gpu="H100 SXM", args={"dtype": "float16"})  # T4-like: no fp8 fits anyway
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    fix = _fix(d, "--model")
    repos = {repo for repo, _ in known_quantized_variants(model)}
    assert fix.value in repos and fix.value is not None and "AWQ" in fix.value
    # the size is the memory model's, on the repo's own config
    spec = resolve_model(fix.value, allow_hub=False)
    expected = weight_bytes_per_stage(spec, model_dtype="float16").max_bytes / GIB
    assert f"{expected:.1f} GiB per GPU" in fix.why


def test_no_catalogued_repo_is_said_never_invented() -> None:
    model = "Qwen/Qwen2.5-72B-Instruct"
    assert known_quantized_variants(model) == []
    lines = [line.format(model=model, total="79.19") for line in LOAD_OOM]
    d = _diag(lines, gpu="H100 SXM")
    fixes = _all_fixes(d)
    assert all(not (f.value or "").endswith("-AWQ") for f in fixes)
    model_fixes = [f for f in fixes if f.flag == "--model"]
    for f in model_fixes:
        assert f.value is None and f.why.startswith(NO_INT4_REPO)
    # the log-only case of a real report: nothing named, the catalogue's absence said
    log_only = diagnose(parse_stream(ROWS[17]["log"].splitlines()))
    first = log_only.top.ordered_fixes()[0] if log_only.top else None
    assert first is not None and first.flag == "--model" and first.value is None
    assert NO_INT4_REPO in first.why


def test_fp8_size_comes_from_the_memory_model() -> None:
    model = "meta-llama/Llama-3.1-8B-Instruct"
    lines = ["INFO Model loading took 14.99 GiB memory and 10.0 seconds", NO_BLOCKS]
    d = _diag(lines, model=model, gpu="RTX 4080")
    assert d.top is not None and d.top.cause == "weights_dont_fit"
    fix = _fix(d, "--quantization")
    assert fix.value == "fp8"
    spec = resolve_model(model, allow_hub=False)
    fp8 = weight_bytes_per_stage(spec, model_dtype="bfloat16", quantization="fp8").max_bytes
    assert f"{fp8 / GIB:.1f} GiB per GPU" in fix.why
    assert "memory model" in fix.why


def test_tensor_parallel_sizes_the_heads_do_not_divide_are_skipped() -> None:
    # Llama-2-13B has 40 attention heads: TP 16 is not a size vLLM accepts
    d = _diag(
        [line.format(model="meta-llama/Llama-2-13b-hf", total="14.58") for line in LOAD_OOM],
        gpu="T4",
        args={"tensor_parallel_size": 8},
    )
    assert all(f.value != "16" for f in _all_fixes(d) if f.flag == "--tensor-parallel-size")


def test_graph_utilization_step_is_the_graph_size_over_total() -> None:
    lines = [
        "INFO Graph capturing finished in 5 secs, took 2.31 GiB",
        "INFO Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 39.39 GiB of which 3.00 MiB is free.",
    ]
    d = _diag(lines, args={"gpu_memory_utilization": 0.9})
    assert d.top is not None and d.top.cause == "cuda_graph"
    fix = _fix(d, "--gpu-memory-utilization")
    # ⌈2.31 / 39.39⌉ to 0.01 = ⌈0.0586⌉ = 0.06
    assert fix.value == "0.84"
    assert "2.31 GiB" in fix.why and "39.39 GiB" in fix.why and "0.9 − 0.06 = 0.84" in fix.why


def test_graph_size_is_estimated_when_the_log_lacks_it() -> None:
    lines = [
        "INFO Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 3.00 MiB is free.",
    ]
    d = _diag(lines, model="meta-llama/Llama-3.1-8B-Instruct", gpu="H100 SXM")
    fix = _fix(d, "--gpu-memory-utilization")
    assert "estimated by the memory model" in fix.why
    m = re.search(r"⌈([\d.]+) GiB", fix.why)
    assert m is not None and 0.2 < float(m.group(1)) < 3.0


def test_profiling_oom_sizes_batched_tokens_from_free_over_tried() -> None:
    lines = [
        "INFO Chunked prefill is enabled with max_num_batched_tokens=16384.",
        'File "/vllm/v1/worker/gpu_model_runner.py", line 1, in profile_run',
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 1.50 GiB is free.",
    ]
    d = _diag(lines)
    fix = _fix(d, "--max-num-batched-tokens")
    # 16384 × 1.5/4 = 6144 → 4096
    assert fix.value == "4096"
    assert "16384 × 0.38" in fix.why and "6144" in fix.why


def test_multimodal_sequences_from_profiled_items_and_the_oom() -> None:
    lines = [
        "INFO Encoder cache will be initialized with a budget of 16384 tokens, and profiled with "
        "64 image items of the maximum feature size.",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a "
        "total capacity of 79.19 GiB of which 2.00 GiB is free.",
    ]
    d = _diag(lines)
    assert d.top is not None and d.top.cause == "multimodal_encoder"
    fix = _fix(d, "--max-num-seqs")
    # 64 items × 2/12 = 10.7 → 8
    assert fix.value == "8" and "64 items × 0.17" in fix.why
