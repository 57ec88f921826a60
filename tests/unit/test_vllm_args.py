"""Reading pasted vLLM command lines and writing them back."""

from __future__ import annotations

import pytest
import yaml

from oomguard.errors import BadInput, MalformedConfig
from oomguard.memory.engine import EngineSettings
from oomguard.vllm_args import (
    parse_command,
    parse_human_int,
    render_llm,
    render_serve,
    render_yaml,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1k", 1000),
        ("1K", 1024),
        ("25.6k", 25600),
        ("20G", 20 * 2**30),
        ("2m", 2_000_000),
        ("8192", 8192),
    ],
)
def test_human_ints_follow_vllm(text: str, expected: int) -> None:
    assert parse_human_int(text) == expected


def test_human_int_rejects_decimal_binary_and_garbage() -> None:
    with pytest.raises(BadInput, match="decimals are not allowed"):
        parse_human_int("1.5K")
    with pytest.raises(BadInput, match="not an integer"):
        parse_human_int("lots")
    assert parse_human_int("auto", allow_auto=True) == -1


def test_vllm_serve_with_every_flag_form() -> None:
    cmd = (
        "CUDA_VISIBLE_DEVICES=0,1 vllm serve meta-llama/Llama-3.1-8B-Instruct \\\n"
        "  -tp 2 --gpu-memory-utilization=0.85 --max-model-len 16k --max-num-seqs 32 \\\n"
        "  --max-num-batched-tokens 4K --kv-cache-dtype fp8 --no-enable-prefix-caching "
        "--enforce-eager --port 8000 --served-model-name chat"
    )
    parsed = parse_command(cmd)
    assert parsed.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert parsed.settings_kwargs == {
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.85,
        "max_model_len": 16000,
        "max_num_seqs": 32,
        "max_num_batched_tokens": 4096,
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": False,
        "enforce_eager": True,
    }
    assert parsed.other_flags == {"port": "8000", "served-model-name": ["chat"]}
    assert parsed.unknown == ()
    settings = parsed.settings()
    assert isinstance(settings, EngineSettings) and settings.tensor_parallel_size == 2


def test_api_server_module_form_and_underscored_flags() -> None:
    parsed = parse_command(
        "python3 -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-7B-Instruct "
        "--tensor_parallel_size 1 --max-model-len auto --quantization fp8"
    )
    assert parsed.model == "Qwen/Qwen2.5-7B-Instruct"
    assert parsed.settings_kwargs["max_model_len"] == -1
    assert parsed.settings_kwargs["quantization"] == "fp8"


def test_unknown_and_unmodelled_flags_are_reported_not_dropped() -> None:
    parsed = parse_command(
        "vllm serve m --bogus 3 --lora-target-modules o_proj --hf-overrides {} --swap-space 8"
    )
    assert parsed.unknown == ("bogus",)
    assert set(parsed.unmodelled) == {"lora-target-modules", "hf-overrides", "swap-space"}
    assert parsed.other_flags["bogus"] == "3"
    notes = " ".join(parsed.notes())
    assert "--bogus" in notes and "--lora-target-modules" in notes


def test_lora_and_multimodal_flags_are_settings_not_unmodelled() -> None:
    parsed = parse_command(
        "vllm serve m --enable-lora --max-loras 4 --max-lora-rank 64 --max-cpu-loras 8 "
        "--lora-dtype bfloat16 --fully-sharded-loras --limit-mm-per-prompt '{\"image\": 2}' "
        "--skip-mm-profiling --mm-encoder-tp-mode data --mm-processor-cache-gb 0 "
        "--mm-processor-cache-type shm"
    )
    assert parsed.unmodelled == () and parsed.unknown == ()
    assert parsed.settings_kwargs == {
        "enable_lora": True,
        "max_loras": 4,
        "max_lora_rank": 64,
        "max_cpu_loras": 8,
        "lora_dtype": "bfloat16",
        "fully_sharded_loras": True,
        "limit_mm_per_prompt": '{"image":{"count":2}}',
        "skip_mm_profiling": True,
        "mm_encoder_tp_mode": "data",
        "mm_processor_cache_gb": 0.0,
        "mm_processor_cache_type": "shm",
    }


