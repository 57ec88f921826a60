"""``oomguard serve``'s bad input: one line naming the problem and the fix, exit 2, nothing
launched."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.cli import main
from oomguard.errors import EXIT_ENVIRONMENT


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["--", "vllm", "serve", "m", "--max-modle-len", "512"],
            "not a vLLM flag: --max-modle-len",
        ),
        (["--max-model-len", "512", "--", "vllm", "serve", "m"], "given beside a pasted command"),
        (["--max-attempts", "0", "--", "vllm", "serve", "m"], "--max-attempts 0"),
        (["--", "docker", "run", "vllm/vllm-openai", "--model", "m"], "container"),
        (["--p99-tokens", "0", "--", "vllm", "serve", "m"], "--p99-tokens 0"),
        ([], "nothing to serve"),
        (["m", "--enable-lora", "--max-lora-rank", "24"], "--max-lora-rank 24"),
        (["m", "--limit-mm-per-prompt", "image=2"], "is not JSON"),
        (["--", "vllm", "serve", "m", "--mm-encoder-tp-mode", "split"], "not a value vLLM"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_no_vllm_is_one_line_and_an_environment_exit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-python"
    code = main(["serve", "--json", "--vllm-python", str(missing), "--", "vllm", "serve", "m"])
    assert code == EXIT_ENVIRONMENT
    out = capsys.readouterr()
    assert "no vLLM installation found" in out.err and len(out.err.strip().splitlines()) == 1
    assert '"event": "exit"' in out.out and '"event": "launch"' not in out.out
