"""One entry point from a user's model reference to a :class:`ModelSpec`.

Order: an existing local path (directory, ``config.json``, ``.gguf``) → the built-in catalogue
(including quantized repo names whose base model is catalogued) → the Hugging Face hub.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from oomguard.errors import OomguardError, UnknownModel
from oomguard.facts.catalogue import LOCAL_MODEL_HINT, closest_names, lookup_alias, lookup_entry
from oomguard.facts.hub import spec_from_hub
from oomguard.facts.local import spec_from_local
from oomguard.facts.quant import apply_quantization_flag, quant_from_name, strip_quant_suffix
from oomguard.memory.spec import ModelSpec

if TYPE_CHECKING:
    from oomguard.memory.engine import EngineSettings


def looks_like_path(ref: str) -> bool:
    return (
        ref.startswith(("/", "./", "../", "~"))
        or ref.endswith((".json", ".gguf"))
        or ref.count("/") > 1
    )


def resolve_model(ref: str, *, allow_hub: bool = True) -> ModelSpec:
    """ModelSpec for a local path, a catalogue name or alias, or a hub repo id.

    Order: a local path; the catalogue (names and aliases: re-releases resolve to their base
    config with their own positions); a quantized repo name (``…-AWQ``, ``…-FP8``) whose base
    is catalogued, with the format from the name; the hub; last, a catalogued sibling
    (``-Instruct`` ↔ base, ``-it`` ↔ ``-pt``…) whose config stands in, with a caveat shown in
    the plan. Raises :class:`UnknownModel` (listing close catalogue names and the local
    alternatives) when nothing matches.
    """
    ref = ref.strip()
    if not ref:
        raise UnknownModel(
            "empty model name", "pass a catalogue name, a hub repo id or a local path"
        )
    path = Path(ref).expanduser()
    if path.exists():
        return spec_from_local(path)
    if looks_like_path(ref):
        raise UnknownModel(
            f"no such file or directory: {path}",
            "check the path to the model directory or config.json",
        )
    found = _catalogued(ref) or _quantized(ref, _catalogued)
    if found is not None:
        return found
    if allow_hub:
        try:
            return spec_from_hub(ref)
        except UnknownModel:
            found = _sibling(ref) or _quantized(ref, _sibling)
            if found is None:
                raise
            return found
    found = _sibling(ref) or _quantized(ref, _sibling)
    if found is not None:
        return found
    close = closest_names(ref)
    near = f"; closest catalogue names: {', '.join(close)}" if close else ""
    raise UnknownModel(
        f"model {ref!r} is not in the built-in catalogue{near}",
        f"{LOCAL_MODEL_HINT}, or allow hub access (drop --offline / HF_HUB_OFFLINE)",
    )


def _catalogued(ref: str) -> ModelSpec | None:
    """The catalogue entry or alias named ``ref``."""
    entry = lookup_entry(ref)
    if entry is not None:
        return entry.spec()
    alias = lookup_alias(ref)
    return alias.spec() if alias is not None else None


def _quantized(ref: str, find: Callable[[str], ModelSpec | None]) -> ModelSpec | None:
    """A quantized repo name resolved through ``find`` on its base name, format from the name."""
    quant = quant_from_name(ref)
    if quant is None:
        return None
    base = find(strip_quant_suffix(ref))
    if base is None:
        return None
    return dataclasses.replace(
        base,
        name=ref,
        quant=quant,
        checkpoint_bytes_by_dtype={},
        source=f"{base.source}; weight format {quant.method} from the name {ref!r}",
        caveats=(
            *base.caveats,
            f"{ref} is not catalogued: {base.name}'s config with the "
            f"{quant.method} weight format its name states",
        ),
    )


# release suffixes of the same architecture: a base model and its instruction-tuned,
# chat, thinking or converted (-hf) releases differ in weights, not in shape
_SIBLING_SUFFIXES = ("-Instruct-hf", "-chat-hf", "-Instruct", "-Base", "-Chat", "-Thinking",
                     "-it", "-pt", "-hf")  # fmt: skip


def sibling_names(ref: str) -> list[str]:
    """Names of ``ref``'s releases with another of the sibling suffixes (itself excluded)."""
    org, _, name = ref.rpartition("/")
    core = name
    for suffix in _SIBLING_SUFFIXES:
        if name.lower().endswith(suffix.lower()):
            core = name[: -len(suffix)]
            break
    prefix = f"{org}/" if org else ""
    names = [prefix + core + s for s in ("", *_SIBLING_SUFFIXES)]
    return [n for n in names if n.lower() != ref.lower()]


def _sibling(ref: str) -> ModelSpec | None:
    """A catalogued sibling release's spec under ``ref``'s name, with the caveat to show."""
    for name in sibling_names(ref):
        spec = _catalogued(name)
        if spec is None:
            continue
        caveat = (
            f"{ref} is not catalogued: planned with the config of its sibling release "
            f"{spec.name} (same architecture; check max_position_embeddings and vocab_size in "
            f"the repo's own config.json, or pass its path)"
        )
        return dataclasses.replace(
            spec,
            name=ref,
            source=f"{spec.source}; sibling of {ref}",
            caveats=(*spec.caveats, caveat),
        )
    return None


def serve_reference(ref: str) -> str:
    """What goes after ``vllm serve`` for the model the user named as ``ref``.

    vLLM loads a model from its directory (or a ``.gguf`` file), never from a ``config.json``:
    a path to a config file becomes its directory. Names and other paths are kept as given.
    """
    text = ref.strip()
    path = Path(text).expanduser()
    if path.suffix.lower() == ".json" and path.is_file():
        parent = str(path.parent)
        return parent if text.startswith(("/", "~")) or parent != "." else "./"
    return text


def resolve_model_with_quantization(
    ref: str, quantization: str | None = None, *, allow_hub: bool = True
) -> ModelSpec:
    """Like :func:`resolve_model`, then applies vLLM's ``--quantization`` flag.

    The checkpoint's own format (``quantization_config`` or repo name) wins; a flag that agrees
    is accepted, ``fp8``/``bitsandbytes`` on an unquantized checkpoint mean online
    quantization, and a contradicting flag raises :class:`BadInput` as vLLM would.
    """
    spec = resolve_model(ref, allow_hub=allow_hub)
    quant = apply_quantization_flag(spec.quant, quantization)
    return spec if quant == spec.quant else dataclasses.replace(spec, quant=quant)


def attach_drafter(settings: EngineSettings, *, allow_hub: bool = False) -> EngineSettings:
    """``settings`` with the drafter's facts in its ``speculative_config`` when they can be
    read (catalogue, local directory, or the hub when allowed); unchanged otherwise, and the
    memory model then prices the drafter from the target with a wider range."""
    cfg = settings.speculative_config
    if cfg is None or cfg.model is None or cfg.draft is not None:
        return settings
    if cfg.method in ("mtp", "ngram", "ngram_gpu", "suffix", "custom_class"):
        return settings  # the target's own layers, or no weights at all
    try:
        draft = resolve_model(cfg.model, allow_hub=allow_hub)
    except OomguardError:
        return settings
    return dataclasses.replace(settings, speculative_config=dataclasses.replace(cfg, draft=draft))
