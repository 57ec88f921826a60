"""``oomguard serve`` with llama.cpp: the forms it reads and its bad input (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.cli import main
from oomguard.guard.config import build_config
from oomguard.guard.llama_backend import SlotLayout, blocks_for
from oomguard.serve.llama_session import PastedLlamaCommand, is_llama_server


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["--engine", "vllm", "--", "llama-server", "-m", "m.gguf"],
            "--engine vllm given with a llama-server command",
        ),
        (
            ["--engine", "llama.cpp", "--", "vllm", "serve", "m"],
            "--engine llama.cpp given with a vLLM command",
        ),
        (["m.gguf", "--max-model-len", "512"], "vLLM flags"),
        (["--engine", "tgi", "m"], "--engine tgi is not an engine"),
        (
            ["--llama-server", "/no/such/binary", "--", "llama-server", "-m", "m.gguf"],
            "is not a file",
        ),
    ],
)
def test_bad_llama_input_is_one_line_and_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_pasted_llama_server_command_keeps_its_binary_and_environment(tmp_path: Path) -> None:
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    binary.write_text("")
    pasted = PastedLlamaCommand.from_tokens(
        ["LLAMA_ARG_CTX_SIZE=4096", str(binary), "-m", "m.gguf"]
    )
    assert pasted.binary == str(binary) and pasted.env == {"LLAMA_ARG_CTX_SIZE": "4096"}
    assert pasted.args == ("-m", "m.gguf")
    assert PastedLlamaCommand.from_tokens(["llama-server", "-m", "m.gguf"]).binary is None
    assert is_llama_server("./build/bin/llama-server") and not is_llama_server("vllm")


def test_slot_layouts_give_the_capacity_the_pool_holds() -> None:
    separate = SlotLayout(slots=4, n_ctx_per_slot=2048, kv_unified=False)
    assert (separate.block_tokens, separate.capacity_tokens) == (2048, 8192)
    assert blocks_for(separate, 2048) == 1 and blocks_for(separate, 10) == 1
    shared = SlotLayout(slots=4, n_ctx_per_slot=8192, kv_unified=True)
    assert (shared.block_tokens, shared.capacity_tokens) == (2048, 8192)
    assert (
        blocks_for(shared, 8192) == 4
    )  # one request may fill the whole pool, then nothing else runs
    unknown = SlotLayout(slots=4, n_ctx_per_slot=2048, kv_unified=None)
    assert unknown.shared_pool and unknown.capacity_tokens == 2048 and "assumed" in unknown.basis()


def test_the_guard_config_takes_a_llama_backend() -> None:
    config = build_config(
        {"backends": [{"url": "http://127.0.0.1:8080", "engine": "llama.cpp", "kv_unified": False}]}
    )
    assert config.backends[0].engine == "llama.cpp" and config.backends[0].kv_unified is False
    with pytest.raises(Exception, match="engine"):
        build_config({"backends": [{"url": "http://127.0.0.1:8080", "engine": "tgi"}]})
