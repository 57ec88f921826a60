"""llama-server's command line read against its own ``--help``, and its load log read as serve
reads it (the stored help text and load log of the pinned build)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from oomguard.errors import BadInput
from oomguard.logs import Phase
from oomguard.serve.llama_command import LlamaCommand
from oomguard.serve.llama_session import LlamaLogReader
from oomguard.tiering.args import AUTO_SLOTS, parse_help, read_args

HERE = Path(__file__).parent
TABLE = parse_help((HERE / "llama_server_help.txt").read_text())


def test_every_spelling_of_a_flag_is_one_flag() -> None:
    assert TABLE.canonical("-ngl") == TABLE.canonical("--n-gpu-layers") == "--gpu-layers"
    assert TABLE.canonical("-c") == "--ctx-size"
    flag = TABLE.get("-nkvo")
    assert flag is not None and flag.negates("-nkvo") and not flag.negates("--kv-offload")
    assert TABLE.by_env["LLAMA_ARG_CTX_SIZE"].canonical == "--ctx-size"


def test_the_memory_settings_are_read_in_llama_servers_defaults() -> None:
    read = read_args(
        ["-m", "m.gguf", "-c", "8192", "-ngl", "20", "-nkvo", "-ctk", "q8_0", "-ctv", "q8_0"], TABLE
    )
    s = read.llama_settings(1)
    assert (s.ctx_size, s.n_gpu_layers, s.kv_offload, s.cache_type_k) == (8192, 20, False, "q8_0")
    assert s.parallel == AUTO_SLOTS and s.kv_unified  # -np unset: 4 slots sharing one pool
    assert read.fit  # llama.cpp fits by itself unless told --fit off
    cpu = read.llama_settings(0)
    assert cpu.gpu_count == 0 and cpu.n_gpu_layers == 0


def test_a_flag_on_the_line_wins_over_its_variable() -> None:
    read = read_args(
        ["-m", "m.gguf", "-c", "1024"],
        TABLE,
        {"LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_N_PARALLEL": "2"},
    )
    s = read.llama_settings(0)
    assert (s.ctx_size, s.parallel, s.kv_unified) == (1024, 2, False)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["-m", "m.gguf", "--ctx-sise", "10"], "not a llama-server flag: --ctx-sise"),
        (["-m", "m.gguf", "-c"], "-c needs a value"),
        (["-c", "10"], "names no model"),
        (["-m", "m.gguf", "-ngl", "many"], "is not a number"),
        (["-m", "m.gguf", "-ot", "exps"], "is not PATTERN=BUFFER_TYPE"),
        (["-m", "m.gguf", "stray"], "unexpected word"),
    ],
)
def test_bad_command_lines_are_refused_with_the_problem(args: list[str], words: str) -> None:
    with pytest.raises(BadInput, match=words):
        read_args(args, TABLE)


def test_the_command_keeps_other_flags_and_rewrites_the_memory_ones(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    command, read = LlamaCommand.from_args(
        [
            "-m",
            str(gguf),
            "-c",
            "2048",
            "--alias",
            "tiny",
            "--port",
            "9001",
            "-ngl",
            "3",
            "--fit",
            "on",
        ],
        TABLE,
    )
    command = command.with_settings(read.llama_settings(1))
    argv = command.argv("llama-server")
    assert argv[argv.index("--n-gpu-layers") + 1] == "3" and argv[argv.index("--fit") + 1] == "off"
    assert "--alias" in argv and argv.count("--ctx-size") == 1 and command.port == 9001
    assert command.explicit_split
    fewer = command.with_settings(replace(command.settings, n_gpu_layers=2))
    assert fewer.key() != command.key()
    with pytest.raises(BadInput, match="does not exist"):
        LlamaCommand.from_args(["-m", str(tmp_path / "none.gguf")], TABLE)


def test_the_load_log_is_read_line_by_line() -> None:
    reader = LlamaLogReader()
    for line in (HERE / "llama_server_load_q8_0.log").read_text().splitlines():
        reader.feed(line)
    assert Phase.WEIGHT_LOADING in reader.phases and Phase.KV_ALLOCATION in reader.phases
    assert {b.kind for b in reader.load_log.buffers} >= {"model", "kv", "compute"}
    assert reader.failure is None


def test_an_allocation_failure_is_read_on_its_line() -> None:
    reader = LlamaLogReader()
    lines = [
        "0.00.064.609 I load_tensors: offloaded 5/5 layers to GPU",
        "0.00.064.676 I load_tensors: RPC0[127.0.0.1:35279] model buffer size =     2.67 MiB",
        "0.00.071.349 E alloc_tensor_range: failed to allocate RPC0[127.0.0.1:35279] "
        "buffer of size 8388608",
        "0.00.071.565 E llama_init_from_model: failed to initialize the context: failed to "
        "allocate buffer for kv cache",
    ]
    news = [reader.feed(line) for line in lines]
    assert news[2].failure is not None and news[2].failure.evidence.line == 3
    assert reader.failed_buffer == ("RPC0[127.0.0.1:35279]", 8388608)
    parsed = reader.parsed()
    assert parsed.failure_phase is not None and parsed.failure_phase.value is Phase.WEIGHT_LOADING


def test_a_cuda_malloc_failure_names_the_device_and_size() -> None:
    reader = LlamaLogReader()
    reader.feed(
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: "
        "cudaMalloc failed: out of memory"
    )
    assert reader.failure is not None and reader.failed_buffer == ("CUDA0", 1024 * 2**20)
