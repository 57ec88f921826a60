"""Read a pasted vLLM command line into settings, and write settings back as commands.

Accepts what users paste: ``vllm serve MODEL --flag value``, ``python -m
vllm.entrypoints.openai.api_server --model MODEL``, ``--flag=value``, boolean flags and their
``--no-`` forms, vLLM's human-readable integers (``1k`` = 1000, ``1K`` = 1024, ``20G`` =
20·2^30), leading ``VAR=value`` environment assignments, backslash line continuations and
``--config file.yaml`` (vLLM's flat YAML: keys are flag names; command-line flags win).

Every flag is accounted for: the ones the memory model uses become :class:`EngineSettings`
fields; other real vLLM flags are kept (and those that change memory in ways the model does not
account for are named); anything else is reported as unknown, never silently dropped.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomguard._vllm_flags import ALIASES, BOOL_FLAGS, LIST_FLAGS, VALUE_FLAGS
from oomguard.errors import BadInput, MalformedConfig
from oomguard.memory.lora import LORA_DTYPES, LORA_RANKS
from oomguard.memory.multimodal import ENCODER_TP_MODES, PROCESSOR_CACHE_TYPES, SIZE_OPTIONS
from oomguard.memory.speculative import (
    LEGACY_FLAGS,
    SpeculativeConfig,
    merge_legacy,
    parse_speculative_config,
)
from oomguard.units import GIB, KIB, MIB, TIB

if TYPE_CHECKING:
    from oomguard.memory.engine import EngineSettings

# Choices vLLM accepts (vLLM 0.32.0 argument parser; quantization: QUANTIZATION_METHODS plus
# methods of older releases users still pass).
DTYPE_CHOICES = ("auto", "bfloat16", "float", "float16", "float32", "half")
KV_CACHE_DTYPE_CHOICES = (
    "auto",
    "bfloat16",
    "float16",
    "fp8",
    "fp8_ds_mla",
    "fp8_e4m3",
    "fp8_e5m2",
    "fp8_inc",
    "fp8_per_token_head",
    "int4_per_token_head",
    "int8_per_token_head",
    "nvfp4",
    "nvfp4_4over6",
    "nvfp4_ds_mla",
    "turboquant_3bit_nc",
    "turboquant_4bit_nc",
    "turboquant_k3v4_nc",
    "turboquant_k8v4",
    "ultraquant_4bit",
)
QUANTIZATION_CHOICES = (
    "aqlm",
    "auto_awq",
    "auto_gptq",
    "awq",
    "awq_marlin",
    "bitblas",
    "bitsandbytes",
    "compressed-tensors",
    "deepseek_v4_fp8",
    "deepspeedfp",
    "experts_int8",
    "fbgemm_fp8",
    "fp8",
    "fp8_per_block",
    "fp8_per_channel",
    "fp8_per_tensor",
    "fp_quant",
    "gguf",
    "gpt_oss_mxfp4",
    "gptq",
    "gptq_bitblas",
    "gptq_marlin",
    "gptq_marlin_24",
    "hqq",
    "humming",
    "inc",
    "int8_per_channel_weight_only",
    "ipex",
    "marlin",
    "modelopt",
    "modelopt_fp4",
    "modelopt_mixed",
    "modelopt_mxfp8",
    "moe_wna16",
    "mxfp4",
    "mxfp8",
    "nvfp4_per_token",
    "online",
    "petit_nvfp4",
    "ptpc_fp8",
    "qqq",
    "quark",
    "rtn",
    "torchao",
    "tpu_int8",
)
PERFORMANCE_MODE_CHOICES = ("balanced", "interactivity", "throughput")

# vLLM flags that change GPU memory in ways the memory model does not account for: the plan
# names them so the user knows the prediction ignores them.
UNMODELLED_MEMORY_FLAGS = frozenset(
    {
        "lora-target-modules",  # LoRA is priced on every module it may wrap (an upper bound)
        "enable-tower-connector-lora",  # LoRA buffers on the vision tower and connector
        "enable-moe-shared-loras",  # expert LoRA stacks shared across experts (fewer bytes)
        "specialize-active-lora",  # graphs per power-of-two adapter count (more graphs)
        "speculative-model",
        "num-speculative-tokens",
        "mm-ipc-gpu-memory-gb",
        "disable-sliding-window",
        "disable-hybrid-kv-cache-manager",
        "swap-space",
        "hf-overrides",
        "async-scheduling",
        "max-seq-len-to-capture",
    }
)

_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": KIB, "M": MIB, "G": GIB, "T": TIB}


def parse_human_int(text: str, *, flag: str = "value", allow_auto: bool = False) -> int:
    """Parse an integer the way vLLM does: ``1k``=1000, ``1K``=1024, ``25.6k``=25600.

    Decimals are allowed only with the decimal suffixes k/m/g/t. With ``allow_auto``
    (``--max-model-len``), ``auto`` and ``-1`` give -1 (auto-fit). Raises :class:`BadInput`.
    """
    value = str(text).strip()
    if allow_auto and (value == "-1" or value.lower() == "auto"):
        return -1
    match = _HUMAN_INT.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        if "." in number:
            raise BadInput(
                f"{flag} {value!r}: decimals are not allowed with the binary suffix {suffix}",
                f"write {number}{suffix.lower()} (decimal) or a whole number of {suffix}",
            )
        return int(number) * _BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise BadInput(
            f"{flag} {value!r} is not an integer",
            "use a whole number, optionally with k/m/g (×1000) or K/M/G (×1024) as vLLM does",
        ) from None


def parse_float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise BadInput(f"{flag} {text!r} is not a number", f"pass a number to {flag}") from None


def _parse_int(text: str, flag: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise BadInput(
            f"{flag} {text!r} is not an integer", f"pass a whole number to {flag}"
        ) from None


def _parse_bool(text: str, flag: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise BadInput(f"{flag} {text!r} is not true or false", f"write {flag} or --no-{flag[2:]}")


def choice_parser(choices: Sequence[str]) -> Callable[[str, str], str]:
    def parse(text: str, flag: str) -> str:
        value = str(text).strip()
        if value not in choices:
            shown = ", ".join(choices[:12]) + (", …" if len(choices) > 12 else "")
            raise BadInput(f"{flag} {value!r} is not a value vLLM accepts", f"use one of: {shown}")
        return value

    return parse


def _optional_choice(choices: Sequence[str]) -> Callable[[str, str], str | None]:
    inner = choice_parser(choices)

    def parse(text: str, flag: str) -> str | None:
        if str(text).strip().lower() in ("none", "null", ""):
            return None
        return inner(text, flag)

    return parse


def _positive(parse: Callable[[str, str], int]) -> Callable[[str, str], int]:
    def checked(text: str, flag: str) -> int:
        value = parse(text, flag)
        if value <= 0:
            raise BadInput(f"{flag} {text!r} must be positive", f"pass a positive number to {flag}")
        return value

    return checked


def parse_max_model_len(text: str, flag: str) -> int:
    value = parse_human_int(text, flag=flag, allow_auto=True)
    if value == 0 or value < -1:
        raise BadInput(
            f"{flag} {text!r}: a context length must be positive",
            "pass the longest prompt+output in tokens, or 'auto' (-1) to let vLLM fit it",
        )
    return value


def _utilization(text: str, flag: str) -> float:
    value = parse_float(text, flag)
    if not 0.0 < value <= 1.0:
        raise BadInput(
            f"{flag} {value} is outside (0, 1]",
            "it is the fraction of the GPU's total memory vLLM may use, e.g. 0.85",
        )
    return value


def _non_negative_float(text: str, flag: str) -> float:
    value = parse_float(text, flag)
    if value < 0:
        raise BadInput(f"{flag} {text!r} must not be negative", f"pass 0 or more to {flag}")
    return value


def _human(text: str, flag: str) -> int:
    return parse_human_int(text, flag=flag)


def _lora_rank(text: str, flag: str) -> int:
    value = _parse_int(text, flag)
    if value not in LORA_RANKS:
        ranks = ", ".join(str(r) for r in LORA_RANKS)
        raise BadInput(f"{flag} {value} is not a rank vLLM accepts", f"use one of {ranks}")
    return value


def _mm_option(flag: str, modality: str, key: str, value: Any) -> int:
    allowed = SIZE_OPTIONS.get(modality, ("count",))
    if key not in allowed:
        raise BadInput(
            f"{flag}: {modality} has no option {key!r}", f"use {', '.join(allowed)} for {modality}"
        )
    least = 0 if key == "count" else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise BadInput(
            f"{flag}: {modality} {key} {value!r} is not a whole number of at least {least}",
            f'write e.g. \'{{"{modality}": {{"{key}": {max(least, 1)}}}}}\'',
        )
    return value


def parse_mm_limits(text: str, flag: str) -> str:
    """``--limit-mm-per-prompt`` as vLLM 0.32 reads it (JSON: a count, or a count and the
    dummy item's size per modality), returned as canonical JSON ({modality: {option: n}})."""
    try:
        data = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        raise BadInput(
            f"{flag} {text!r} is not JSON",
            'write it as vLLM reads it: \'{"image": 2, "video": {"count": 1, "num_frames": 16}}\'',
        ) from None
    if not isinstance(data, dict):
        raise BadInput(f"{flag} {text!r} is not a JSON object", "write e.g. '{\"image\": 2}'")
    out: dict[str, dict[str, int]] = {}
    for modality, value in data.items():
        options = {"count": value} if not isinstance(value, dict) else dict(value)
        out[str(modality)] = {
            key: _mm_option(flag, str(modality), str(key), v) for key, v in options.items()
        }
    return json.dumps(out, sort_keys=True, separators=(",", ":"))


# -- context parallelism, KV offloading, sleep mode, CUDA graphs, Mamba caches (§14) ---------
KV_OFFLOADING_BACKEND_CHOICES = ("native", "lmcache")  # vllm 0.32 config/cache.py
MAMBA_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
MAMBA_CACHE_MODE_CHOICES = ("align", "none", "all")  # 'all': vLLM 0.15–0.31


def _json_object(text: str, flag: str) -> str:
    """A JSON-object flag (vLLM reads it with ``json.loads``), kept as compact JSON text."""
    import json

    from oomguard.memory.compilation import parse_json_object, read_compilation_config

    value = parse_json_object(text, flag)
    if flag == "--compilation-config":
        read_compilation_config(text)  # its graph keys are checked as vLLM checks them
    return json.dumps(value)


def _capture_sizes(value: str | Sequence[str], flag: str) -> tuple[int, ...]:
    """``--cudagraph-capture-sizes 1 2 4`` (nargs="+" of int) or one comma/space-separated
    string (a YAML list or a CLI option)."""
    items = [value] if isinstance(value, str) else list(value)
    words = [w for item in items for w in str(item).replace(",", " ").strip("[] ").split()]
    if not words:
        raise BadInput(f"{flag} needs at least one size", f"write {flag} 1 2 4 8")
    return tuple(_positive(_parse_int)(w, flag) for w in words)


def _positive_float(text: str, flag: str) -> float:
    value = parse_float(text, flag)
    if value <= 0:
        raise BadInput(f"{flag} {text!r} must be positive", f"pass a size in GiB to {flag}")
    return value


ESTIMATE_CUDAGRAPHS_ENV = "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"


def estimate_cudagraphs_from_env(env: Mapping[str, str]) -> bool | None:
    """The variable as vLLM reads it (``bool(int(value))``, vllm 0.32 envs.py); None: unset."""
    text = env.get(ESTIMATE_CUDAGRAPHS_ENV)
    if text is None:
        return None
    try:
        return bool(int(text))
    except ValueError:
        raise BadInput(
            f"{ESTIMATE_CUDAGRAPHS_ENV}={text!r} is not an integer", "set it to 0 or 1"
        ) from None


# vLLM flag (canonical long name) → (EngineSettings field, value parser). Boolean fields use
# ``None`` as parser (presence means True; ``--no-`` means False).
_SETTING_FLAGS: dict[str, tuple[str, Callable[[str, str], Any] | None]] = {
    "tensor-parallel-size": ("tensor_parallel_size", _positive(_parse_int)),
    "pipeline-parallel-size": ("pipeline_parallel_size", _positive(_parse_int)),
    "data-parallel-size": ("data_parallel_size", _positive(_parse_int)),
    "enable-expert-parallel": ("enable_expert_parallel", None),
    "gpu-memory-utilization": ("gpu_memory_utilization", _utilization),
    "max-model-len": ("max_model_len", parse_max_model_len),
    "max-num-seqs": ("max_num_seqs", _positive(_parse_int)),
    "max-num-batched-tokens": ("max_num_batched_tokens", _positive(_human)),
    "kv-cache-dtype": ("kv_cache_dtype", choice_parser(KV_CACHE_DTYPE_CHOICES)),
    "dtype": ("dtype", choice_parser(DTYPE_CHOICES)),
    "quantization": ("quantization", _optional_choice(QUANTIZATION_CHOICES)),
    "enforce-eager": ("enforce_eager", None),
    "block-size": ("block_size", _positive(_parse_int)),
    "enable-prefix-caching": ("enable_prefix_caching", None),
    "kv-cache-memory-bytes": ("kv_cache_memory_bytes", _positive(_human)),
    "num-gpu-blocks-override": ("num_gpu_blocks_override", _positive(_parse_int)),
    "cpu-offload-gb": ("cpu_offload_gb", _non_negative_float),
    "performance-mode": ("performance_mode", choice_parser(PERFORMANCE_MODE_CHOICES)),
    # LoRA and multimodal (vllm/config/lora.py, vllm/config/multimodal.py)
    "enable-lora": ("enable_lora", None),
    "max-loras": ("max_loras", _positive(_parse_int)),
    "max-lora-rank": ("max_lora_rank", _lora_rank),
    "max-cpu-loras": ("max_cpu_loras", _positive(_parse_int)),
    "lora-dtype": ("lora_dtype", choice_parser(LORA_DTYPES)),
    "fully-sharded-loras": ("fully_sharded_loras", None),
    "limit-mm-per-prompt": ("limit_mm_per_prompt", parse_mm_limits),
    "skip-mm-profiling": ("skip_mm_profiling", None),
    "mm-encoder-tp-mode": ("mm_encoder_tp_mode", choice_parser(ENCODER_TP_MODES)),
    "mm-processor-cache-gb": ("mm_processor_cache_gb", _non_negative_float),
    "mm-processor-cache-type": ("mm_processor_cache_type", choice_parser(PROCESSOR_CACHE_TYPES)),
    # §14: context parallelism, KV offloading and connectors, sleep mode, graphs, Mamba caches
    "decode-context-parallel-size": ("decode_context_parallel_size", _positive(_parse_int)),
    "prefill-context-parallel-size": ("prefill_context_parallel_size", _positive(_parse_int)),
    "kv-offloading-size": ("kv_offloading_size", _positive_float),
    "kv-offloading-backend": (
        "kv_offloading_backend",
        choice_parser(KV_OFFLOADING_BACKEND_CHOICES),
    ),
    "kv-transfer-config": ("kv_transfer_config", _json_object),
    "enable-sleep-mode": ("enable_sleep_mode", None),
    "compilation-config": ("compilation_config", _json_object),
    "cudagraph-capture-sizes": ("cudagraph_capture_sizes", _capture_sizes),
    "max-cudagraph-capture-size": ("max_cudagraph_capture_size", _positive(_parse_int)),
    "mamba-cache-dtype": ("mamba_cache_dtype", choice_parser(MAMBA_DTYPE_CHOICES)),
    "mamba-ssm-cache-dtype": ("mamba_ssm_cache_dtype", choice_parser(MAMBA_DTYPE_CHOICES)),
    "mamba-block-size": ("mamba_block_size", _positive(_parse_int)),
    "mamba-cache-mode": ("mamba_cache_mode", choice_parser(MAMBA_CACHE_MODE_CHOICES)),
    # JSON as vLLM reads it; the older --spec-method/--spec-model/--spec-tokens fill its keys
    "speculative-config": ("speculative_config", parse_speculative_config),
}
_LIST_SETTINGS = frozenset({"cudagraph-capture-sizes"})  # flags whose value is a list of sizes
# the older speculative flags as settings_from_flags receives them (parameter names)
_LEGACY_SPEC_FIELDS = {flag.replace("-", "_"): flag for flag in LEGACY_FLAGS}
# The reverse map, in the order commands are rendered.
FIELD_TO_FLAG: dict[str, str] = {spec[0]: flag for flag, spec in _SETTING_FLAGS.items()}


def settings_from_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """EngineSettings fields from command-line values (``None``: not given), each parsed and
    checked by the same rule as the flag in a pasted ``vllm serve`` command (``8k``, ``auto``,
    the value vLLM accepts). Fields that are not vLLM flags (``vllm_version``) pass through."""
    out: dict[str, Any] = {}
    legacy = [(name, value) for name, value in flags.items() if name in _LEGACY_SPEC_FIELDS]
    for name, value in flags.items():
        if value is None or name in _LEGACY_SPEC_FIELDS:
            continue
        flag = FIELD_TO_FLAG.get(name)
        parse = _SETTING_FLAGS[flag][1] if flag is not None else None
        if parse is None or isinstance(value, bool):
            out[name] = value
            continue
        if flag in _LIST_SETTINGS and isinstance(value, (list, tuple)):
            out[name] = _capture_sizes(value, f"--{flag}")
            continue
        parsed = parse(str(value), f"--{flag}")
        if parsed is not None:
            out[name] = parsed
    for name, value in legacy:
        if value is not None:
            flag = _LEGACY_SPEC_FIELDS[name]
            out["speculative_config"] = merge_legacy(out.get("speculative_config"), flag, value)
    return out


_RENDER_ORDER = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "data_parallel_size",
    "enable_expert_parallel",
    "quantization",
    "dtype",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_cache_dtype",
    "block_size",
    "enable_prefix_caching",
    "enforce_eager",
    "num_gpu_blocks_override",
    "cpu_offload_gb",
    "performance_mode",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "lora_dtype",
    "fully_sharded_loras",
    "limit_mm_per_prompt",
    "skip_mm_profiling",
    "mm_encoder_tp_mode",
    "mm_processor_cache_gb",
    "mm_processor_cache_type",
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
    "kv_offloading_size",
    "kv_offloading_backend",
    "kv_transfer_config",
    "enable_sleep_mode",
    "compilation_config",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "mamba_cache_dtype",
    "mamba_ssm_cache_dtype",
    "mamba_block_size",
    "mamba_cache_mode",
    "speculative_config",
)
# Field values that equal vLLM's own defaults are not rendered (None = "vLLM decides").
_FIELD_DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "enable_expert_parallel": False,
    "dtype": "auto",
    "kv_cache_dtype": "auto",
    "enforce_eager": False,
    "cpu_offload_gb": 0.0,
    "enable_lora": False,
    "lora_dtype": "auto",
    "fully_sharded_loras": False,
    "skip_mm_profiling": False,
    "mm_encoder_tp_mode": "weights",
    "mm_processor_cache_type": "lru",
    "decode_context_parallel_size": 1,
    "prefill_context_parallel_size": 1,
    "kv_offloading_backend": "native",
    "enable_sleep_mode": False,
    "mamba_cache_dtype": "auto",
    "mamba_ssm_cache_dtype": "auto",
}


