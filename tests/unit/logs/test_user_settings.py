"""The user's own arguments are told apart from the engine's resolved config."""

from __future__ import annotations

from oomguard.logs import parse_stream


def test_non_default_args_are_the_users_settings() -> None:
    parsed = parse_stream(
        [
            "INFO 05-01 10:00:00 [utils.py:233] non-default args: {'model': 'm', "
            "'max_num_batched_tokens': 4096, 'enforce_eager': True}",
            "INFO 05-01 10:00:01 [core.py:70] Initializing a V1 LLM engine (v0.10.1) with config: "
            "model='m', dtype=torch.bfloat16, max_seq_len=4096, tensor_parallel_size=1, "
            "pipeline_parallel_size=1, quantization=None, enforce_eager=True, kv_cache_dtype=auto",
        ]
    )
    assert parsed.user_settings == {
        "model": "m",
        "max_num_batched_tokens": 4096,
        "enforce_eager": True,
    }
    assert parsed.user_args_evidence is not None and parsed.user_args_evidence.line == 1
    # the engine config states the values in force
    assert parsed.get("dtype") == "bfloat16" and parsed.get("pipeline_parallel_size") == 1
    assert parsed.to_dict()["user_settings"]["max_num_batched_tokens"] == 4096


def test_engine_config_alone_states_no_user_settings() -> None:
    parsed = parse_stream(
        [
            "INFO 03-01 09:00:00 llm_engine.py:237] Initializing an LLM engine (v0.6.3) with "
            "config: model='m', dtype=torch.float16, max_seq_len=2048, tensor_parallel_size=2, "
            "pipeline_parallel_size=1, quantization=awq, enforce_eager=False, kv_cache_dtype=auto",
        ]
    )
    assert parsed.user_settings == {} and parsed.user_args_evidence is None
    assert parsed.get("quantization") == "awq" and parsed.get("tensor_parallel_size") == 2


def test_namespace_args_are_the_users_settings() -> None:
    parsed = parse_stream(
        [
            "INFO 03-01 09:00:00 api_server.py:585] args: Namespace(host=None, port=8000, "
            "model='m', dtype='auto', max_num_batched_tokens=None, max_num_seqs=32, "
            "enforce_eager=False, quantization=None)"
        ]
    )
    assert parsed.user_args_evidence is not None
    assert parsed.user_settings["max_num_seqs"] == 32
    assert parsed.user_settings["dtype"] == "auto"
    assert "max_num_batched_tokens" not in parsed.user_settings  # None: left to vLLM
