"""Cut a real model's ``config.json`` to a few layers so vLLM on CPU can load it.

Pure: :func:`cut_config` takes the config dict and a function that counts a config's parameters
(the planner's own reader, passed in) and returns the cut config and one note per change, so a
table can say exactly how each model was cut. Rules, in order:

1. Layers: the smallest prefix of the layer pattern that holds every kind of layer the model has
   (``layer_types``, a hybrid pattern string, Jamba's attention/expert periods, Gemma 3's sliding
   window pattern, DeepSeek's leading dense layers), at least :data:`MIN_LAYERS`. Every per-layer
   list is truncated to match.
2. Experts: at most :data:`MAX_EXPERTS` routed experts (top-k and expert groups follow).
3. Widths are kept while the weights in float32 stay within the budget; over it the vocabulary
   shrinks first (to :data:`SMALL_VOCAB`), then the MLP widths halve, then attention heads halve
   (head size kept). Vision towers are cut to :data:`MIN_LAYERS` blocks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MIN_LAYERS = 2
MAX_EXPERTS = 8
SMALL_VOCAB = 32_768
FP32_BYTES = 4
DEFAULT_BUDGET_BYTES = 1 << 30  # dummy float32 weights per model

# Keys that count layers, in a text config (first present wins) and in a vision tower.
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
VISION_LAYER_KEYS = ("depth", "num_hidden_layers", "num_layers")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
MLP_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
            "ffn_dim", "intermediate_size_mlp")  # fmt: skip
PATTERN_STRING_KEYS = ("hybrid_override_pattern",)


@dataclass(frozen=True)
class CutResult:
    """The cut config and how it was cut (one short note per change)."""

    config: dict[str, Any]
    notes: tuple[str, ...]

    def describe(self) -> str:
        """The notes joined for a table cell."""
        return "; ".join(self.notes) if self.notes else "uncut"


def text_part(config: dict[str, Any]) -> dict[str, Any]:
    """The dict holding the language model's sizes (``text_config`` when there is one)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _layer_key(cfg: dict[str, Any]) -> str | None:
    return next((k for k in LAYER_KEYS if isinstance(cfg.get(k), int)), None)


def _prefix_covering(kinds: list[Any]) -> int:
    """Length of the shortest prefix that holds every distinct kind in ``kinds``."""
    wanted = {repr(k) for k in kinds}
    seen: set[str] = set()
    for i, kind in enumerate(kinds):
        seen.add(repr(kind))
        if seen == wanted:
            return i + 1
    return len(kinds)


def target_layers(cfg: dict[str, Any]) -> int:
    """How many layers keep every kind of layer the model has (see the module's rule 1)."""
    n = MIN_LAYERS
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        n = max(n, _prefix_covering(cfg["layer_types"]))
    for key in PATTERN_STRING_KEYS:
        if isinstance(cfg.get(key), str) and cfg[key]:
            n = max(n, _prefix_covering(list(cfg[key])))
    for period, offset in (
        ("attn_layer_period", "attn_layer_offset"),
        ("expert_layer_period", "expert_layer_offset"),
    ):
        if isinstance(cfg.get(period), int):
            n = max(n, int(cfg[period]), int(cfg.get(offset) or 0) + 1)
    for key in ("sliding_window_pattern", "full_attention_interval"):
        if isinstance(cfg.get(key), int) and cfg[key] > 1:
            n = max(n, int(cfg[key]))
    if isinstance(cfg.get("first_k_dense_replace"), int) and cfg["first_k_dense_replace"] > 0:
        n = max(n, 2)
    return n


