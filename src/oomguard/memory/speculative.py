"""Speculative decoding: what a drafter adds to vLLM's memory (docs/memory-model.md §2.8).

Facts from vLLM 0.32's source, file by file:

- ``config/speculative.py`` (``SpeculativeConfig``): the methods; an MTP model type given as
  the method is renamed ``mtp``; without a method the drafter's name picks it (``eagle-`` →
  eagle, ``eagle3`` → eagle3, ``dflash`` → dflash, otherwise ``draft_model``);
  ``num_speculative_tokens`` defaults to the drafter's ``n_predict`` (MTP: the checkpoint's
  ``num_nextn_predict_layers`` / ``mtp_num_hidden_layers``) and must then be a multiple of it;
  an MTP drafter is the target checkpoint itself; ``draft_tensor_parallel_size`` is 1 or the
  target's TP; ``max_num_new_slots_for_drafting`` (0 for EAGLE/MTP, 1 for a draft model,
  K for DFlash, K − 1 for parallel EAGLE).
- ``engine/arg_utils.py``: ``--speculative-config``/``-sc`` is JSON; the older ``--spec-method``,
  ``--spec-model`` and ``--spec-tokens`` fill the same keys and may not repeat one.
- ``v1/worker/gpu_model_runner.py`` ``load_model``: the drafter loads inside the
  ``DeviceMemoryProfiler`` block, so its weights are part of "Model loading took".
- ``get_kv_cache_spec`` collects every attention layer of the forward context, the
  drafter's included: they join the target's KV groups (bytes per token grow).
- ``model_executor/layers/mamba/abstract.py``: a Mamba layer's spec carries
  ``num_speculative_blocks = num_speculative_tokens`` (``v1/kv_cache_interface.py``
  ``MambaSpec.max_memory_usage_bytes`` counts them), and ``mamba_utils.py`` widens the conv
  state by ``num_spec`` rows (Mamba2, GDN, short-conv).
- ``v1/core/kv_cache_utils.py``: with a multi-module MTP chain, sliding-window layers keep
  ``num_prefill_lookahead_tokens − 1`` extra tokens (``config/vllm.py``).
- ``config/vllm.py`` ``_set_cudagraph_sizes``: with drafts, a decode step is
  ``1 + num_speculative_tokens`` tokens per request; the capture sizes add the uniform-decode
  sizes (request counts × that query length) under the ceiling
  ``min(2 · max_num_seqs · query_len, 512)`` (1024 on Blackwell).
- ``config/vllm.py`` ``_set_max_num_scheduled_tokens``: ``max_num_batched_tokens`` must exceed
  the drafting slots.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from oomguard.errors import BadInput
from oomguard.memory.spec import AttentionKind, LayerSpec, ModelSpec

# vLLM 0.32 config/speculative.py MTPModelTypes: the per-family names, all renamed "mtp"
MTP_METHOD_ALIASES = frozenset(
    {
        "deepseek_mtp", "dots3_note_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp",
        "glm4_moe_lite_mtp", "glm_ocr_mtp", "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp",
        "exaone4_5_mtp", "qwen3_next_mtp", "qwen4_exp_mtp", "qwen3_5_mtp", "longcat_flash_mtp",
        "bailing_hybrid_v3_mtp", "minimax_m3_mtp", "bailing_hybrid_mtp", "mtp", "kimi_k3_mtp",
        "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp", "hy_v4_mtp", "gemma4_mtp",
        "inkling_mtp", "glm5_next_mtp",
    }
)  # fmt: skip
# the other methods of SpeculativeMethod (vLLM 0.32 config/speculative.py)
SPECULATIVE_METHODS = (
    "eagle", "eagle3", "mtp", "draft_model", "dflash", "dspark", "ngram", "ngram_gpu",
    "suffix", "medusa", "mlp_speculator", "extract_hidden_states", "custom_class",
)  # fmt: skip
# drafters that write KV for their own attention layers (SpeculativeConfig.uses_draft_kv_cache)
KV_DRAFTERS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark", "draft_model"})
# methods whose drafter is a model named in "model" (config/speculative.py __post_init__)
NEEDS_DRAFTER = frozenset(
    {"eagle", "eagle3", "dflash", "dspark", "draft_model", "medusa", "mlp_speculator"}
)
# drafters that need no weights of their own
WEIGHTLESS_DRAFTERS = frozenset({"ngram", "ngram_gpu", "suffix", "custom_class"})
# the keys of vLLM's JSON that change what is priced; the others are kept and passed back
_PRICED_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    "draft_tensor_parallel_size",
    "parallel_drafting",
)
# the older flags and the key each fills (vLLM 0.32 engine/arg_utils.py)
LEGACY_FLAGS = {
    "spec-method": "method",
    "spec-model": "model",
    "spec-tokens": "num_speculative_tokens",
}
# MTP layers vLLM builds when the config names none (model_type → layers): Qwen3-Next's
# config has no count and Qwen3NextMTP defaults to one (model_executor/models/qwen3_next_mtp.py)
MTP_DEFAULT_LAYERS = {"qwen3_next": 1}
# an unknown EAGLE-family drafter: one decoder layer of the target's shape (the heads vLLM
# ships have one), up to this many when its config cannot be read
UNKNOWN_DRAFTER_MAX_LAYERS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` as given (the keys that size memory, and the rest, kept)."""

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int | None = None
    draft_tensor_parallel_size: int | None = None
    parallel_drafting: bool = False
    other: tuple[tuple[str, str], ...] = ()  # other keys, JSON-encoded values, in given order
    # the drafter's facts when available locally (set by oomguard.facts.resolve.attach_drafter)
    draft: ModelSpec | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object vLLM reads (only the keys given)."""
        out: dict[str, Any] = {}
        for key in _PRICED_KEYS:
            value = getattr(self, key)
            if value is not None and value is not False:
                out[key] = value
        out.update({k: json.loads(v) for k, v in self.other})
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(
            f"--speculative-config {key} {value!r} is not a positive integer",
            f'write "{key}": 3 (a whole number above 0)',
        )
    return value


def check_method(method: str | None) -> str | None:
    """The method as vLLM keeps it (an MTP family name becomes ``mtp``), or BadInput."""
    if method is None:
        return None
    if method in MTP_METHOD_ALIASES:
        return "mtp"
    if method == "[ngram]":
        return "ngram"
    if method not in SPECULATIVE_METHODS:
        raise BadInput(
            f"speculative method {method!r} is not one vLLM 0.32 knows",
            "use one of: " + ", ".join(SPECULATIVE_METHODS) + " (or a family MTP name)",
        )
    return method


def from_mapping(data: dict[str, Any]) -> SpeculativeConfig:
    """A :class:`SpeculativeConfig` from vLLM's JSON object (dashes read as underscores)."""
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    method = data.get("method")
    if method is not None and not isinstance(method, str):
        raise BadInput(
            f"--speculative-config method {method!r} is not a name", 'write "method": "eagle3"'
        )
    model = data.get("model")
    tokens = data.get("num_speculative_tokens")
    draft_tp = data.get("draft_tensor_parallel_size")
    if "tensor_parallel_size" in data:
        raise BadInput(
            "'tensor_parallel_size' is not a valid key of --speculative-config",
            "write draft_tensor_parallel_size instead",
        )
    return SpeculativeConfig(
        method=check_method(method),
        model=None if model is None else str(model),
        num_speculative_tokens=None
        if tokens is None
        else _positive_int(tokens, "num_speculative_tokens"),
        draft_tensor_parallel_size=(
            None if draft_tp is None else _positive_int(draft_tp, "draft_tensor_parallel_size")
        ),
        parallel_drafting=bool(data.get("parallel_drafting", False)),
        other=tuple((k, json.dumps(v)) for k, v in data.items() if k not in _PRICED_KEYS),
    )


