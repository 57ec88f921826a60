"""``--speculative-config`` in plan, the pasted command and the rendered commands."""

from __future__ import annotations

import json

import pytest

from oomguard.cli import main
from oomguard.errors import BadInput
from oomguard.memory.engine import EngineSettings
from oomguard.memory.speculative import SpeculativeConfig
from oomguard.vllm_args import parse_command, render_serve, render_yaml, settings_from_flags

EAGLE3_JSON = '{"method":"eagle3","model":"AngelSlim/Qwen3-8B_eagle3","num_speculative_tokens":3}'


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_names_the_drafters_memory(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["Qwen/Qwen3-8B", "--gpu", "H100", "--max-model-len", "32768", "--offline"]
    code, out, _ = _plan(capsys, *args, "--speculative-config", EAGLE3_JSON)
    assert code == 0
    text = " ".join(out.split())
    assert "speculative decoding: eagle3, 3 tokens; drafter AngelSlim/Qwen3-8B_eagle3" in text
    assert "1 KV layer(s) in the shared pool" in text
    assert "config not available locally" in text  # the head is not catalogued: said so
    assert "--speculative-config" in text  # the command to run carries it back
    # the drafter's layer: Qwen3-8B's 36 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes, + 1
    code, out, _ = _plan(capsys, *args, "--speculative-config", EAGLE3_JSON, "--json")
    data = json.loads(out)
    assert data["kv_bytes_per_token"] == 37 * 8 * 128 * 2 * 2
    assert data["notes"][0].startswith("speculative decoding: eagle3")


def test_plan_prices_a_checkpoints_mtp_layer(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["Qwen/Qwen3.6-27B", "--gpu", "H200", "--max-model-len", "65536", "--offline"]
    code, out, _ = _plan(capsys, *args, "--spec-method", "qwen3_5_mtp", "--spec-tokens", "2")
    assert code == 0
    assert "speculative decoding: mtp, 2 tokens" in " ".join(out.split())


@pytest.mark.parametrize(
    "value", ['{"method":"eagle3",', '{"method":"eagle9","num_speculative_tokens":2}']
)
def test_bad_speculative_config_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    code, out, err = _plan(capsys, "Qwen/Qwen3-8B", "--gpu", "H100", "--speculative-config", value)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err + out


def test_pasted_command_reads_the_json_and_the_older_flags() -> None:
    parsed = parse_command(
        'vllm serve Qwen/Qwen3-8B -sc \'{"model":"d","num_speculative_tokens":2}\' '
        "--spec-method eagle3"
    )
    cfg = parsed.settings_kwargs["speculative_config"]
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("eagle3", "d", 2)
    assert "speculative-config" not in parsed.unmodelled
    with pytest.raises(BadInput, match="mutually exclusive"):
        parse_command('vllm serve M --speculative-config \'{"method":"mtp"}\' --spec-method mtp')


def test_flags_and_rendered_commands_round_trip() -> None:
    fields = settings_from_flags(
        {"speculative_config": None, "spec_method": "mtp", "spec_tokens": 1}
    )
    assert fields["speculative_config"] == SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    settings = EngineSettings(speculative_config=fields["speculative_config"])
    line = render_serve("M", settings)
    assert parse_command(line).settings_kwargs["speculative_config"] == settings.speculative_config
    assert "num_speculative_tokens: 1" in render_yaml("M", settings)