@dataclass(frozen=True)
class ParsedCommand:
    """A pasted vLLM command, read.

    ``settings_kwargs`` holds only the :class:`EngineSettings` fields the command set (use
    :meth:`settings` to build the value). ``other_flags`` keeps every other real vLLM flag with
    its raw value, ``unmodelled`` names those that change memory in ways the plan does not
    model, ``unknown`` the flags vLLM does not have.
    """

    model: str
    settings_kwargs: Mapping[str, Any]
    usage_context: str = "server"
    other_flags: Mapping[str, Any] = field(default_factory=dict)
    unmodelled: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    config_file: str | None = None
    strays: tuple[str, ...] = ()  # the entries of ``unknown`` that are stray values, not flags

    def settings(self, **overrides: Any) -> EngineSettings:
        """The command's settings as an EngineSettings (fields it did not set stay None)."""
        from oomguard.memory.engine import EngineSettings

        kwargs = {"usage_context": self.usage_context, **self.settings_kwargs, **overrides}
        return EngineSettings(**kwargs)

    def check_flags(self) -> None:
        """Raise :class:`BadInput` for the first flag vLLM does not have, naming the closest
        real flag (or for a value no flag takes)."""
        for name in self.unknown:
            if name in self.strays:
                raise BadInput(
                    f"unexpected argument {name!r} in the command",
                    "check the flag before it: it may take no value, or a value is missing a flag",
                )
            closest = closest_flag(name)
            hint = f"did you mean --{closest}?" if closest else "see vllm serve --help"
            raise BadInput(f"--{name} is not a vLLM flag", hint)

    def notes(self) -> list[str]:
        """One line per flag the plan does not use, for display next to the plan."""
        lines: list[str] = []
        if self.unknown:
            lines.append(
                "not vLLM flags (ignored; check the spelling): "
                + ", ".join(f"--{name}" for name in self.unknown)
            )
        if self.unmodelled:
            lines.append(
                "change memory but are not modelled (the prediction ignores them): "
                + ", ".join(f"--{name}" for name in self.unmodelled)
            )
        return lines