def parse_speculative_config(text: str, flag: str = "--speculative-config") -> SpeculativeConfig:
    """Read ``--speculative-config`` JSON as vLLM does (``json.loads``); BadInput otherwise."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(
            f"{flag} is not valid JSON ({exc.msg} at column {exc.colno})",
            "quote it whole, e.g. "
            '\'{"method": "eagle3", "model": "…", "num_speculative_tokens": 3}\'',
        ) from None
    if data is None:
        return SpeculativeConfig()
    if not isinstance(data, dict):
        raise BadInput(
            f"{flag} is not a JSON object", 'write {"method": …, "num_speculative_tokens": …}'
        )
    return from_mapping(data)


def merge_legacy(base: SpeculativeConfig | None, flag: str, value: Any) -> SpeculativeConfig:
    """Fold ``--spec-method``/``--spec-model``/``--spec-tokens`` into the config, refusing a
    key given twice as vLLM does."""
    key = LEGACY_FLAGS[flag]
    data = dict(base.to_dict()) if base is not None else {}
    if key in data:
        raise BadInput(
            f"--{flag} and --speculative-config['{key}'] are mutually exclusive",
            f"give {key} once",
        )
    if key == "num_speculative_tokens":
        try:
            value = int(str(value))
        except ValueError:
            raise BadInput(
                f"--{flag} {value!r} is not an integer", f"pass a whole number to --{flag}"
            ) from None
    data[key] = str(value) if key != "num_speculative_tokens" else value
    return from_mapping(data)


# --------------------------------------------------------------------------------------------
# resolution against the target
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Speculation:
    """The drafter as vLLM resolves it for one target, with what it adds."""

    method: str
    num_speculative_tokens: int
    draft_tp: int
    draft_name: str | None
    # the drafter's KV entries (per-layer states, target format), appended after the target's
    draft_layers: tuple[LayerSpec, ...] = ()
    draft_weights_bytes: int = 0  # per rank, on the last stage (MTP: in the target's count)
    draft_weights_high_bytes: int = 0  # the high end when the drafter's config is unknown
    extra_draft_layers_high: tuple[LayerSpec, ...] = ()  # KV entries the high end adds
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def loads_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def uniform_decode_query_len(self) -> int:
        """Tokens per request in a decode step (config/vllm.py ``uniform_decode_query_len``)."""
        return 1 + self.num_speculative_tokens

    @property
    def lookahead_tokens(self) -> int:
        """KV slots reserved past the scheduled tokens (config/vllm.py ``num_lookahead_tokens``)."""
        if self.method == "dflash":
            return self.num_speculative_tokens + 1
        if self.method in ("eagle", "eagle3", "mtp", "dspark", "draft_model"):
            return self.num_speculative_tokens
        return 0

    def drafting_slots(self, parallel: bool) -> int:
        """``max_num_new_slots_for_drafting`` (config/speculative.py)."""
        k = self.num_speculative_tokens
        if self.method == "dflash":
            return k
        if parallel:
            return k if self.method == "draft_model" else k - 1
        return 1 if self.method == "draft_model" else 0

    def sliding_retained_tokens(self, model: ModelSpec) -> int:
        """Extra tokens sliding windows keep for a multi-module MTP chain (kv_cache_utils.py)."""
        if self.method != "mtp" or min(mtp_layer_count(model), self.num_speculative_tokens) <= 1:
            return 0
        return self.num_speculative_tokens - 1


def _method_of(cfg: SpeculativeConfig) -> str:
    """vLLM's method detection when none is given (config/speculative.py ``__post_init__``)."""
    if cfg.method is not None:
        return cfg.method
    name = (cfg.model or "").lower()
    if name in ("ngram", "[ngram]"):
        return "ngram"
    if "eagle-" in name:
        return "eagle"
    if "eagle3" in name:
        return "eagle3"
    if "dflash" in name:
        return "dflash"
    return "draft_model"


