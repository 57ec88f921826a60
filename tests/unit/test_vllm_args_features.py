"""The flags of context parallelism, KV offloading, sleep mode, CUDA graphs and the Mamba
caches, read from a pasted command as vLLM's parser reads them (docs/memory-model.md §14)."""

from __future__ import annotations

import json

import pytest

from oomguard.errors import BadInput
from oomguard.memory.engine import EngineSettings
from oomguard.vllm_args import (
    UNMODELLED_MEMORY_FLAGS,
    parse_command,
    render_llm,
    render_serve,
    render_yaml,
    settings_from_flags,
)

PASTED = (
    "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 vllm serve org/m -tp 4 -dcp 2 -pcp 2 "
    "--kv-offloading-size 64 --kv-offloading-backend native "
    """--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}' """
    "--enable-sleep-mode "
    """-cc '{"cudagraph_mode": "PIECEWISE"}' --cudagraph-capture-sizes 1 2 4 8 """
    "--mamba-cache-dtype float32 --mamba-ssm-cache-dtype float16 --mamba-block-size 256 "
    "--mamba-cache-mode align"
)


def test_every_flag_becomes_a_setting() -> None:
    parsed = parse_command(PASTED)
    s = parsed.settings()
    assert (s.decode_context_parallel_size, s.prefill_context_parallel_size) == (2, 2)
    assert (s.kv_offloading_size, s.kv_offloading_backend) == (64.0, "native")
    assert json.loads(s.kv_transfer_config or "") == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
    }
    assert s.enable_sleep_mode is True
    assert json.loads(s.compilation_config or "") == {"cudagraph_mode": "PIECEWISE"}
    assert s.cudagraph_capture_sizes == (1, 2, 4, 8)
    assert (s.mamba_cache_dtype, s.mamba_ssm_cache_dtype) == ("float32", "float16")
    assert (s.mamba_block_size, s.mamba_cache_mode) == (256, "align")
    assert s.estimate_cudagraphs is False
    assert parsed.unmodelled == () and parsed.unknown == ()


def test_priced_flags_left_the_unmodelled_list() -> None:
    priced = {
        "decode-context-parallel-size",
        "prefill-context-parallel-size",
        "kv-offloading-size",
        "kv-transfer-config",
        "enable-sleep-mode",
        "compilation-config",
        "cudagraph-capture-sizes",
        "max-cudagraph-capture-size",
        "mamba-cache-dtype",
        "mamba-ssm-cache-dtype",
        "mamba-block-size",
        "mamba-cache-mode",
    }
    assert not priced & UNMODELLED_MEMORY_FLAGS


def test_commands_render_back_and_read_again(tmp_path) -> None:
    s = parse_command(PASTED).settings(estimate_cudagraphs=None)
    assert parse_command(render_serve("org/m", s)).settings() == s
    path = tmp_path / "plan.yaml"
    path.write_text(render_yaml("org/m", s))
    assert parse_command(["vllm", "serve", "--config", str(path)]).settings() == s
    assert "compilation_config={'cudagraph_mode': 'PIECEWISE'}" in render_llm("org/m", s)
    assert "cudagraph_capture_sizes=[1, 2, 4, 8]" in render_llm("org/m", s)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--kv-transfer-config '{kv_connector: x}'", "--kv-transfer-config is not valid JSON"),
        ("--compilation-config '[1]'", "--compilation-config must be a JSON object"),
        ("""-cc '{"cudagraph_mode": "ALWAYS"}'""", "cudagraph_mode 'ALWAYS' is not a mode"),
        ("--cudagraph-capture-sizes 1 x", "--cudagraph-capture-sizes 'x' is not an integer"),
        ("--kv-offloading-size 0", "--kv-offloading-size '0' must be positive"),
        ("--kv-offloading-backend disk", "is not a value vLLM accepts"),
        ("--mamba-cache-dtype fp8", "is not a value vLLM accepts"),
        ("-dcp 0", "must be positive"),
    ],
)
def test_malformed_values_give_one_line(flags: str, message: str) -> None:
    with pytest.raises(BadInput) as caught:
        parse_command(f"vllm serve org/m {flags}")
    assert message in caught.value.message
    assert "\n" not in caught.value.one_line()


def test_estimate_variable_must_be_an_integer() -> None:
    with pytest.raises(BadInput) as caught:
        parse_command("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=yes vllm serve org/m")
    assert (
        caught.value.message == "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS='yes' is not an integer"
    )
    assert caught.value.hint == "set it to 0 or 1"


def test_cli_values_are_parsed_like_the_pasted_flags() -> None:
    out = settings_from_flags(
        {
            "cudagraph_capture_sizes": "1,2,4",
            "kv_offloading_size": "8",
            "compilation_config": '{"max_cudagraph_capture_size": 64}',
            "enable_sleep_mode": True,
        }
    )
    assert out["cudagraph_capture_sizes"] == (1, 2, 4)
    assert out["kv_offloading_size"] == 8.0
    assert json.loads(out["compilation_config"]) == {"max_cudagraph_capture_size": 64}
    assert EngineSettings(**out).enable_sleep_mode is True