def _cut_layers(cfg: dict[str, Any], notes: list[str]) -> None:
    key = _layer_key(cfg)
    if key is None:
        return
    total = int(cfg[key])
    n = min(total, target_layers(cfg))
    if n == total:
        return
    cfg[key] = n
    notes.append(f"layers {total}→{n}")
    for name, value in list(cfg.items()):
        if isinstance(value, list) and len(value) == total:
            cfg[name] = value[:n]
        elif name in PATTERN_STRING_KEYS and isinstance(value, str) and len(value) == total:
            cfg[name] = value[:n]
    if isinstance(cfg.get("first_k_dense_replace"), int) and cfg["first_k_dense_replace"] >= n:
        cfg["first_k_dense_replace"] = 1
        notes.append("first_k_dense_replace→1")
    shared = cfg.get("num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0:
        cfg["num_kv_shared_layers"] = 0
        notes.append(f"num_kv_shared_layers {shared}→0")
    for name in ("mlp_only_layers",):
        if isinstance(cfg.get(name), list):
            cfg[name] = [i for i in cfg[name] if i < n]


def _cut_experts(cfg: dict[str, Any], notes: list[str]) -> None:
    for key in EXPERT_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and value > MAX_EXPERTS:
            cfg[key] = MAX_EXPERTS
            notes.append(f"{key} {value}→{MAX_EXPERTS}")
    experts = next((cfg[k] for k in EXPERT_KEYS if isinstance(cfg.get(k), int)), None)
    if experts is None:
        return
    for key in ("num_experts_per_tok", "moe_topk", "top_k"):
        if isinstance(cfg.get(key), int) and cfg[key] > experts:
            cfg[key] = experts
    if isinstance(cfg.get("n_group"), int) and cfg["n_group"] > 1:
        cfg["n_group"], cfg["topk_group"] = 1, 1
        notes.append("n_group→1")


def _halve_mlp(cfg: dict[str, Any]) -> bool:
    changed = False
    for key in MLP_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and value >= 256:
            cfg[key] = max(128, (value // 2) // 64 * 64)
            changed = True
    return changed


def _halve_heads(cfg: dict[str, Any]) -> bool:
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if not isinstance(heads, int) or heads < 4 or heads % 2:
        return False
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    cfg["head_dim"] = head_dim
    cfg["num_attention_heads"] = heads // 2
    if isinstance(kv, int) and kv > 1 and kv % 2 == 0:
        cfg["num_key_value_heads"] = kv // 2
    cfg["hidden_size"] = cfg["num_attention_heads"] * head_dim
    return True


def _fit_budget(
    config: dict[str, Any],
    params_of: Callable[[dict[str, Any]], int],
    budget_bytes: int,
    notes: list[str],
) -> None:
    cfg = text_part(config)
    start = {
        k: cfg.get(k)
        for k in ("vocab_size", "vocab_size_per_layer_input", "hidden_size", *MLP_KEYS)
    }
    steps: list[Callable[[], bool]] = [
        lambda: _shrink_vocab(cfg),
        lambda: _halve_mlp(cfg),
        lambda: _halve_heads(cfg),
    ]
    for step in steps:
        for _ in range(6):
            if params_of(config) * FP32_BYTES <= budget_bytes:
                break
            if not step():
                break
    for key, before in start.items():
        if cfg.get(key) != before:
            notes.append(f"{key} {before}→{cfg.get(key)}")


def _shrink_vocab(cfg: dict[str, Any]) -> bool:
    changed = False
    for key in ("vocab_size", "vocab_size_per_layer_input"):
        vocab = cfg.get(key)
        if isinstance(vocab, int) and vocab > SMALL_VOCAB:
            cfg[key] = SMALL_VOCAB
            changed = True
    return changed


def _cut_vision(config: dict[str, Any], notes: list[str]) -> None:
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return
    for key in VISION_LAYER_KEYS:
        value = vision.get(key)
        if isinstance(value, int) and value > MIN_LAYERS:
            vision[key] = MIN_LAYERS
            notes.append(f"vision {key} {value}→{MIN_LAYERS}")
            for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
                if isinstance(vision.get(name), list):
                    vision[name] = [i for i in vision[name] if i < MIN_LAYERS][:1] or [0]
            break


def cut_config(
    config: dict[str, Any],
    params_of: Callable[[dict[str, Any]], int],
    *,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> CutResult:
    """A copy of ``config`` cut to a few layers and to ``budget_bytes`` of float32 weights."""
    out = copy.deepcopy(config)
    notes: list[str] = []
    cfg = text_part(out)
    _cut_layers(cfg, notes)
    _cut_experts(cfg, notes)
    _cut_vision(out, notes)
    _fit_budget(out, params_of, budget_bytes, notes)
    if "quantization_config" in out:
        del out["quantization_config"]
        notes.append("quantization dropped")
    return CutResult(out, tuple(notes))


def weights_gib(params: int) -> float:
    """Float32 GiB of ``params`` parameters (for notes)."""
    return params * FP32_BYTES / 2**30 if params else 0.0
