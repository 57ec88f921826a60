"""Multimodal limits: the encoder budget, the profiled items, the tower's weights, host caches.

From vllm 0.32:

* ``--limit-mm-per-prompt`` (``config/multimodal.py``: ``limit_per_prompt``) maps a modality to
  a count (999 when unnamed) or to ``{"count", "width", "height"}`` (image),
  ``{"count", "num_frames", "width", "height"}`` (video), ``{"count", "length"}`` (audio). The
  size options only shrink the dummy item the profile encodes
  (``multimodal/processing/dummy_inputs.py``: ``min(model's maximum, override)``); the budget
  is still counted from the model's maximal item.
* The encoder budget (``v1/core/encoder_cache_manager.py: compute_mm_encoder_budget``) is
  ``max(max_num_batched_tokens, max tokens of one item)``; the profile encodes
  ``max(1, min(budget // item, seqs × per_prompt))`` items of the modality with the most tokens,
  where ``per_prompt = max(1, min(limit, max_model_len // item))`` and ``seqs`` is
  ``max_num_seqs``, capped by ``max_num_batched_tokens // item`` without chunked prefill
  (``multimodal/encoder_budget.py: MultiModalBudget._get_max_items``). Their outputs stay in
  the encoder cache through the text dummy run and the sampler
  (``v1/worker/gpu_model_runner.py: profile_run``).
* A tower whose modalities all have limit 0 is not built at all
  (``model_executor/models/interfaces.py: _mark_tower_model``): its weights are not loaded and
  no encoder is profiled. ``--skip-mm-profiling`` keeps the weights but profiles no encoder.
* ``--mm-encoder-tp-mode data`` keeps the whole tower on every TP rank for the models that
  support it (``supports_encoder_tp_data``), else falls back to splitting its weights.
* The processor cache (``--mm-processor-cache-gb``, default 4) is host memory: an LRU copy in
  every API-server and engine process, or one shared-memory ring with ``shm``.

The encoder pass's own activation peak (the vision transformer over the dummy batch) is a
measurement that depends on the attention backend; :func:`encoder_pass_bytes` estimates it
and the engine prices it as a range.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from oomguard.memory.spec import ModelSpec, ParamGroup, ParamSharding
from oomguard.units import GIB

DEFAULT_LIMIT = 999  # config/multimodal.py: get_limit_per_prompt for an unnamed modality
DEFAULT_PROCESSOR_CACHE_GB = 4.0
SIZE_OPTIONS = {  # config/multimodal.py: ImageDummyOptions, VideoDummyOptions, AudioDummyOptions
    "image": ("count", "width", "height"),
    "video": ("count", "num_frames", "width", "height"),
    "audio": ("count", "length"),
}
ENCODER_TP_MODES = ("weights", "data")
PROCESSOR_CACHE_TYPES = ("lru", "shm")
# model types whose vision tower also encodes video (the tower is skipped only when both the
# image and the video limits are 0)
VIDEO_TOWER_MODEL_TYPES = frozenset(
    {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "glm4v_moe", "kimi_vl"}
)
# model types whose vision encoder supports ``--mm-encoder-tp-mode data``
# (``supports_encoder_tp_data = True`` in vllm 0.32 model_executor/models/*.py)
ENCODER_DATA_PARALLEL_MODEL_TYPES = frozenset(
    {
        "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "kimi_vl", "kimi_k25", "llama4",
        "glm4v", "glm4v_moe", "internvl_chat", "minicpmv", "step3_vl", "dots_ocr",
    }
)  # fmt: skip


# Vision-transformer patches per encoder output token (the projector's merge: 2×2 spatial
# merge in Qwen-VL, Kimi-VL's MoonViT and Mistral 3, Llama 4's pixel shuffle; Gemma 3 pools
# 4×4); other towers: 1.
PATCHES_PER_TOKEN = {
    "qwen2_vl": 4, "qwen2_5_vl": 4, "qwen3_vl": 4, "qwen3_vl_moe": 4, "kimi_vl": 4,
    "llama4": 4, "mistral3": 4, "gemma3": 16,
}  # fmt: skip
# A video item of the Qwen-VL towers fills the context with frames of the largest image size,
# two frames per temporal patch, up to 14 frames (model_executor/models/qwen2_vl.py:
# _MAX_FRAMES_PER_VIDEO, get_num_frames_with_most_features): at most 7 image-sized groups.
VIDEO_FRAME_GROUPS = 7
# The encoder pass holds, per patch, about one layer's MLP (≈ 4 × its width) and the residual
# stream (≈ 3 × its width): a measurement in vLLM, priced as a range of ½× to 2× this.
ENCODER_WIDTH_FACTOR = 7


@dataclass(frozen=True)
class EncoderProfile:
    """What the profile run encodes: the budget in tokens, the items and their output tokens."""

    budget_tokens: int
    items: int
    modality: str
    kept_tokens: int  # encoder output tokens held in the encoder cache during the profile


def limits_of(text: str | None) -> dict[str, dict[str, int]]:
    """The canonical ``--limit-mm-per-prompt`` JSON as {modality: {option: value}}."""
    if not text:
        return {}
    data = json.loads(text)
    return {str(k): dict(v) for k, v in data.items()}


def limit_for(text: str | None, modality: str) -> int:
    """The count allowed for ``modality`` (999 when the flag does not name it)."""
    entry = limits_of(text).get(modality)
    return DEFAULT_LIMIT if entry is None else int(entry.get("count", DEFAULT_LIMIT))


def tower_modalities(model: ModelSpec) -> tuple[str, ...]:
    """The modalities the model's encoder tower serves."""
    if model.vision is None:
        return ()
    if model.model_type in VIDEO_TOWER_MODEL_TYPES:
        return ("image", "video")
    return (model.vision.modality,)