def _tokens_of(command: str | Sequence[str]) -> list[str]:
    if isinstance(command, str):
        text = command.replace("\\\r\n", " ").replace("\\\n", " ")
        try:
            return shlex.split(text, comments=True)
        except ValueError as exc:
            raise BadInput(f"cannot read the command line: {exc}", "check the quotes") from None
    tokens: list[str] = []
    for token in command:
        if token in ("\\", "\\\n"):
            continue
        tokens.append(token)
    return tokens


_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
_PYTHON = re.compile(r"python(\d(\.\d+)?)?")
_PYTHON_OPTIONS = ("-u", "-O", "-B")  # interpreter switches that change nothing for vLLM
# modules whose arguments take the model from --model only
_API_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
_CLI_MODULE = "vllm.entrypoints.cli.main"  # python -m vllm.entrypoints.cli.main serve MODEL
CONTAINER_TOOLS = ("docker", "podman", "nerdctl")
# vLLM's images: vllm/vllm-openai[:tag], a registry in front, and the ROCm/CPU variants
_VLLM_IMAGE = re.compile(r"(?:[\w.:-]+/)*vllm[\w-]*/vllm[\w.-]*(?::[\w.-]+)?(?:@sha256:\w+)?")


@dataclass(frozen=True)
class Launcher:
    """How a pasted vLLM server command starts the server, and the server's own arguments.

    ``form`` is "vllm" (``vllm serve``), "python" (``python -m …``), "serve" (a bare
    ``serve MODEL …``), "container" (``docker run … vllm/vllm-openai …``) or "args" (the
    arguments alone). ``positional_model`` is False where the model comes only from
    ``--model`` (the api_server modules).
    """

    args: list[str]
    form: str
    positional_model: bool = True
    env: dict[str, str] = field(default_factory=dict)  # leading VAR=value assignments
    python: str | None = None  # the interpreter a ``python -m`` line names
    tool: str | None = None  # the container tool