def test_dotted_json_flags_fold_into_one_value_as_vllm_does() -> None:
    parsed = parse_command(
        "vllm serve m --limit-mm-per-prompt '{\"audio\": 1}' --limit-mm-per-prompt.image 0 "
        "--limit-mm-per-prompt.video.count 1 --limit-mm-per-prompt.video.num_frames 16"
    )
    # the dotted keys are merged after the JSON value and replace it (argparse: last wins)
    limits = parsed.settings_kwargs["limit_mm_per_prompt"]
    assert limits == '{"image":{"count":0},"video":{"count":1,"num_frames":16}}'
    again = parse_command(render_serve("m", parsed.settings()))
    assert again.settings_kwargs["limit_mm_per_prompt"] == limits


@pytest.mark.parametrize(
    ("flags", "message", "fix"),
    [
        ("--limit-mm-per-prompt image=2,video=0", "is not JSON", '{"image": 2'),
        ("--limit-mm-per-prompt '[1]'", "not a JSON object", '{"image": 2}'),
        ('--limit-mm-per-prompt \'{"image": {"frames": 2}}\'', "no option", "width"),
        ("--limit-mm-per-prompt '{\"video\": -1}'", "at least 0", "count"),
        ("--max-lora-rank 24", "not a rank vLLM accepts", "16, 32"),
        ("--lora-dtype float32", "not a value vLLM accepts", "bfloat16"),
        ("--mm-encoder-tp-mode sharded", "not a value vLLM accepts", "data"),
        ("--max-loras 0", "must be positive", "positive"),
    ],
)
def test_malformed_lora_and_multimodal_values_are_one_line_errors(
    flags: str, message: str, fix: str
) -> None:
    with pytest.raises(BadInput) as err:
        parse_command(f"vllm serve m {flags}")
    assert message in str(err.value) and fix in err.value.hint


@pytest.mark.parametrize(
    ("cmd", "message"),
    [
        ("vllm serve m --gpu-memory-utilization 1.5", "outside"),
        ("vllm serve m --max-model-len -5", "must be positive"),
        ("vllm serve m --max-num-seqs zero", "not an integer"),
        ("vllm serve m --kv-cache-dtype fp7", "not a value vLLM accepts"),
        ("vllm serve m --tensor-parallel-size 0", "must be positive"),
        ("vllm serve m --max-model-len", "needs a value"),
        ("vllm chat m", "only 'vllm serve'"),
        ("vllm serve --port 8000", "names no model"),
        ("vllm serve 'm", "cannot read the command line"),
    ],
)
def test_bad_values_raise_one_line(cmd: str, message: str) -> None:
    with pytest.raises(BadInput, match=message) as info:
        parse_command(cmd)
    assert "\n" not in info.value.one_line()


def test_config_yaml_is_read_and_command_line_wins(tmp_path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: Qwen/Qwen3-8B\ntensor-parallel-size: 2\nmax_model_len: 8192\n"
        "enable-prefix-caching: false\nport: 9000\n"
    )
    parsed = parse_command(f"vllm serve --config {config} --max-model-len 4096")
    assert parsed.model == "Qwen/Qwen3-8B"
    assert parsed.settings_kwargs["tensor_parallel_size"] == 2
    assert parsed.settings_kwargs["max_model_len"] == 4096  # command line beats the file
    assert parsed.settings_kwargs["enable_prefix_caching"] is False
    assert parsed.config_file == str(config)