def tower_loaded(model: ModelSpec, limits: str | None) -> bool:
    """Whether vLLM builds the tower: some modality it serves has a limit above 0."""
    return any(limit_for(limits, m) > 0 for m in tower_modalities(model))


def weights_view(model: ModelSpec, limits: str | None, encoder_tp_mode: str, tp: int) -> ModelSpec:
    """The model as the loader builds it: without an unused tower, or with a replicated one."""
    if model.vision is None:
        return model
    if not tower_loaded(model, limits):
        kept = tuple(g for g in model.params if g.name != "vision")
        # the checkpoint's byte count includes the tower: no longer a cross-check of the rest
        return dataclasses.replace(model, params=kept, vision=None, checkpoint_bytes_by_dtype={})
    if (
        encoder_tp_mode == "data"
        and tp > 1
        and model.model_type in ENCODER_DATA_PARALLEL_MODEL_TYPES
    ):
        params = tuple(_replicated(g) if g.name == "vision" else g for g in model.params)
        return dataclasses.replace(model, params=params)
    return model


def _replicated(group: ParamGroup) -> ParamGroup:
    return dataclasses.replace(group, sharding=ParamSharding.REPLICATED)


def encoder_profile(
    model: ModelSpec,
    limits: str | None,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    chunked_prefill: bool = True,
    skip_profiling: bool = False,
    video: bool = False,
) -> EncoderProfile | None:
    """The encoder batch the profile run encodes, or None when it encodes none. ``video``:
    the batch if the profile picks the video modality at its largest item (an upper bound)."""
    if model.vision is None or skip_profiling or not tower_loaded(model, limits):
        return None
    item = model.vision.max_tokens_per_item
    if item <= 0:
        return None
    # the image item's size stands in for a video item when only video is allowed
    modality = next(m for m in tower_modalities(model) if limit_for(limits, m) > 0)
    if video:
        if "video" not in tower_modalities(model) or limit_for(limits, "video") == 0:
            return None
        modality = "video"
        item *= max(1, min(max_model_len // item, VIDEO_FRAME_GROUPS))
    budget = max(max_num_batched_tokens, item)
    limit = limit_for(limits, modality)
    per_prompt = max(1, min(limit, max_model_len // item))
    seqs = max_num_seqs if chunked_prefill else min(max_num_seqs, max_num_batched_tokens // item)
    items = max(1, min(budget // item, seqs * per_prompt))
    return EncoderProfile(budget, items, modality, items * item)


def encoder_pass_bytes(model: ModelSpec, output_tokens: int, dtype_bytes: int) -> int:
    """The encoder pass's activations for a batch of ``output_tokens`` (an estimate)."""
    if model.vision is None or not model.vision.hidden_size:
        return 0
    patches = output_tokens * PATCHES_PER_TOKEN.get(model.model_type, 1)
    return patches * ENCODER_WIDTH_FACTOR * model.vision.hidden_size * dtype_bytes


def encoder_log_line(profile: EncoderProfile) -> str:
    """The line vLLM prints before encoding the dummy batch (gpu_model_runner.py)."""
    return (
        f"Encoder cache will be initialized with a budget of {profile.budget_tokens} tokens, "
        f"and profiled with {profile.items} {profile.modality} items of the maximum feature size."
    )


def has_size_options(limits: str | None) -> bool:
    """Whether the limits shrink a dummy item (width, height, frames, length)."""
    return any(len(opts) > 1 or "count" not in opts for opts in limits_of(limits).values())


def processor_cache_host_bytes(
    cache_gb: float | None, cache_type: str, api_servers: int = 1, data_parallel: int = 1
) -> int:
    """Host memory of the processor cache: an LRU copy per API-server and engine process
    (``mm_processor_cache_gb × (api_server_count + data_parallel_size)``), one ring with shm."""
    gb = DEFAULT_PROCESSOR_CACHE_GB if cache_gb is None else cache_gb
    copies = data_parallel if cache_type == "shm" else api_servers + data_parallel
    return int(gb * GIB) * copies
