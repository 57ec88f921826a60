"""Turn a Hugging Face ``config.json`` (a dict) into a :class:`ModelSpec`.

One reader serves every source (catalogue entry, local directory, hub, GGUF-derived config).
Parameter counts follow the module layouts vLLM builds for each architecture
(``vllm/model_executor/models/*.py``); per-layer state kinds follow
``vllm/v1/kv_cache_interface.py``. An architecture whose memory cannot be accounted for
raises :class:`UnsupportedArchitecture` naming what is missing: nothing is guessed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomguard.errors import MalformedConfig, UnsupportedArchitecture
from oomguard.facts.config_parts import GROUP_LAYOUT, GROUP_ORDER, Acc, Cfg
from oomguard.facts.registry import READERS, TEXT_ALIASES, VISION_BY_MODEL_TYPE, pick_reader
from oomguard.memory.spec import (
    AttentionKind,
    ModelSpec,
    ParamGroup,
    ParamSharding,
    RopeCache,
)

# Keys vLLM reads for the default max_model_len (docs/memory-model.md §3.5).
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose ``factor`` vLLM does not multiply into the derived length (vLLM 0.32).
_ROPE_TYPES_NOT_SCALED = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)

# transformers' defaults for tie_word_embeddings when config.json omits it, by model_type.
_TIE_DEFAULT_BY_MODEL_TYPE: dict[str, bool] = {
    "opt": True,
    "gemma": True,
    "gemma2": True,
    "gemma3": True,
    "gemma3_text": True,
    "granite": False,
    "granitemoehybrid": True,
}


@dataclass(frozen=True)
class ConfigDefaults:
    """transformers' class defaults for one ``model_type``: what a sparse config.json omits.

    Hub files are written by ``PretrainedConfig.to_diff_dict()`` and list only the keys that
    differ from the class defaults (Gemma 3 is the common case), so the reader must apply
    them exactly as ``<Model>Config(**config)`` would. ``sub_configs`` names the default
    ``model_type`` of nested configs a wrapper builds (``text_config`` → ``gemma3_text``).
    """

    values: Mapping[str, Any]
    source: str
    sub_configs: Mapping[str, str] = field(default_factory=dict)


_TRANSFORMERS_AT = "https://github.com/huggingface/transformers/blob/008f5c8c29be84d4721dc6d1e0fcd72300580be4/src/transformers/models"

# Only fields that size memory or its derived length are listed. An explicit ``null`` in
# config.json stays null (as in transformers, where the argument is passed through).
CONFIG_DEFAULTS: dict[str, ConfigDefaults] = {
    "gemma3_text": ConfigDefaults(
        {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
         "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
         "head_dim": 256, "max_position_embeddings": 131_072, "tie_word_embeddings": True,
         "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "attention_bias": False,
         "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6},
        f"{_TRANSFORMERS_AT}/gemma3/configuration_gemma3.py Gemma3TextConfig.__init__",
    ),
    "gemma3": ConfigDefaults(
        {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
         "image_token_index": 262_144},
        f"{_TRANSFORMERS_AT}/gemma3/configuration_gemma3.py Gemma3Config.__init__ "
        "(text_config is built as Gemma3TextConfig, vision_config as SiglipVisionConfig)",
        {"text_config": "gemma3_text", "vision_config": "siglip_vision_model"},
    ),
    "siglip_vision_model": ConfigDefaults(
        {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16},
        f"{_TRANSFORMERS_AT}/siglip/configuration_siglip.py SiglipVisionConfig",
    ),
    "gemma2": ConfigDefaults(
        {"vocab_size": 256_000, "head_dim": 256, "max_position_embeddings": 8192,
         "sliding_window": 4096, "query_pre_attn_scalar": 256, "tie_word_embeddings": True},
        f"{_TRANSFORMERS_AT}/gemma2/configuration_gemma2.py Gemma2Config.__init__",
    ),
    "mistral": ConfigDefaults(
        {"sliding_window": 4096},
        f"{_TRANSFORMERS_AT}/mistral/configuration_mistral.py MistralConfig.__init__",
    ),
}  # fmt: skip


def apply_config_defaults(
    config: Mapping[str, Any], model_type: str | None = None
) -> dict[str, Any]:
    """``config`` with transformers' class defaults filled in, nested configs included.

    ``model_type`` overrides the config's own (a wrapper's ``text_config`` often has none).
    Keys present in ``config`` win, explicit ``null`` included; types without an entry in
    :data:`CONFIG_DEFAULTS` come back unchanged (as a shallow copy).
    """
    mtype = str(model_type or config.get("model_type") or "")
    entry = CONFIG_DEFAULTS.get(mtype)
    out: dict[str, Any] = dict(entry.values) if entry else {}
    out.update(config)
    for key in ("text_config", "vision_config", "llm_config", "language_config"):
        sub = out.get(key)
        if isinstance(sub, Mapping):
            sub_type = str(
                sub.get("model_type") or (entry.sub_configs.get(key, "") if entry else "")
            )
            out[key] = apply_config_defaults(sub, sub_type)
    return out


def _rope_params(text: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rp = text.get("rope_parameters") or text.get("rope_scaling")
    if not isinstance(rp, Mapping):
        return []
    if all(isinstance(v, Mapping) for v in rp.values()) and rp:
        return [
            v for v in rp.values() if isinstance(v, Mapping)
        ]  # per layer type (transformers v5)
    return [rp]


def derive_max_model_len(text: Mapping[str, Any], model_type: str) -> int:
    """vLLM's default ``max_model_len`` for a (text) config (docs/memory-model.md §3.5, vLLM 0.32).

    Min over the length keys (``model_max_length`` overrides), 2048 when none is present, times
    the RoPE ``factor`` unless the rope type keeps the length (llama3/yarn/longrope/...) or the
    model is Gemma-3; LongRoPE models default to ``original_max_position_embeddings``.
    """
    derived: float = math.inf
    for key in _MAX_LEN_KEYS:
        value = text.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            derived = min(derived, value)
    if isinstance(text.get("model_max_length"), (int, float)) and text.get("model_max_length"):
        derived = text["model_max_length"]
    if derived == math.inf:
        derived = 2048
    rope = _rope_params(text)
    if rope and "gemma3" not in model_type:
        factor: float = 1.0
        for rp in rope:
            rope_type = rp.get("rope_type", rp.get("type", "default"))
            if rope_type not in _ROPE_TYPES_NOT_SCALED:
                f = rp.get("factor", factor)
                factor = 1.0 if f is None else float(f)
        derived *= factor
    if any(rp.get("rope_type", rp.get("type")) in ("longrope", "su") for rp in rope):
        original = text.get("original_max_position_embeddings")
        if original:
            return int(original)
    return int(derived)


def _rope_positions(rp: Mapping[str, Any], max_position: int, top_original: Any) -> int:
    """Rows of one rope's cos/sin cache for its type (vllm/model_executor/layers/rotary_embedding/).

    YaRN and DeepSeek scaling build ``original_max_position_embeddings × factor`` rows
    (yarn_scaling_rope.py, deepseek_scaling_rope.py), linear scaling ``max_position × factor``
    (linear_scaling_rope.py), LongRoPE its short and long caches stacked (``original +
    max_position``, phi3_long_rope_scaled_rope.py); the others ``max_position`` (base.py).
    ``original_max_position_embeddings`` may sit beside the rope parameters (Phi-3).
    """
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    factor = rp.get("factor")
    original = rp.get("original_max_position_embeddings") or top_original
    if rope_type in ("yarn", "deepseek_yarn", "deepseek_llama_scaling") and factor and original:
        return int(int(original) * float(factor))
    if rope_type == "linear" and isinstance(factor, (int, float)):
        return int(max_position * float(factor))
    if rope_type in ("longrope", "su") and original:
        return int(original) + max_position
    return max_position


def rope_caches(
    text: Mapping[str, Any], acc: Acc, head_size: int, default_len: int
) -> tuple[RopeCache, ...]:
    """The rotary embeddings vLLM 0.32 instantiates for a text config, one per parameter set.

    ``get_rope`` keys its instances on (head size, rotary dim, positions, parameters, dtype), so
    layers with the same parameters share one (rotary_embedding/__init__.py). The rotary dim is
    ``rope_dim`` else ``head_size × partial_rotary_factor`` (also read as ``rotary_pct`` /
    ``rotary_emb_fraction``, vllm/transformers_utils/config.py ``patch_rope_parameters``).
    Gemma 3's sliding layers use their own base (``rope_local_base_freq``, models/gemma3.py).
    """
    if acc.rope_instances == 0 or text.get("position_embedding_type") == "nope":
        return ()
    max_position = text.get("max_position_embeddings")
    positions = int(max_position) if isinstance(max_position, (int, float)) else default_len
    params = _rope_params(text) or [{}]
    if text.get("rope_local_base_freq") is not None and len(params) == 1:
        params = [{"rope_theta": text["rope_local_base_freq"]}, params[0]]
    head = acc.rope_head or head_size
    partial = next(
        (
            text[k]
            for k in ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")
            if isinstance(text.get(k), (int, float))
        ),
        1.0,
    )
    seen: list[Mapping[str, Any]] = []
    caches: list[RopeCache] = []
    for rp in params:
        if rp in seen:
            continue
        seen.append(rp)
        dim = rp.get("rope_dim") or int(head * float(rp.get("partial_rotary_factor", partial)))
        rows = _rope_positions(rp, positions, text.get("original_max_position_embeddings"))
        cache = RopeCache(rows, int(dim), acc.rope_dtype)
        caches.extend([cache] * acc.rope_instances)
    return tuple(caches)


def _text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], bool]:
    for key in ("text_config", "llm_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping) and sub:
            return sub, True
    return config, False


@dataclass(frozen=True)
class TextConfig:
    """A config with its defaults applied, and where its text model is and how it is read."""

    config: Mapping[str, Any]
    text: Mapping[str, Any]  # the text model's config (``config`` itself unless nested)
    nested: bool
    arch: str
    top_type: str
    text_type: str  # the reader's model_type, aliases resolved


def resolve_text_config(config: Mapping[str, Any], source: str) -> TextConfig:
    """Find the text config and the model type its reader is registered under."""
    if not isinstance(config, Mapping):
        raise MalformedConfig(
            f"{source}: config is a {type(config).__name__}, not a JSON object",
            "point at the model's config.json",
        )
    archs = config.get("architectures") or []
    top_type = str(config.get("model_type") or "")
    arch = str(archs[0]) if archs else (top_type or "unknown")
    if not top_type:
        raise UnsupportedArchitecture(
            f"{arch}: config.json has no model_type",
            "use the model's original config.json (it names model_type)",
        )
    config = apply_config_defaults(config)
    text, nested = _text_config(config)
    text_type = str(text.get("model_type") or top_type) if nested else top_type
    if top_type == "mllama":
        text_type = "mllama_text"
    if top_type == "kimi_vl" and text_type not in READERS:
        text_type = "deepseek_v3"
    text_type = TEXT_ALIASES.get(text_type, text_type)
    return TextConfig(config, text, nested, arch, top_type, text_type)


def run_reader(tc: TextConfig) -> tuple[Cfg, Acc, list[str]]:
    """Run the family reader over the text config: its config view, its counts and its caveats
    (those of the generic reader when the type has no reader of its own)."""
    reader, caveats = pick_reader(tc.text, tc.config, tc.arch, tc.text_type)
    if tc.nested and "vision_config" in tc.config and tc.top_type not in VISION_BY_MODEL_TYPE:
        raise UnsupportedArchitecture(
            f"architecture {tc.arch}: vision tower of model_type {tc.top_type!r} "
            "is not accounted for",
            f"supported multimodal model types: {', '.join(sorted(VISION_BY_MODEL_TYPE))}",
        )
    c = Cfg(tc.text, tc.arch, tc.config if tc.nested else None)
    acc = Acc()
    try:
        reader(c, acc, tc.text_type)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        # a field of the wrong type or shape (e.g. "hidden_size": "big", short layer list)
        raise MalformedConfig(
            f"{tc.arch}: config.json has a field of the wrong type or length "
            f"({type(exc).__name__}: {exc})",
            "fix config.json or use the model's original one",
        ) from None
    return c, acc, caveats


def _embed_cols(c: Cfg, acc: Acc) -> int:
    return acc.embed_cols if acc.embed_cols is not None else c.int("hidden_size")


def add_embeddings(tc: TextConfig, c: Cfg, acc: Acc) -> bool:
    """Count the embedding, the lm_head unless tied, and the vision tower; whether tied."""
    hidden, vocab = c.int("hidden_size"), c.int("vocab_size")
    acc.add("embed", vocab * _embed_cols(c, acc))
    tie = _tie_word_embeddings(tc.text, tc.config, tc.text_type, tc.top_type)
    if not tie:
        acc.add("lm_head", vocab * _embed_cols(c, acc))
    vision_reader = VISION_BY_MODEL_TYPE.get(tc.top_type)
    if vision_reader is not None and isinstance(tc.config.get("vision_config"), Mapping):
        acc.vision = vision_reader(tc.config, tc.arch, hidden)
        acc.add("vision", acc.vision.params)
    return tie


def param_groups(c: Cfg, acc: Acc) -> tuple[ParamGroup, ...]:
    """The counted groups in layout order, each with its sharding, stage and table shape."""
    vocab = c.int("vocab_size")
    groups = []
    order = sorted(acc.counts, key=lambda g: GROUP_ORDER.index(g) if g in GROUP_ORDER else 99)
    for gname in order:
        sharding, quantizable, per_layer, stage = GROUP_LAYOUT.get(
            gname, (ParamSharding.REPLICATED, False, True, "layers")
        )
        vocab_sharded = sharding is ParamSharding.VOCAB
        rows = vocab + (acc.extra_vocab_rows if gname == "embed" else 0) if vocab_sharded else 0
        cols = _embed_cols(c, acc) if vocab_sharded else 0
        if gname == "embed_per_layer":
            rows = c.int("vocab_size_per_layer_input", vocab)
            cols = acc.counts[gname] // rows
        groups.append(
            ParamGroup(
                name=gname,
                count=acc.counts[gname],
                sharding=sharding,
                quantizable=quantizable,
                per_layer=per_layer,
                stage=stage,
                rows=rows,
                cols=cols,
            )
        )
    return tuple(groups)


_ATTENTION_KINDS = (
    AttentionKind.FULL,
    AttentionKind.SLIDING,
    AttentionKind.CHUNKED,
    AttentionKind.MLA,
)


def assemble_spec(
    tc: TextConfig,
    c: Cfg,
    acc: Acc,
    *,
    tie: bool,
    caveats: list[str],
    name: str,
    source: str,
    param_bytes_by_dtype: Mapping[str, int] | None,
) -> ModelSpec:
    """The :class:`ModelSpec` from the reader's counts and the config's own fields."""
    from oomguard.facts.quant import detect_quant  # local import: quant imports nothing from here

    first_attn = next((ly for ly in acc.layers if ly.kind in _ATTENTION_KINDS), None)
    text, config = tc.text, tc.config
    dtype = str(
        text.get("torch_dtype")
        or text.get("dtype")
        or config.get("torch_dtype")
        or config.get("dtype")
        or "float32"
    )
    inter = c.get("intermediate_size") or c.get("moe_intermediate_size") or c.get("ffn_dim") or 0
    if isinstance(inter, list):  # per-layer sizes (Gemma 3n): the widest sets the peak
        inter = max(int(x) for x in inter)
    return ModelSpec(
        name=name,
        architecture=tc.arch,
        model_type=tc.top_type,
        dtype=dtype,
        hidden_size=c.int("hidden_size"),
        intermediate_size=int(inter),
        num_layers=acc.num_layers if acc.num_layers is not None else c.int("num_hidden_layers"),
        num_attention_heads=c.int("num_attention_heads", 0),
        num_kv_heads=first_attn.num_kv_heads if first_attn else 0,
        head_size=first_attn.head_size if first_attn else 0,
        vocab_size=c.int("vocab_size"),
        tie_word_embeddings=tie,
        derived_max_model_len=derive_max_model_len(text, tc.text_type),
        rope_caches=rope_caches(
            text,
            acc,
            first_attn.head_size if first_attn else 0,
            derive_max_model_len(text, tc.text_type),
        ),
        layers=tuple(acc.layers),
        params=param_groups(c, acc),
        quant=detect_quant(config, name),
        moe=acc.moe,
        vision=acc.vision,
        num_mtp_layers=acc.num_mtp_layers,
        checkpoint_bytes_by_dtype=dict(param_bytes_by_dtype or {}),
        source=source,
        verified=not caveats,
        caveats=tuple(caveats),
    )


def spec_from_config(
    config: Mapping[str, Any],
    *,
    name: str,
    source: str,
    param_bytes_by_dtype: Mapping[str, int] | None = None,
) -> ModelSpec:
    """Build the :class:`ModelSpec` for one HF ``config.json`` dict.

    ``name`` is the model's id (used for quantization hints from the repo name), ``source``
    records where the config came from. Raises :class:`UnsupportedArchitecture` for a model type
    it cannot account for (or one missing the fields that size it) and :class:`MalformedConfig`
    for values of the wrong type. The quantization format comes from ``quantization_config``,
    else from the name (``-AWQ``, ``-FP8``…).
    """
    tc = resolve_text_config(config, source)
    c, acc, caveats = run_reader(tc)
    tie = add_embeddings(tc, c, acc)
    return assemble_spec(
        tc,
        c,
        acc,
        tie=tie,
        caveats=caveats,
        name=name,
        source=source,
        param_bytes_by_dtype=param_bytes_by_dtype,
    )


def _tie_word_embeddings(
    text: Mapping[str, Any], top: Mapping[str, Any], text_type: str, top_type: str
) -> bool:
    for cfg in (text, top):
        value = cfg.get("tie_word_embeddings")
        if isinstance(value, bool):
            return value
    return _TIE_DEFAULT_BY_MODEL_TYPE.get(
        text_type, _TIE_DEFAULT_BY_MODEL_TYPE.get(top_type, False)
    )