def split_launcher(tokens: Sequence[str]) -> Launcher:
    """Split leading environment assignments (``env`` included) and the launcher off a
    command. Raises :class:`BadInput` for a command that does not start vLLM's server."""
    words = list(tokens)
    env: dict[str, str] = {}
    while words and (words[0] == "env" or _ENV_ASSIGNMENT.fullmatch(words[0])):
        if words[0] != "env":
            name, _, value = words[0].partition("=")
            env[name] = value
        words = words[1:]
    head = Path(words[0]).name if words else ""
    if head == "vllm":
        if len(words) < 2 or words[1] != "serve":
            sub = words[1] if len(words) > 1 else "(nothing)"
            raise BadInput(
                f"only 'vllm serve' commands can be run or planned, got 'vllm {sub}'",
                "paste the 'vllm serve MODEL --flags…' line",
            )
        return Launcher(words[2:], "vllm", env=env)
    if _PYTHON.fullmatch(head):
        rest = words[1:]
        while rest and rest[0] in _PYTHON_OPTIONS:
            rest = rest[1:]
        if len(rest) >= 2 and rest[0] == "-m":
            if rest[1] in _API_SERVER_MODULES:
                return Launcher(rest[2:], "python", False, env, python=words[0])
            if rest[1] == _CLI_MODULE and len(rest) > 2 and rest[2] == "serve":
                return Launcher(rest[3:], "python", env=env, python=words[0])
        raise BadInput(
            "the command does not start vLLM's server",
            "paste 'vllm serve MODEL …' or 'python -m "
            "vllm.entrypoints.openai.api_server --model MODEL …'",
        )
    if head == "serve":
        return Launcher(words[1:], "serve", env=env)
    if head in CONTAINER_TOOLS:
        return Launcher(_container_args(words), "container", env=env, tool=head)
    return Launcher(words, "args", env=env)


