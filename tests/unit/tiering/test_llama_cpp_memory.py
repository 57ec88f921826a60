"""The llama.cpp memory model: type sizes, placement rules, KV and model buffers, the chain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oomguard import plan
from oomguard.errors import BadInput
from oomguard.facts import resolve_model
from oomguard.tiering.command import llama_server_argv
from oomguard.tiering.ggml_types import COMMON_TYPE_SIZES, row_bytes, type_sizes
from oomguard.tiering.gguf_file import read_gguf
from oomguard.tiering.loadlog import parse_load_log
from oomguard.tiering.memory import context_size, predict_llama_cpp
from oomguard.tiering.placement import CPU, place
from oomguard.tiering.settings import LlamaCppSettings, Override
from oomguard.tiering.synthesize import synthesize_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from tiny_gguf import SHAPES, write_tiny_gguf  # noqa: E402

GIB = 2**30
MIB = 2**20
HERE = Path(__file__).resolve().parent


def test_common_type_sizes_are_ggmls() -> None:
    from gguf import GGML_QUANT_SIZES

    table = {q.name: (int(b), int(s)) for q, (b, s) in GGML_QUANT_SIZES.items()}
    for name, sizes in COMMON_TYPE_SIZES.items():
        assert table[name] == sizes, name
    assert row_bytes("Q4_K", 4096) == 16 * 144
    with pytest.raises(BadInput):
        type_sizes("Q9_Z")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {k: write_tiny_gguf(root / f"{k}.gguf", s) for k, s in SHAPES.items()}


def test_header_reading_is_exact(tiny: dict[str, Path]) -> None:
    m = read_gguf(tiny["q4_k"])
    shape = SHAPES["q4_k"]
    assert (m.n_layer, m.n_embd, m.n_head, m.n_head_kv[0]) == (4, 256, 4, 2)
    assert m.by_name["token_embd.weight"].type_name == "Q6_K"
    assert m.by_name["blk.0.ffn_down.weight"].shape == (shape.n_ff, shape.n_embd)
    # every tensor's bytes end where the file's data ends (nothing unaccounted)
    last = max(t.offset_bytes + t.nbytes for t in m.tensors if t.offset_bytes is not None)
    assert last <= tiny["q4_k"].stat().st_size < last + 64


def test_ngl_counts_the_output_layer(tiny: dict[str, Path]) -> None:
    m = read_gguf(tiny["q8_0"])  # 4 layers
    one = place(m, LlamaCppSettings(n_gpu_layers=1, gpu_count=1))
    assert one.output_device == "GPU0" and one.gpu_layers() == 0
    four = place(m, LlamaCppSettings(n_gpu_layers=4, gpu_count=1))
    assert four.layer_devices == (CPU, "GPU0", "GPU0", "GPU0")  # layer 0 stays: the last go first
    everything = place(m, LlamaCppSettings(n_gpu_layers=-1, gpu_count=1))
    assert everything.gpu_layers() == 4
    embd = [p for p in everything.tensors if p.tensor.name == "token_embd.weight"]
    assert [p.device for p in embd] == [CPU]  # the input layer never leaves the CPU
    cpu_only = place(m, LlamaCppSettings(n_gpu_layers=99, gpu_count=0))
    assert cpu_only.gpu_layers() == 0 and cpu_only.output_device == CPU


def test_overrides_and_n_cpu_moe(tiny: dict[str, Path]) -> None:
    m = read_gguf(tiny["moe_q4_k"])
    p = place(m, LlamaCppSettings(n_gpu_layers=-1, n_cpu_moe=2, gpu_count=1))
    experts = {(x.tensor.layer, x.device) for x in p.tensors if x.tensor.is_expert}
    assert experts == {(0, CPU), (1, CPU), (2, "GPU0")}
    attn = {x.device for x in p.tensors if ".attn_" in x.tensor.name}
    assert attn == {"GPU0"}
    o = place(
        m, LlamaCppSettings(n_gpu_layers=-1, gpu_count=1, overrides=(Override(r"ffn_down", "CPU"),))
    )
    assert all(x.device == CPU for x in o.tensors if "ffn_down" in x.tensor.name)


def test_tied_head_is_loaded_twice_on_the_gpu(tiny: dict[str, Path]) -> None:
    m = read_gguf(tiny["q5_k"])
    assert m.tied_output
    mem = predict_llama_cpp(m, LlamaCppSettings(ctx_size=1024, n_gpu_layers=1, gpu_count=1))
    gpu = mem.buffer("model", "GPU0")
    embd = m.by_name["token_embd.weight"]
    assert (
        gpu is not None and gpu.size_bytes >= embd.nbytes + m.by_name["output_norm.weight"].nbytes
    )


def test_context_padding_and_slots(tiny: dict[str, Path]) -> None:
    m = read_gguf(tiny["q8_0"])
    c = context_size(m, LlamaCppSettings(ctx_size=3000, parallel=3))
    assert (c.n_ctx, c.n_ctx_seq, c.n_stream) == (3072, 1024, 3)
    u = context_size(m, LlamaCppSettings(ctx_size=3000, parallel=3, kv_unified=True))
    assert (u.n_ctx, u.n_ctx_seq, u.n_stream) == (3072, 3072, 1)


def test_kv_bytes_by_cache_type(tiny: dict[str, Path]) -> None:
    m = read_gguf(tiny["q8_0"])  # 4 layers × 2 KV heads × 64
    f16 = predict_llama_cpp(m, LlamaCppSettings(ctx_size=4096)).buffer("kv", CPU)
    assert f16 is not None and f16.size_bytes == 4 * 2 * 4096 * 128 * 2
    q8 = predict_llama_cpp(
        m, LlamaCppSettings(ctx_size=4096, cache_type_k="q8_0", cache_type_v="q8_0")
    )
    kv = q8.buffer("kv", CPU)
    assert kv is not None and kv.size_bytes == 4 * 2 * 4096 * (128 // 32 * 34)
    with pytest.raises(BadInput):
        LlamaCppSettings(cache_type_k="fp8")
    with pytest.raises(BadInput):
        LlamaCppSettings(cache_type_v="q4_0", flash_attn=False)


def test_cuda_pads_quantized_rows_to_512(tiny: dict[str, Path]) -> None:
    m = read_gguf(tiny["q8_0"])  # rows of 256 elements: each matrix gets one padding row of 256
    mem = predict_llama_cpp(m, LlamaCppSettings(ctx_size=512, n_gpu_layers=-1, gpu_count=1))
    gpu = mem.buffer("model", "GPU0")
    on_gpu = [p.tensor for p in mem.placement.tensors if p.device == "GPU0"]
    plain = sum(t.nbytes for t in on_gpu)
    assert gpu is not None and gpu.size_bytes > plain
    rpc = predict_llama_cpp(
        m, LlamaCppSettings(ctx_size=512, n_gpu_layers=-1, gpu_count=1, gpu_backend="rpc")
    )
    rgpu = rpc.buffer("model", "GPU0")
    assert rgpu is not None and rgpu.size_bytes == sum((t.nbytes + 31) // 32 * 32 for t in on_gpu)


def test_synthesized_q4_k_m_matches_published_file_sizes() -> None:
    # published Q4_K_M GGUFs: Llama-3.1-8B-Instruct 4.92 GB, Llama-3.1-70B-Instruct 42.5 GB
    eight = synthesize_gguf(resolve_model("meta-llama/Llama-3.1-8B-Instruct"))
    seventy = synthesize_gguf(resolve_model("meta-llama/Llama-3.1-70B-Instruct"))
    assert abs(eight.weight_bytes / 1e9 - 4.92) < 0.02
    assert abs(seventy.weight_bytes / 1e9 - 42.5) < 0.1


def test_load_log_parser_reads_every_buffer() -> None:
    log = parse_load_log((HERE / "llama_server_load_q8_0.log").read_text().splitlines())
    assert log.total("model", CPU) == round(2.93 * MIB)
    assert log.total("kv", CPU) == 8 * MIB
    assert log.total("compute", CPU) == round(8.51 * MIB)
    assert log.context["n_ctx"] == "4096" and log.context["flash_attn"] == "auto"
    assert not log.allocation_failed
    failed = parse_load_log(
        [
            "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on device 0: "
            "cudaMalloc failed: out of memory",
            "alloc_tensor_range: failed to allocate CUDA0 buffer of size 9437184000",
        ]
    )
    assert failed.allocation_failed and len(failed.failures) == 2


def test_command_pins_what_the_prediction_assumed() -> None:
    argv = llama_server_argv(
        "m.gguf",
        LlamaCppSettings(
            ctx_size=8192,
            parallel=4,
            n_gpu_layers=21,
            gpu_count=1,
            cache_type_k="q8_0",
            cache_type_v="q8_0",
        ),
    )
    line = " ".join(argv)
    for part in (
        "--ctx-size 8192",
        "--parallel 4",
        "--n-gpu-layers 21",
        "--cache-type-k q8_0",
        "--cache-type-v q8_0",
        "--fit off",
        "--flash-attn on",
    ):
        assert part in line


def test_plan_of_70b_on_one_24gb_gpu_gives_a_llama_cpp_split_under_budget() -> None:
    result = plan(
        "meta-llama/Llama-3.1-70B-Instruct",
        gpu="RTX 4090",
        p99_tokens=8192,
        concurrency=16,
        host_memory_gib=128,
    )
    assert not result.fits
    tiers = [a.numbers["tier"] for a in result.alternatives]
    assert tiers == sorted(tiers) and tiers[0] == 1 and 6 in tiers and 7 in tiers
    llama = next(a for a in result.alternatives if a.kind == "llama_cpp")
    n = llama.numbers
    assert llama.serves_workload
    assert 0 < n["n_gpu_layers"] <= 81
    assert n["gpu_gib_per_device"] <= n["gpu_budget_gib"] <= 23.65 - 1.0
    assert n["ctx_per_slot"] >= 8192 and n["parallel"] == 16
    assert "--n-gpu-layers" in llama.command and "--fit off" in llama.command
    assert n["host_gib"] <= n["host_budget_gib"]
    assert n["slowdown"] is not None and n["slowdown"] > 1
    small_host = plan(
        "meta-llama/Llama-3.1-70B-Instruct",
        gpu="RTX 4090",
        p99_tokens=8192,
        concurrency=16,
        host_memory_gib=32,
    )
    llama_small = next(a for a in small_host.alternatives if a.kind == "llama_cpp")
    assert not llama_small.serves_workload  # 59 GiB of host memory needed, 30 usable


def test_plan_json_carries_the_chain() -> None:
    result = plan(
        "meta-llama/Llama-3.1-70B-Instruct", gpu="RTX 4090", p99_tokens=8192, concurrency=16
    )
    data = result.to_dict()
    kinds = [a["kind"] for a in data["alternatives"]]
    assert kinds[0] == "as_planned" and kinds[-1] == "cpu_only"
    assert all("tier" in a["numbers"] for a in data["alternatives"])


@pytest.mark.parametrize(
    ("model_ref", "concurrency"),
    [("meta-llama/Llama-3.1-70B-Instruct", 16), ("Qwen/Qwen3-30B-A3B", 8)],
)
def test_split_search_finds_what_trying_every_split_finds(model_ref: str, concurrency: int) -> None:
    import dataclasses

    from oomguard.tiering.split import best_split, price_split

    model = synthesize_gguf(resolve_model(model_ref))
    base = LlamaCppSettings(ctx_size=8192 * concurrency, parallel=concurrency, gpu_count=1)
    total = int(23.65 * GIB)
    found = best_split(model, base, total)
    assert found.fits_gpu
    if model.n_expert:
        every = [
            k
            for k in range(model.n_layer + 1)
            if price_split(
                model, dataclasses.replace(base, n_gpu_layers=-1, n_cpu_moe=k), total
            ).fits_gpu
        ]
        assert found.settings.n_cpu_moe == min(every)
    else:
        every = [
            k
            for k in range(model.n_layer + 2)
            if price_split(model, dataclasses.replace(base, n_gpu_layers=k), total).fits_gpu
        ]
        assert found.settings.n_gpu_layers == max(every)


def test_cli_host_memory_flag(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from oomguard.cli import main

    code = main(
        [
            "plan",
            "meta-llama/Llama-3.1-70B-Instruct",
            "--gpu",
            "RTX 4090",
            "--p99-tokens",
            "8192",
            "--concurrency",
            "16",
            "--host-memory-gib",
            "32",
            "--json",
            "--offline",
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 1
    llama = next(a for a in json.loads(out)["alternatives"] if a["kind"] == "llama_cpp")
    assert llama["numbers"]["host_budget_gib"] == 30.0 and not llama["serves_workload"]
    code = main(
        ["plan", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--host-memory-gib", "0"]
    )
    _, err = capsys.readouterr()
    assert code == 2 and "--host-memory-gib" in err and "Traceback" not in err


def test_after_an_allocation_failure_the_split_shrinks() -> None:
    from oomguard.tiering.split import after_allocation_failure, best_split

    model = synthesize_gguf(resolve_model("meta-llama/Llama-3.1-70B-Instruct"))
    total = int(23.65 * GIB)
    first = best_split(model, LlamaCppSettings(ctx_size=16 * 8192, parallel=16, gpu_count=1), total)
    # the log said: failed to allocate CUDA0 buffer of 2 GiB (something else holds the memory)
    retry = after_allocation_failure(model, first.settings, total, 2 * GIB)
    assert retry is not None and retry.settings.n_gpu_layers < first.settings.n_gpu_layers
    assert (
        retry.gpu_need_bytes <= first.gpu_need_bytes - 2 * GIB + 2**29
    )  # freed about the shortfall
    tiny = after_allocation_failure(model, first.settings, total, 1)
    assert tiny is not None and tiny.settings.n_gpu_layers == first.settings.n_gpu_layers - 1
    assert (
        after_allocation_failure(model, LlamaCppSettings(gpu_count=1, n_gpu_layers=0), total, GIB)
        is None
    )
