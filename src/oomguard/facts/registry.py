"""The config reader's dispatch tables: which reader counts each ``model_type``, which vision
reader each multimodal wrapper uses, and the text-model aliases. Every reader module is
imported here; none of them imports this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from oomguard.errors import UnsupportedArchitecture
from oomguard.facts import config_families as fam
from oomguard.facts import config_generic
from oomguard.facts.config_core import (
    read_deepseek,
    read_falcon_h1,
    read_gpt_oss,
    read_granite_hybrid,
    read_granite_moe,
    read_jamba,
    read_kimi_linear,
    read_llama4_text,
    read_llama_like,
    read_mixtral,
    read_mllama_text,
    read_nemotron_h,
    read_opt,
    read_phi,
    read_phimoe,
    read_qwen3_next,
    read_qwen_moe,
    vision_clip_llava,
    vision_llama4,
    vision_mllama,
    vision_moonvit,
    vision_pixtral,
    vision_qwen2_5_vl,
    vision_qwen2_vl,
    vision_siglip_gemma3,
)
from oomguard.facts.config_parts import Acc, Cfg
from oomguard.memory.spec import VisionSpec

VisionReader = Callable[[Mapping[str, Any], str, int], VisionSpec]
VISION_BY_MODEL_TYPE: dict[str, VisionReader] = {
    "gemma3": vision_siglip_gemma3,
    "qwen2_5_vl": vision_qwen2_5_vl,
    "qwen2_vl": vision_qwen2_vl,
    "mistral3": vision_pixtral,
    "mllama": vision_mllama,
    "llama4": vision_llama4,
    "kimi_vl": vision_moonvit,
    "llava": vision_clip_llava,
    "gemma3n": fam.vision_gemma3n,
    "gemma4": fam.vision_gemma4,
    "llava_next": fam.vision_llava_next,
    "qwen3_vl": fam.vision_qwen3_vl,
    "qwen3_vl_moe": fam.vision_qwen3_vl,
    "qwen3_5": fam.vision_qwen3_vl,
    "qwen3_5_moe": fam.vision_qwen3_vl,
}

TEXT_ALIASES = {
    "qwen2_5_vl": "qwen2",
    "qwen2_vl": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen2_vl_text": "qwen2",
    "mistral3": "mistral",
    "ministral": "mistral",
    "kimi_k2": "deepseek_v3",
    "mllama_text_model": "mllama_text",
    "qwen3_vl_text": "qwen3",
    "qwen3_vl_moe_text": "qwen3_moe",
    "gemma3n": "gemma3n_text",
    "gemma4": "gemma4_text",
}

Reader = Callable[[Cfg, Acc, str], None]


def _readers() -> dict[str, Reader]:
    llama_like = (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "granite",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "phi3",
        "olmo2",
    )
    table: dict[str, Reader] = {t: read_llama_like for t in llama_like}
    table.update(
        {
            "phi": lambda c, a, t: read_phi(c, a),
            "opt": lambda c, a, t: read_opt(c, a),
            "mixtral": lambda c, a, t: read_mixtral(c, a),
            "qwen2_moe": read_qwen_moe,
            "qwen3_moe": read_qwen_moe,
            "deepseek_v2": lambda c, a, t: read_deepseek(c, a, c.int("vocab_size")),
            "deepseek_v3": lambda c, a, t: read_deepseek(c, a, c.int("vocab_size")),
            "deepseek_v32": lambda c, a, t: read_deepseek(c, a, c.int("vocab_size")),
            "gpt_oss": lambda c, a, t: read_gpt_oss(c, a),
            "llama4_text": lambda c, a, t: read_llama4_text(c, a),
            "llama4": lambda c, a, t: read_llama4_text(c, a),
            "granitemoe": read_granite_moe,
            "granitemoeshared": read_granite_moe,
            "phimoe": lambda c, a, t: read_phimoe(c, a),
            "jamba": lambda c, a, t: read_jamba(c, a),
            "nemotron_h": lambda c, a, t: read_nemotron_h(c, a),
            "falcon_h1": lambda c, a, t: read_falcon_h1(c, a),
            "granitemoehybrid": lambda c, a, t: read_granite_hybrid(c, a),
            "qwen3_next": read_qwen3_next,
            "qwen3_5_text": read_qwen3_next,
            "qwen3_5_moe_text": read_qwen3_next,
            "kimi_linear": lambda c, a, t: read_kimi_linear(c, a),
            "mllama_text": lambda c, a, t: read_mllama_text(c, a),
        }
    )
    return table


READERS: dict[str, Reader] = {
    **_readers(),
    # the 2025–2026 families
    "gemma3n_text": fam.read_gemma3n_text,
    "gemma4_text": fam.read_gemma4_text,
    "exaone4": fam.read_exaone4,
    "glm4_moe": fam.read_glm4_moe,
}


def supported_model_types() -> list[str]:
    """model_type values this reader accounts for (text decoders and multimodal wrappers)."""
    return sorted(set(READERS) | set(VISION_BY_MODEL_TYPE) | set(TEXT_ALIASES))


# model types known to need accounting the readers do not have (the generic reader must not
# guess them): what is missing
_NOT_MODELLED = {
    "deepseek_v4": "DeepSeek-V4's compressed sparse attention (per-layer compress_ratios, a "
    "separate sliding-window cache and compressor state per layer, hyper-connections) is not "
    "modelled",
}


def pick_reader(
    text: Mapping[str, Any], config: Mapping[str, Any], arch: str, text_type: str
) -> tuple[Reader, list[str]]:
    """The reader of ``text_type``, else the generic reader with its caveats (or a refusal)."""
    reader = READERS.get(text_type)
    if reader is not None:
        return reader, []
    if text_type in _NOT_MODELLED:
        raise UnsupportedArchitecture(
            f"architecture {arch} (model_type {text_type!r}) is not supported: "
            f"{_NOT_MODELLED[text_type]}",
            "no workaround yet; plan a supported model of similar size for a rough figure",
        )
    try:
        caveats = config_generic.generic_caveats(text, config, arch, text_type)
    except UnsupportedArchitecture as exc:
        raise UnsupportedArchitecture(
            exc.message,
            f"{exc.hint}; model types with their own reader: {', '.join(supported_model_types())}",
        ) from None
    return config_generic.read_generic, caveats