def _container_args(words: list[str]) -> list[str]:
    """``docker run … vllm/vllm-openai:TAG --model M …``: the image's entrypoint is vLLM's
    server; what follows the image are its arguments."""
    for i, token in enumerate(words):
        if _VLLM_IMAGE.fullmatch(token):
            after = words[i + 1 :]
            return after[1:] if after and after[0] == "serve" else after
    raise BadInput(
        "the container command does not run a vLLM image",
        "paste the 'docker run … vllm/vllm-openai:TAG --model MODEL …' line, or 'vllm serve …'",
    )


def canonical_flag(name: str) -> str:
    name, dot, keys = name.partition(".")  # a dotted JSON flag keeps its keys as written
    name = name.replace("_", "-")
    return ALIASES.get(name, name) + dot + keys


def _split_flags(args: list[str]) -> tuple[list[str], list[tuple[str, str | bool | list[str]]]]:
    """Split arguments into positionals and (canonical flag name, value) pairs in order."""
    positionals: list[str] = []
    pairs: list[tuple[str, str | bool | list[str]]] = []
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if token == "--":
            positionals.extend(args[i:])
            break
        if not token.startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", token):
            positionals.append(token)
            continue
        raw = token.lstrip("-")
        inline: str | None = None
        if "=" in raw:
            raw, inline = raw.split("=", 1)
        name = canonical_flag(raw)
        negated = False
        if (
            name not in BOOL_FLAGS
            and name.startswith("no-")
            and canonical_flag(name[3:]) in BOOL_FLAGS
        ):
            name, negated = canonical_flag(name[3:]), True
        if name in BOOL_FLAGS:
            if negated:
                pairs.append((name, False))
            elif inline is not None:
                pairs.append((name, _parse_bool(inline, f"--{name}")))
            else:
                pairs.append((name, True))
            continue
        if name in LIST_FLAGS:
            values: list[str] = [] if inline is None else [inline]
            while inline is None and i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
            pairs.append((name, values))
            continue
        if inline is not None:
            pairs.append((name, inline))
            continue
        # A value flag (known) or an unknown flag: take the next token as its value unless it
        # is another flag.
        if i < len(args) and (
            not args[i].startswith("-") or re.fullmatch(r"-\d+(\.\d+)?", args[i])
        ):
            pairs.append((name, args[i]))
            i += 1
        elif name in VALUE_FLAGS:
            raise BadInput(f"--{name} needs a value", f"write --{name} VALUE")
        else:
            pairs.append((name, True))
    return positionals, pairs