def mtp_layer_count(model: ModelSpec) -> int:
    """MTP modules vLLM builds for ``model`` (the checkpoint's count, else the family's)."""
    return model.num_mtp_layers or MTP_DEFAULT_LAYERS.get(model.model_type, 0)


def mtp_layers(model: ModelSpec) -> tuple[LayerSpec, ...]:
    """The KV entries of the checkpoint's MTP modules: each is one decoder layer shaped like
    the target's last attention layer (DeepSeek: MLA, plus its indexer on V3.2; Qwen3-Next,
    Qwen3.5/3.6, GLM-4.5/4.6, MiMo: full attention)."""
    from oomguard.memory.kv import state_entry_layer

    owner = state_entry_layer(model)
    attn = [
        i
        for i, layer in enumerate(model.layers)
        if layer.kind in (AttentionKind.FULL, AttentionKind.MLA)
    ]
    if not attn or not mtp_layer_count(model):
        return ()
    last = owner[attn[-1]]
    module = tuple(
        layer
        for i, layer in enumerate(model.layers)
        if owner[i] == last and layer.kind not in (AttentionKind.MAMBA, AttentionKind.NONE)
    )
    return module * mtp_layer_count(model)


def _draft_layers(draft: ModelSpec) -> tuple[LayerSpec, ...]:
    return tuple(
        layer
        for layer in draft.layers
        if layer.kind not in (AttentionKind.MAMBA, AttentionKind.NONE)
    )


def _target_layer_estimate(model: ModelSpec) -> tuple[LayerSpec, ...]:
    """One attention layer of the target's shape (an unknown EAGLE-family drafter's layer)."""
    for layer in model.layers:
        if layer.kind in (AttentionKind.FULL, AttentionKind.MLA, AttentionKind.SLIDING):
            return (replace(layer, kind=AttentionKind.FULL, sliding_window=None),)
    return ()


