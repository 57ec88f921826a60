"""The engine command: read from every accepted form, changed flag by flag, compared as the
configuration vLLM would run."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.errors import BadInput
from oomguard.serve.command import EngineCommand


def test_forms_read_to_the_same_configuration() -> None:
    serve = EngineCommand.from_tokens(["vllm", "serve", "org/m", "--max-model-len", "4096"])
    module = EngineCommand.from_tokens(
        [
            "python3",
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            "org/m",
            "--max_model_len=4096",
        ]
    )
    pasted = EngineCommand.from_tokens(["vllm serve org/m \\\n  --max-model-len 4k"])
    assert serve.model == module.model == "org/m"
    assert module.python == "python3"
    assert serve.key() == module.key()
    assert pasted.parsed().settings_kwargs["max_model_len"] == 4000  # vLLM's 4k is 4,000


def test_environment_assignments_are_kept_and_part_of_the_configuration() -> None:
    plain = EngineCommand.from_tokens(["vllm", "serve", "m"])
    with_env = EngineCommand.from_tokens(
        ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "vllm", "serve", "m"]
    )
    assert with_env.env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert plain.key() != with_env.key()
    assert with_env.display().startswith("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True vllm")


@pytest.mark.parametrize(
    "spelling",
    [["--max-model-len", "1024"], ["--max_model_len", "1024"], ["--max-model-len=1024"]],
)
def test_with_flag_replaces_every_spelling(spelling: list[str]) -> None:
    command = EngineCommand.from_tokens(["vllm", "serve", "m", *spelling, "--enforce-eager"])
    changed = command.with_flag("--max-model-len", "512")
    assert changed.parsed().settings_kwargs["max_model_len"] == 512
    assert changed.args.count("--max-model-len") == 1 and "1024" not in " ".join(changed.args)
    assert changed.parsed().settings_kwargs["enforce_eager"] is True


def test_boolean_flags_and_their_negations() -> None:
    command = EngineCommand.from_tokens(["vllm", "serve", "m", "--no-enforce-eager"])
    eager = command.with_flag("--enforce-eager", None)
    assert eager.parsed().settings_kwargs["enforce_eager"] is True
    assert "--no-enforce-eager" not in eager.args


def test_an_appended_flag_wins_over_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 8192\ngpu-memory-utilization: 0.9\n")
    command = EngineCommand.from_tokens(
        ["vllm", "serve", "m", "--config", "serve.yaml"], base_dir=tmp_path
    )
    assert command.parsed().settings_kwargs["max_model_len"] == 8192
    changed = command.with_flag("--max-model-len", "4096")
    assert changed.parsed().settings_kwargs["max_model_len"] == 4096
    assert changed.parsed().settings_kwargs["gpu_memory_utilization"] == 0.9
    assert command.key() != changed.key()


def test_where_it_listens_is_not_the_configuration() -> None:
    a = EngineCommand.from_tokens(["vllm", "serve", "m", "--port", "8001"])
    b = EngineCommand.from_tokens(["vllm", "serve", "m", "--host", "0.0.0.0", "--port", "9000"])
    assert a.key() == b.key()
    assert a.base_url == "http://127.0.0.1:8001" and b.base_url == "http://127.0.0.1:9000"
    assert (
        b.bind_host == "0.0.0.0" and EngineCommand.from_tokens(["vllm", "serve", "m"]).port == 8000
    )


@pytest.mark.parametrize(
    ("tokens", "words"),
    [
        (["vllm", "serve", "m", "--max-modle-len", "5"], "not a vLLM flag: --max-modle-len"),
        (["docker", "run", "vllm/vllm-openai:latest", "--model", "m"], "container"),
        (["vllm", "bench", "m"], "only 'vllm serve'"),
        (["python", "train.py"], "does not start vLLM's server"),
        (["vllm", "serve"], "names no model"),
        (["vllm", "serve", "m", "--max-model-len", "lots"], "max-model-len"),
    ],
)
def test_bad_commands_are_refused_with_one_line(tokens: list[str], words: str) -> None:
    with pytest.raises(BadInput) as info:
        EngineCommand.from_tokens(tokens)
    assert words in info.value.one_line() and "\n" not in info.value.one_line()