def _config_pairs(
    path_text: str, base_dir: Path | None
) -> list[tuple[str, str | bool | list[str]]]:
    """vLLM's ``--config`` YAML as flag pairs (flat keys; nested values become JSON)."""
    import json

    import yaml

    path = Path(path_text)
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    if path.suffix not in (".yaml", ".yml"):
        raise MalformedConfig(
            f"--config {path_text}: vLLM reads only .yaml/.yml config files",
            "rename or convert the file to YAML",
        )
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise BadInput(f"--config {path_text}: no such file", "check the path") from None
    except (OSError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MalformedConfig(
            f"--config {path_text} is not valid YAML: {reason}", "fix the file"
        ) from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise MalformedConfig(
            f"--config {path_text} is not a mapping of flag names to values",
            "write one 'flag-name: value' per line",
        )
    pairs: list[tuple[str, str | bool | list[str]]] = []
    for key, value in data.items():
        name = canonical_flag(str(key))
        if isinstance(value, bool):
            pairs.append((name, value))
        elif isinstance(value, list):
            pairs.append((name, [str(item) for item in value]))
        elif isinstance(value, dict):
            pairs.append((name, json.dumps(value)))
        elif value is None:
            continue
        else:
            pairs.append((name, str(value)))
    return pairs


def _merge_config_file(
    pairs: list[tuple[str, Any]], base_dir: str | Path | None
) -> tuple[str | None, list[tuple[str, Any]]]:
    """The ``--config`` file named in ``pairs`` (or None) and the pairs with its flags merged in.

    vLLM inserts the config's flags before the command-line flags: the command line wins.
    """
    config_values = [value for name, value in pairs if name == "config"]
    if len(config_values) > 1:
        raise BadInput("more than one --config file given", "vLLM reads a single --config file")
    if not config_values:
        return None, pairs
    if not isinstance(config_values[0], str):
        raise BadInput("--config needs a file name", "write --config FILE.yaml")
    config_file = config_values[0]
    base = Path(base_dir) if base_dir is not None else None
    return config_file, _config_pairs(config_file, base) + [
        (n, v) for n, v in pairs if n != "config"
    ]


def _dotted_value(text: Any) -> Any:
    """A dotted flag's value as vLLM reads it: JSON when it parses, else the text."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def _merge_dotted(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``--flag.key value`` pairs of a JSON flag folded into one ``--flag JSON`` pair, after
    the others, as vLLM's FlexibleArgumentParser does (the dotted keys win)."""
    merged: dict[str, dict[str, Any]] = {}
    rest: list[tuple[str, Any]] = []
    for name, value in pairs:
        base, _, keys = name.partition(".")
        if not keys or base not in VALUE_FLAGS | set(_SETTING_FLAGS):
            rest.append((name, value))
            continue
        node = merged.setdefault(base, {})
        *path, last = keys.split(".")
        for key in path:
            node = node.setdefault(key, {})
        node[last] = _dotted_value(value)
    return rest + [(name, json.dumps(tree)) for name, tree in merged.items()]


def _setting_value(name: str, value: Any) -> tuple[str, Any]:
    """The settings field a pasted flag of :data:`_SETTING_FLAGS` sets, and its parsed value."""
    field_name, parse = _SETTING_FLAGS[name]
    if parse is None:
        if not isinstance(value, bool):
            value = _parse_bool(str(value), f"--{name}")
        return field_name, value
    if name in _LIST_SETTINGS and isinstance(value, list):
        return field_name, _capture_sizes(value, f"--{name}")
    if isinstance(value, bool) or isinstance(value, list):
        raise BadInput(f"--{name} needs a value", f"write --{name} VALUE")
    return field_name, parse(value, f"--{name}")


def parse_command(
    command: str | Sequence[str], *, base_dir: str | Path | None = None
) -> ParsedCommand:
    """Read a pasted ``vllm serve …`` (or api_server) command into a :class:`ParsedCommand`.

    ``base_dir`` resolves a relative ``--config`` path. Raises :class:`BadInput` (one line)
    for a malformed value or a command without a model.
    """
    tokens = _tokens_of(command)
    if not tokens:
        raise BadInput("the pasted command is empty", "paste 'vllm serve MODEL --flags…'")
    launcher = split_launcher(tokens)
    args, positional_model = launcher.args, launcher.positional_model
    positionals, pairs = _split_flags(args)

    config_file, pairs = _merge_config_file(pairs, base_dir)
    pairs = _merge_dotted(pairs)

    model: str | None = None
    if positional_model and positionals:
        model = positionals[0]
        extra_positionals = positionals[1:]
    else:
        extra_positionals = positionals
    settings: dict[str, Any] = {}
    other: dict[str, Any] = {}
    unmodelled: list[str] = []
    unknown: list[str] = []
    legacy_spec: list[tuple[str, Any]] = []
    for name, value in pairs:
        if name in LEGACY_FLAGS:
            legacy_spec.append((name, value))
            continue
        if name == "model":
            if not isinstance(value, str):
                raise BadInput("--model needs a value", "write --model MODEL")
            if model is None or not positional_model or not positionals:
                model = value
            continue
        if name in _SETTING_FLAGS:
            field_name, parsed = _setting_value(name, value)
            settings[field_name] = parsed
            continue
        known = name in BOOL_FLAGS or name in VALUE_FLAGS or name in LIST_FLAGS
        if not known:
            if name not in unknown:
                unknown.append(name)
            other[name] = value
            continue
        other[name] = value
        if name in UNMODELLED_MEMORY_FLAGS and name not in unmodelled:
            unmodelled.append(name)
    for flag, value in legacy_spec:
        if isinstance(value, bool | list):
            raise BadInput(f"--{flag} needs a value", f"write --{flag} VALUE")
        cfg = settings.get("speculative_config")
        settings["speculative_config"] = merge_legacy(cfg, flag, value)
    estimate = estimate_cudagraphs_from_env(launcher.env)
    if estimate is not None:
        settings["estimate_cudagraphs"] = estimate
    for stray in extra_positionals:
        unknown.append(stray)
    strays = tuple(extra_positionals)
    if model is None:
        raise BadInput(
            "the command names no model",
            "write 'vllm serve MODEL …' or pass --model MODEL",
        )
    return ParsedCommand(
        model=model,
        settings_kwargs=settings,
        other_flags=other,
        unmodelled=tuple(unmodelled),
        unknown=tuple(unknown),
        config_file=config_file,
        strays=strays,
    )


def closest_flag(name: str) -> str | None:
    """The real vLLM flag nearest to a misspelt ``name`` (no leading dashes), or None."""
    import difflib

    known = sorted(set(BOOL_FLAGS) | set(VALUE_FLAGS) | set(LIST_FLAGS) | set(_SETTING_FLAGS))
    name = canonical_flag(name.lstrip("-"))
    found = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return found[0] if found else None


# ---------------------------------------------------------------------------------------------
# Rendering


def explicit_flags(settings: EngineSettings) -> list[tuple[str, Any]]:
    """(EngineSettings field, value) pairs a command must carry: set, and not vLLM's default."""
    out: list[tuple[str, Any]] = []
    for name in _RENDER_ORDER:
        value = getattr(settings, name, None)
        if value is None:
            continue
        if name in _FIELD_DEFAULTS and value == _FIELD_DEFAULTS[name]:
            continue
        out.append((name, value))
    return out


def plain_value(value: Any) -> Any:
    """A setting as vLLM's own config value (the speculative config as its JSON object)."""
    return value.to_dict() if isinstance(value, SpeculativeConfig) else value


def _cli_value(name: str, value: Any) -> str:
    if isinstance(value, SpeculativeConfig):
        return value.to_json()
    if name == "max_model_len" and value == -1:
        return "auto"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _flag_tokens(settings: EngineSettings) -> list[str]:
    tokens: list[str] = []
    for name, value in explicit_flags(settings):
        flag = "--" + FIELD_TO_FLAG[name]
        if isinstance(value, bool):
            tokens.append(flag if value else "--no-" + FIELD_TO_FLAG[name])
        elif isinstance(value, tuple):
            tokens.extend([flag, *(str(v) for v in value)])
        else:
            tokens.extend([flag, _cli_value(name, value)])
    return tokens


def _other_tokens(other_flags: Mapping[str, Any] | None) -> list[str]:
    tokens: list[str] = []
    for name, value in (other_flags or {}).items():
        flag = "--" + name
        if value is True:
            tokens.append(flag)
        elif value is False:
            tokens.append("--no-" + name)
        elif isinstance(value, list):
            tokens.append(flag)
            tokens.extend(str(v) for v in value)
        else:
            tokens.extend([flag, str(value)])
    return tokens


def render_serve(
    model: str,
    settings: EngineSettings,
    *,
    other_flags: Mapping[str, Any] | None = None,
    multiline: bool = False,
) -> str:
    """``vllm serve MODEL --flags…`` carrying every explicitly set field of ``settings``.

    ``other_flags`` (e.g. ``ParsedCommand.other_flags``) are appended unchanged so that a
    pasted command comes back with its port, served name and so on.
    """
    parts = ["vllm", "serve", model]
    flag_tokens = _flag_tokens(settings) + _other_tokens(other_flags)
    if not multiline:
        return shlex.join(parts + flag_tokens)
    lines = [shlex.join(parts)]
    i = 0
    while i < len(flag_tokens):
        group = [flag_tokens[i]]
        i += 1
        while i < len(flag_tokens) and not flag_tokens[i].startswith("--"):
            group.append(flag_tokens[i])
            i += 1
        lines.append("  " + shlex.join(group))
    return " \\\n".join(lines)


# JSON-valued fields: LLM(...) and the YAML config take the mapping itself
_JSON_FIELDS = frozenset({"kv_transfer_config", "compilation_config", "limit_mm_per_prompt"})


def _structured(name: str, value: Any) -> Any:
    """A field's value as ``LLM(...)`` and the YAML config take it: JSON flags and the
    speculative config as mappings, lists as lists."""
    import json

    value = plain_value(value)
    if name in _JSON_FIELDS and isinstance(value, str):
        return json.loads(value)
    if isinstance(value, tuple):
        return list(value)
    return value


def render_llm(model: str, settings: EngineSettings) -> str:
    """``LLM(model=..., field=value, ...)`` for offline use (keyword names are vLLM's)."""
    args = [f"model={model!r}"]
    for name, value in explicit_flags(settings):
        args.append(f"{name}={_structured(name, value)!r}")
    return "LLM(" + ", ".join(args) + ")"


def render_yaml(model: str, settings: EngineSettings) -> str:
    """A flat YAML file for ``vllm serve --config FILE`` (keys are vLLM's flag names)."""
    import yaml

    data: dict[str, Any] = {"model": model}
    for name, value in explicit_flags(settings):
        if name == "max_model_len" and value == -1:
            value = "auto"
        data[FIELD_TO_FLAG[name]] = _structured(name, value)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def settings_from_kwargs(base: EngineSettings, **changes: Any) -> EngineSettings:
    """A copy of ``base`` with ``changes`` applied (thin wrapper kept for readability)."""
    return dataclasses.replace(base, **changes)
