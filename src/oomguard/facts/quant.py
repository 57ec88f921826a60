"""Detect a checkpoint's weight format from ``quantization_config`` or, failing that, its name.

The result is a :class:`QuantSpec`; the byte cost of each format lives in the memory model
(docs/memory-model.md §8). Methods whose layout is unknown raise :class:`UnsupportedArchitecture`
rather than being treated as 16-bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from oomguard.errors import BadInput, MalformedConfig, UnsupportedArchitecture
from oomguard.memory.spec import QuantSpec

# Groups almost every weight-quantization method leaves in model dtype: vLLM quantizes linear
# layers of the decoder; embeddings, LM head, norms, routers and vision towers stay 16-bit.
DEFAULT_UNQUANTIZED: tuple[str, ...] = ("embed", "pos_embed", "lm_head", "router", "norm", "vision")
# gpt-oss MXFP4: only the MoE experts are packed (attention, router, embeddings, LM head in bf16).
MXFP4_UNQUANTIZED: tuple[str, ...] = DEFAULT_UNQUANTIZED + (
    "attn_qo",
    "attn_kv",
    "mlp",
    "shared_experts",
    "mamba",
    "mtp",
)

# Module names in ignore / modules_to_not_convert lists → our parameter groups. A name is read
# as dotted path components (``model.layers.0.post_attention_layernorm``); each rule names the
# component it matches, so a norm whose name contains "attention" is a norm, never attention
# (matching raw substrings priced every attention projection of Qwen3-MoE FP8 at bf16).
_NORM_COMPONENT = re.compile(r"(^|_)(layer)?norm$|^(ln|norm)(_\w+)?$|_ln$|^[a-z]*norm\d*$")
_COMPONENT_TO_GROUP: tuple[tuple[re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (re.compile(pattern), groups)
    for pattern, groups in (
        (r"^lm_head$", ("lm_head",)),
        (r"^(embed_tokens|embeddings?|wte|word_embeddings|embed_tokens_per_layer)$", ("embed",)),
        (
            r"^(self_attn|attn|attention|self_attention|linear_attn|cross_attn)$",
            ("attn_qo", "attn_kv"),
        ),
        (
            r"^(q_proj|k_proj|v_proj|o_proj|qkv_proj|c_attn|query_key_value|wqkv|wo)$",
            ("attn_qo", "attn_kv"),
        ),
        (r"^shared_experts?$", ("shared_experts",)),
        (r"^(router|gate|shared_expert_gate)$", ("router",)),
        (
            r"^(visual|vision_tower|vision_model|vision|multi_modal_projector"
            r"|mm_projector|audio_tower)$",
            ("vision",),
        ),
        (r"^(mamba|mixer)$", ("mamba",)),
        (r"^mtp$", ("mtp",)),
    )
)


def _module_groups(module: Any) -> tuple[str, ...]:
    """Parameter groups one ignored module name covers (empty: none we price separately)."""
    parts = [p for p in re.split(r"[./]", str(module).lower()) if p and p != "*"]
    if parts and _NORM_COMPONENT.search(parts[-1]):
        return ("norm",)
    if any(p.startswith("re:") for p in parts):  # compressed-tensors regex: test the whole name
        text = str(module).lower()
        parts = [p for p in re.split(r"[^a-z0-9_]+", text) if p]
    for part in parts:
        for pattern, groups in _COMPONENT_TO_GROUP:
            if pattern.search(part):
                return groups
    return ()


_AWQ_GPTQ_DEFAULT_GROUP = 128


def _groups_for_modules(modules: Iterable[Any]) -> tuple[str, ...]:
    out: list[str] = []
    for module in modules:
        out.extend(g for g in _module_groups(module) if g not in out)
    return tuple(out)


def _merge(base: tuple[str, ...], extra: tuple[str, ...]) -> tuple[str, ...]:
    return base + tuple(g for g in extra if g not in base)


def _int(qc: Mapping[str, Any], *keys: str, default: int | None = None) -> int | None:
    for key in keys:
        value = qc.get(key)
        if value is not None:
            try:
                return int(value)
            except (TypeError, ValueError):
                raise MalformedConfig(
                    f"quantization_config.{key} is {value!r}, not an integer",
                    "fix quantization_config in config.json",
                ) from None
    return default


def _group_size(value: int | None) -> int | None:
    return None if value is None or value <= 0 else value


def _compressed_tensors(qc: Mapping[str, Any]) -> QuantSpec:
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise UnsupportedArchitecture(
            "compressed-tensors quantization_config has no config_groups",
            "use the checkpoint's original config.json",
        )
    # the group that covers Linear layers decides the weight format (one group in practice)
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") if isinstance(scheme, Mapping) else None
    if not isinstance(weights, Mapping):
        raise UnsupportedArchitecture(
            "compressed-tensors config group has no 'weights' section",
            "use the checkpoint's original config.json",
        )
    bits = _int(weights, "num_bits", default=8) or 8
    wtype = str(weights.get("type", "int"))
    strategy = str(weights.get("strategy", "tensor"))
    group = _group_size(_int(weights, "group_size"))
    ignored = _groups_for_modules(qc.get("ignore") or [])
    unq = _merge(DEFAULT_UNQUANTIZED, ignored)
    fmt = str(qc.get("format", ""))
    if bits == 4 and wtype == "float":
        return QuantSpec(
            method="nvfp4",
            weight_bits=4,
            group_size=group or 16,
            scale_granularity="group",
            unquantized_groups=unq,
        )
    granularity = {
        "tensor": "tensor",
        "channel": "channel",
        "group": "group",
        "block": "block",
        "tensor_group": "group",
    }.get(strategy, strategy)
    zero_point = not bool(weights.get("symmetric", True))
    method = "fp8" if (bits == 8 and wtype == "float") else "compressed-tensors"
    if fmt == "marlin-24" or weights.get("sparsity_structure"):
        raise UnsupportedArchitecture(
            "compressed-tensors 2:4 sparse checkpoints are not modelled",
            "use a dense quantized checkpoint",
        )
    return QuantSpec(
        method=method,
        weight_bits=bits,
        group_size=group,
        zero_point=zero_point,
        scale_granularity=granularity,
        unquantized_groups=unq,
    )


def _modelopt(qc: Mapping[str, Any]) -> QuantSpec:
    nested = qc.get("quantization")
    inner: Mapping[str, Any] = nested if isinstance(nested, Mapping) else qc
    algo = str(inner.get("quant_algo", "")).upper()
    excluded = _groups_for_modules(inner.get("exclude_modules") or qc.get("ignore") or [])
    unq = _merge(DEFAULT_UNQUANTIZED, excluded)
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"):
        gran = "channel" if "CHANNEL" in algo else ("block" if "PB" in algo else "tensor")
        return QuantSpec(
            method="fp8", weight_bits=8, scale_granularity=gran, unquantized_groups=unq
        )
    if algo in ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ"):
        return QuantSpec(
            method="nvfp4",
            weight_bits=4,
            group_size=_int(inner, "group_size", default=16),
            scale_granularity="group",
            unquantized_groups=unq,
        )
    if algo == "MXFP8":
        return QuantSpec(
            method="fp8",
            weight_bits=8,
            group_size=32,
            scale_granularity="group",
            unquantized_groups=unq,
        )
    raise UnsupportedArchitecture(
        f"ModelOpt quant_algo {algo or '(none)'!r} is not modelled",
        "supported ModelOpt formats: FP8, NVFP4",
    )


def _fp8(qc: Mapping[str, Any], method: str) -> QuantSpec:
    """FP8 weights: block-, channel- (fbgemm) or tensor-scaled."""
    block = qc.get("weight_block_size")
    ignored = _groups_for_modules(
        qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    )
    if block:
        gran = "block"
    elif method == "fbgemm-fp8":
        gran = "channel"
    else:
        gran = "tensor"
    return QuantSpec(
        method="fp8",
        weight_bits=8,
        scale_granularity=gran,
        group_size=int(block[0]) if block else None,
        unquantized_groups=_merge(DEFAULT_UNQUANTIZED, ignored),
    )


def quant_from_config(qc: Mapping[str, Any]) -> QuantSpec:
    """QuantSpec for one ``quantization_config`` dict (as found in config.json).

    Raises :class:`UnsupportedArchitecture` for a method whose weight layout is not modelled.
    """
    if not isinstance(qc, Mapping):
        raise MalformedConfig("quantization_config is not a JSON object", "fix config.json")
    method = str(qc.get("quant_method") or qc.get("quant_type") or "").lower().replace("_", "-")
    if not method and "quantization" in qc:
        method = "modelopt"
    if method in ("awq", "awq-marlin"):
        bits = _int(qc, "bits", "w_bit", default=4) or 4
        group = _group_size(_int(qc, "group_size", "q_group_size", default=_AWQ_GPTQ_DEFAULT_GROUP))
        unq = _merge(
            DEFAULT_UNQUANTIZED, _groups_for_modules(qc.get("modules_to_not_convert") or [])
        )
        return QuantSpec(
            method="awq",
            weight_bits=bits,
            group_size=group,
            zero_point=bool(qc.get("zero_point", True)),
            scale_granularity="group",
            unquantized_groups=unq,
        )
    if method in ("gptq", "gptq-marlin"):
        bits = _int(qc, "bits", default=4) or 4
        group = _group_size(_int(qc, "group_size", default=_AWQ_GPTQ_DEFAULT_GROUP))
        unq = _merge(
            DEFAULT_UNQUANTIZED, _groups_for_modules(qc.get("modules_to_not_convert") or [])
        )
        return QuantSpec(
            method="gptq",
            weight_bits=bits,
            group_size=group,
            zero_point=True,
            scale_granularity="group" if group else "channel",
            desc_act=bool(qc.get("desc_act", False)),
            unquantized_groups=unq,
        )
    if method in ("fp8", "fbgemm-fp8"):
        return _fp8(qc, method)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "bitsandbytes":
        if qc.get("load_in_8bit") and not qc.get("load_in_4bit"):
            bits, group, gran = 8, None, "channel"
        else:
            bits, group, gran = 4, 64, "group"
        skip = _groups_for_modules(qc.get("llm_int8_skip_modules") or [])
        return QuantSpec(
            method="bitsandbytes",
            weight_bits=bits,
            group_size=group,
            scale_granularity=gran,
            zero_point=bool(qc.get("bnb_4bit_use_double_quant", False)),
            unquantized_groups=_merge(DEFAULT_UNQUANTIZED, skip),
        )
    if method == "mxfp4":
        return QuantSpec(
            method="mxfp4",
            weight_bits=4,
            group_size=32,
            scale_granularity="group",
            unquantized_groups=MXFP4_UNQUANTIZED,
        )
    if method == "modelopt" or method == "modelopt-fp4":
        return _modelopt(qc)
    if method == "gguf":
        return QuantSpec(method="gguf", weight_bits=4, unquantized_groups=())
    raise UnsupportedArchitecture(
        f"quantization method {method or '(unnamed)'!r} is not modelled",
        "supported: awq, gptq, fp8, compressed-tensors, bitsandbytes, mxfp4, "
        "modelopt (fp8/nvfp4), gguf",
    )


# Name suffixes of common quantized repos, checked in order (most specific first).
_NAME_RULES: tuple[tuple[str, QuantSpec], ...] = (
    (r"awq", QuantSpec(method="awq", weight_bits=4, group_size=128, zero_point=True,
                       scale_granularity="group", unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"gptq[-_]?int8|gptq[-_]8bit", QuantSpec(method="gptq", weight_bits=8, group_size=128,
                                               zero_point=True, scale_granularity="group",
                                               unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"gptq", QuantSpec(method="gptq", weight_bits=4, group_size=128, zero_point=True,
                        scale_granularity="group", unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"w4a16", QuantSpec(method="compressed-tensors", weight_bits=4, group_size=128,
                         scale_granularity="group", unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"w8a8[-_]?fp8", QuantSpec(method="fp8", weight_bits=8, scale_granularity="channel",
                                unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"w8a8|w8a16|int8", QuantSpec(method="compressed-tensors", weight_bits=8,
                                   scale_granularity="channel",
                                   unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"fp8[-_]dynamic", QuantSpec(method="fp8", weight_bits=8, scale_granularity="channel",
                                  unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"nvfp4|fp4", QuantSpec(method="nvfp4", weight_bits=4, group_size=16,
                             scale_granularity="group", unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"mxfp4", QuantSpec(method="mxfp4", weight_bits=4, group_size=32, scale_granularity="group",
                         unquantized_groups=MXFP4_UNQUANTIZED)),
    (r"fp8", QuantSpec(method="fp8", weight_bits=8, scale_granularity="tensor",
                       unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"bnb[-_]?8bit|8bit", QuantSpec(method="bitsandbytes", weight_bits=8,
                                     scale_granularity="channel",
                                     unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"bnb[-_]?4bit|4bit|nf4", QuantSpec(method="bitsandbytes", weight_bits=4, group_size=64,
                                         scale_granularity="group",
                                         unquantized_groups=DEFAULT_UNQUANTIZED)),
    (r"gguf", QuantSpec(method="gguf", weight_bits=4)),
)  # fmt: skip

# the same names as a pattern that strips the format from a repo name
QUANT_SUFFIX_RE = re.compile(
    r"([-_.](quantized|awq|gptq([-_]?int[48])?|w4a16([-_]g\d+)?|w8a8([-_]fp8)?|w8a16"
    r"|fp8([-_]dynamic|[-_]block)?|int[48]|nvfp4|fp4|mxfp4|bnb[-_]?[48]bit|unsloth[-_]bnb[-_]4bit"
    r"|[48]bit|nf4|gguf))+$",
    re.IGNORECASE,
)


def quant_from_name(name: str) -> QuantSpec | None:
    """QuantSpec implied by a repo name's suffix (``…-AWQ``, ``…-FP8-dynamic``), or None.

    Only the last path component is looked at, and only whole dash/underscore-separated tokens.
    """
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    tokens = "-" + re.sub(r"[_.\s]", "-", base) + "-"
    for pattern, spec in _NAME_RULES:
        if re.search(rf"-(?:{pattern})-", tokens):
            return spec
    return None


def strip_quant_suffix(name: str) -> str:
    """The repo name without its quantization suffix (``Qwen/Qwen2.5-7B-Instruct-AWQ`` → base)."""
    return QUANT_SUFFIX_RE.sub("", name.rstrip("/"))


def detect_quant(config: Mapping[str, Any], name: str = "") -> QuantSpec:
    """The checkpoint's QuantSpec: ``quantization_config`` (top level or in ``text_config``)
    first, then the repo name; unquantized when neither says anything."""
    qc = config.get("quantization_config")
    if qc is None and isinstance(config.get("text_config"), Mapping):
        qc = config["text_config"].get("quantization_config")
    if qc is not None:
        return quant_from_config(qc)
    return quant_from_name(name) or QuantSpec()


# vLLM --quantization values accepted for each checkpoint method (Marlin kernels etc.)
_COMPATIBLE_FLAGS: dict[str, frozenset[str]] = {
    "awq": frozenset({"awq", "awq_marlin"}),
    "gptq": frozenset({"gptq", "gptq_marlin", "gptq_marlin_24"}),
    "fp8": frozenset({"fp8", "modelopt", "compressed-tensors", "fbgemm_fp8"}),
    "compressed-tensors": frozenset({"compressed-tensors"}),
    "nvfp4": frozenset({"modelopt_fp4", "modelopt", "compressed-tensors", "nvfp4"}),
    "bitsandbytes": frozenset({"bitsandbytes"}),
    "mxfp4": frozenset({"mxfp4"}),
    "gguf": frozenset({"gguf"}),
}

# online quantization of an unquantized checkpoint by vLLM's --quantization flag
_ONLINE: dict[str, QuantSpec] = {
    "fp8": QuantSpec(method="fp8", weight_bits=8, scale_granularity="tensor",
                     unquantized_groups=DEFAULT_UNQUANTIZED),
    "bitsandbytes": QuantSpec(method="bitsandbytes", weight_bits=4, group_size=64,
                              scale_granularity="group", unquantized_groups=DEFAULT_UNQUANTIZED),
}  # fmt: skip


def apply_quantization_flag(checkpoint: QuantSpec, flag: str | None) -> QuantSpec:
    """Combine the checkpoint's format with vLLM's ``--quantization`` flag.

    A flag that agrees with the checkpoint keeps it; on an unquantized checkpoint ``fp8`` and
    ``bitsandbytes`` quantize online; anything else is the mismatch vLLM itself refuses
    (:class:`BadInput`).
    """
    if not flag:
        return checkpoint
    flag_norm = flag.lower()
    if checkpoint.method is None:
        online = _ONLINE.get(flag_norm)
        if online is None:
            raise BadInput(
                f"--quantization {flag} needs a checkpoint quantized with {flag}; "
                "this one is unquantized",
                f"pick the {flag} checkpoint of the model, or use --quantization fp8 "
                "for online quantization",
            )
        return online
    if flag_norm in _COMPATIBLE_FLAGS.get(checkpoint.method, frozenset({checkpoint.method})):
        return checkpoint
    raise BadInput(
        f"--quantization {flag} does not match the checkpoint's format ({checkpoint.method})",
        f"drop --quantization or pass --quantization {checkpoint.method}",
    )