def _mean_layer_bytes(model: ModelSpec, tp: int, dtype_bytes: int) -> int:
    """One decoder layer's weights on one rank: the per-layer parameters over the layers."""
    per_layer = sum(g.count for g in model.params if g.per_layer and g.name != "mamba")
    return per_layer // max(1, model.num_layers) * dtype_bytes // tp


def _dense_layer_params(model: ModelSpec) -> int:
    """Parameters of one dense decoder layer of the target's width (attention + gated MLP)."""
    h, heads, kv = model.hidden_size, model.num_attention_heads, model.num_kv_heads
    attn = h * model.head_size * (2 * heads + 2 * kv)
    return attn + 3 * h * model.intermediate_size


def _unknown_draft(
    cfg: SpeculativeConfig, method: str, model: ModelSpec, tp: int, dbytes: int
) -> tuple[int, int, tuple[LayerSpec, ...], tuple[LayerSpec, ...], str]:
    """(weights, weights high, KV entries, extra entries at the high end, note) of a drafter
    whose config is not available: one target-shaped decoder layer, widened."""
    layer = _dense_layer_params(model)
    one = _target_layer_estimate(model)
    if method == "draft_model":
        # a whole small language model: nothing to centre on; the high end allows a quarter
        # of the target's layers and weights
        n_high = max(1, model.num_layers // 4)
        high = n_high * layer * dbytes // tp
        note = (
            f"drafter {cfg.model or '?'}: config not available locally; its weights and KV are "
            f"not priced (range widened to {n_high} target-sized layers)"
        )
        return 0, high, (), one * n_high, note
    fc = 3 * model.hidden_size * model.hidden_size if method == "eagle3" else 0
    head = model.hidden_size * model.vocab_size
    value = (layer + fc) * dbytes // tp
    high = (UNKNOWN_DRAFTER_MAX_LAYERS * layer + fc + head) * dbytes // tp
    note = (
        f"drafter {cfg.model or '?'}: config not available locally; priced as one decoder "
        f"layer of the target's shape (range up to {UNKNOWN_DRAFTER_MAX_LAYERS} layers and "
        "its own LM head)"
    )
    return value, high, one, one * (UNKNOWN_DRAFTER_MAX_LAYERS - 1), note


def _checked_tokens(cfg: SpeculativeConfig, method: str, model: ModelSpec) -> int:
    """``num_speculative_tokens`` as vLLM settles it, or BadInput where vLLM refuses."""
    # vLLM's n_predict: the config's count (hf_config_override); None when it names none
    n_predict = model.num_mtp_layers if method == "mtp" and model.num_mtp_layers else None
    if method == "mtp" and not mtp_layer_count(model):
        raise BadInput(
            f"{model.name} has no MTP layers (num_nextn_predict_layers) to draft with",
            'use "method": "eagle3" with a drafter, or a checkpoint that ships MTP layers',
        )
    tokens = cfg.num_speculative_tokens or n_predict
    if tokens is None:
        raise BadInput(
            "--speculative-config has no num_speculative_tokens",
            'add "num_speculative_tokens": 3 (vLLM needs it unless the drafter sets n_predict)',
        )
    if n_predict and tokens > n_predict and tokens % n_predict:
        raise BadInput(
            f"num_speculative_tokens:{tokens} must be divisible by n_predict={n_predict}",
            f"use a multiple of {n_predict}",
        )
    if method in NEEDS_DRAFTER and not cfg.model:
        raise BadInput(
            f"speculative method {method} needs a drafter",
            'add "model": "<drafter repo or path>" to --speculative-config',
        )
    return tokens


def _mtp_speculation(spec: Speculation, model: ModelSpec, tp: int, dtype_bytes: int) -> Speculation:
    """The checkpoint's own MTP modules: their KV layers, and their weights when the facts
    lack them (estimated as the target's mean layer, up to twice that)."""
    spec = replace(spec, draft_layers=mtp_layers(model), draft_name=model.name)
    if model.num_mtp_layers:  # the weights are the facts' "mtp" group, loaded with the target
        return spec
    value = _mean_layer_bytes(model, tp, dtype_bytes) * mtp_layer_count(model)
    estimated = (
        f"{model.name}: MTP weights not in the model facts; estimated as "
        f"{value / 2**30:.2f} GiB (range up to twice that)"
    )
    return replace(
        spec, draft_weights_bytes=value, draft_weights_high_bytes=2 * value, notes=(estimated,)
    )


def resolve_speculation(
    cfg: SpeculativeConfig,
    model: ModelSpec,
    *,
    tp: int,
    dtype_bytes: int,
    draft: ModelSpec | None = None,
    draft_weights_bytes: int | None = None,
) -> Speculation:
    """The drafter vLLM runs for ``model``: method, tokens, its KV entries and weights.

    ``draft`` is the drafter's facts when they are available locally (catalogue or a local
    directory), with ``draft_weights_bytes`` its per-rank weights at the draft TP. Raises
    :class:`BadInput` where vLLM refuses the configuration.
    """
    method = _method_of(cfg)
    tokens = _checked_tokens(cfg, method, model)
    draft_tp = cfg.draft_tensor_parallel_size or tp
    if draft_tp not in (1, tp):
        raise BadInput(
            f"draft_tensor_parallel_size={draft_tp} cannot be other value than 1 or target "
            "model tensor_parallel_size",
            f"use 1 or {tp}",
        )
    spec = Speculation(method, tokens, draft_tp, cfg.model)
    if method == "mtp":
        return _mtp_speculation(spec, model, tp, dtype_bytes)
    if method not in KV_DRAFTERS:
        unpriced = (
            () if method in WEIGHTLESS_DRAFTERS else (f"{method} drafter weights not priced",)
        )
        return replace(spec, notes=unpriced)
    if draft is not None and draft_weights_bytes is not None:
        return replace(
            spec,
            draft_layers=_draft_layers(draft),
            draft_weights_bytes=draft_weights_bytes,
            draft_weights_high_bytes=draft_weights_bytes,
        )
    value, high, layers, extra, note = _unknown_draft(cfg, method, model, draft_tp, dtype_bytes)
    return replace(
        spec,
        draft_layers=layers,
        draft_weights_bytes=value,
        draft_weights_high_bytes=high,
        extra_draft_layers_high=extra,
        notes=(note,),
    )


def capture_sizes(
    max_num_seqs: int, max_num_batched_tokens: int, query_len: int, compute_capability: str = ""
) -> list[int]:
    """vLLM 0.32's default CUDA-graph capture sizes with ``query_len`` tokens per decoding
    request (config/vllm.py ``_set_cudagraph_sizes``)."""
    platform_max = 1024 if compute_capability.startswith("10") else 512
    ceiling = min(max_num_seqs * query_len * 2, platform_max)
    decode: set[int] = set()
    if query_len > 1:
        reqs = min(max_num_seqs, platform_max)
        counts = [n for n in (1, 2, 4) if n <= reqs]
        counts += [*range(8, min(reqs + 1, 256), 8), *range(256, reqs + 1, 16), reqs]
        decode = {n * query_len for n in counts if n * query_len <= ceiling}
    elif max_num_seqs <= ceiling:
        decode = {max_num_seqs}
    largest = min(max_num_batched_tokens, ceiling)
    sizes = {n for n in (1, 2, 4) if n <= largest}
    if largest >= 8:
        sizes.update(range(8, min(largest + 1, 256), 8))
    if largest >= 256:
        sizes.update(range(256, largest + 1, 16))
    if max_num_batched_tokens <= largest:
        sizes.add(max_num_batched_tokens)
    sizes.update(s for s in decode if s <= max_num_batched_tokens)
    return sorted(sizes)


def summary(spec: Speculation) -> str:
    """One line naming the drafter and what it adds (for the plan)."""
    kv = len(spec.draft_layers)
    where = (
        "in the target's weights"
        if spec.loads_mtp
        else f"{spec.draft_weights_bytes / 2**30:.2f} GiB"
    )
    return (
        f"speculative decoding: {spec.method}, {spec.num_speculative_tokens} tokens; drafter "
        f"{spec.draft_name or '-'} weights {where}, {kv} KV layer(s) in the shared pool"
    )


def as_dict(spec: Speculation) -> dict[str, Any]:
    """Plain-data view of a resolved drafter (JSON-ready)."""
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "draft_tensor_parallel_size": spec.draft_tp,
        "drafter": spec.draft_name,
        "drafter_weights_gib": round(spec.draft_weights_bytes / 2**30, 4),
        "drafter_weights_high_gib": round(spec.draft_weights_high_bytes / 2**30, 4),
        "drafter_kv_layers": len(spec.draft_layers),
        "lookahead_tokens": spec.lookahead_tokens,
        "notes": list(spec.notes),
    }