def test_malformed_config_file(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("tensor-parallel-size: [1,\n")
    with pytest.raises(MalformedConfig):
        parse_command(f"vllm serve m --config {bad}")
    with pytest.raises(BadInput, match="no such file"):
        parse_command(f"vllm serve m --config {tmp_path / 'missing.yaml'}")
    with pytest.raises(MalformedConfig, match="yaml"):
        parse_command(f"vllm serve m --config {tmp_path / 'x.json'}")


ROUND_TRIP = [
    EngineSettings(),
    EngineSettings(
        tensor_parallel_size=4, max_model_len=8192, max_num_seqs=16, kv_cache_dtype="fp8"
    ),
    EngineSettings(
        gpu_memory_utilization=0.85,
        max_num_batched_tokens=2048,
        quantization="fp8",
        enable_prefix_caching=False,
        enforce_eager=True,
        kv_cache_memory_bytes=20 * 2**30,
        cpu_offload_gb=12.5,
        max_model_len=-1,
        pipeline_parallel_size=2,
    ),
]


@pytest.mark.parametrize("settings", ROUND_TRIP)
def test_serve_command_round_trip(settings: EngineSettings) -> None:
    for multiline in (False, True):
        text = render_serve("org/model", settings, multiline=multiline)
        parsed = parse_command(text)
        assert parsed.model == "org/model"
        assert parsed.settings() == settings
        assert parsed.unknown == ()


@pytest.mark.parametrize("settings", ROUND_TRIP)
def test_yaml_round_trip_through_config_flag(settings: EngineSettings, tmp_path) -> None:
    path = tmp_path / "plan.yaml"
    path.write_text(render_yaml("org/model", settings))
    assert yaml.safe_load(path.read_text())["model"] == "org/model"
    parsed = parse_command(["vllm", "serve", "--config", str(path)])
    assert parsed.settings() == settings


def test_other_flags_survive_rendering() -> None:
    parsed = parse_command("vllm serve m --max-model-len 4096 --port 8000 --trust-remote-code")
    again = parse_command(
        render_serve(parsed.model, parsed.settings(), other_flags=parsed.other_flags)
    )
    assert again.other_flags == parsed.other_flags
    assert again.settings_kwargs == parsed.settings_kwargs


def test_llm_kwargs_render_is_python() -> None:
    text = render_llm("org/model", EngineSettings(max_model_len=8192, enforce_eager=True))
    assert text == "LLM(model='org/model', max_model_len=8192, enforce_eager=True)"
    call = text.replace("LLM(", "dict(", 1)
    assert eval(call) == {"model": "org/model", "max_model_len": 8192, "enforce_eager": True}  # noqa: S307


def test_docker_run_of_the_vllm_image_reads_the_arguments_after_the_image() -> None:
    cmd = parse_command(
        "docker run --runtime nvidia --gpus all -v ~/.cache/huggingface:/root/.cache/huggingface "
        "-p 8000:8000 --ipc=host vllm/vllm-openai:v0.8.5 --model Qwen/Qwen2.5-7B-Instruct "
        "--max-model-len 8192 --gpu-memory-utilization 0.85"
    )
    assert cmd.model == "Qwen/Qwen2.5-7B-Instruct"
    assert cmd.settings_kwargs["max_model_len"] == 8192
    assert cmd.settings_kwargs["gpu_memory_utilization"] == 0.85
    # a registry in front of the image, and the positional model of `vllm serve` images
    cmd = parse_command(
        "podman run -d docker.io/vllm/vllm-openai:latest serve org/m --max-num-seqs 64"
    )
    assert cmd.model == "org/m" and cmd.settings_kwargs["max_num_seqs"] == 64


def test_docker_run_of_another_image_is_refused_with_the_fix() -> None:
    with pytest.raises(BadInput) as err:
        parse_command("docker run -d nginx:latest")
    assert "vLLM image" in err.value.message and "vllm/vllm-openai" in err.value.hint


def test_one_launcher_parser_for_plan_serve_and_the_log() -> None:
    from oomguard.serve.command import EngineCommand
    from oomguard.vllm_args import split_launcher

    line = [
        "CUDA_VISIBLE_DEVICES=0",
        "env",
        "HF_HOME=/x",
        "python3",
        "-u",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "org/m",
        "--max-model-len",
        "8k",
    ]
    launcher = split_launcher(line)
    assert launcher.form == "python" and not launcher.positional_model
    assert launcher.env == {"CUDA_VISIBLE_DEVICES": "0", "HF_HOME": "/x"}
    assert launcher.python == "python3" and launcher.args[:2] == ["--model", "org/m"]
    # plan and serve read the same line the same way
    assert parse_command(line).model == "org/m"
    served = EngineCommand.from_tokens(line)
    assert served.model == "org/m" and served.python == "python3" and served.env["HF_HOME"] == "/x"
    docker = split_launcher(["docker", "run", "vllm/vllm-openai:latest", "serve", "org/m"])
    assert docker.form == "container" and docker.tool == "docker" and docker.args == ["org/m"]


def test_settings_from_flags_parses_like_a_pasted_command() -> None:
    from oomguard.vllm_args import settings_from_flags

    got = settings_from_flags(
        {
            "max_model_len": "16k",
            "max_num_batched_tokens": "8K",
            "kv_cache_memory_bytes": "20G",
            "enforce_eager": True,
            "gpu_memory_utilization": 0.85,
            "max_num_seqs": None,
            "vllm_version": "0.19",
        }
    )
    assert got == {
        "max_model_len": 16000,
        "max_num_batched_tokens": 8192,
        "kv_cache_memory_bytes": 20 * 2**30,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.85,
        "vllm_version": "0.19",
    }
    assert settings_from_flags({"max_model_len": "auto"}) == {"max_model_len": -1}
    for bad in ({"gpu_memory_utilization": 1.5}, {"max_num_seqs": 0}, {"kv_cache_dtype": "fp7"}):
        with pytest.raises(BadInput):
            settings_from_flags(bad)
