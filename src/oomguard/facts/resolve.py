"""One entry point from a user's model reference to a :class:`ModelSpec`.

Order: an existing local path (directory, ``config.json``, ``.gguf``) → the built-in catalogue
(including quantized repo names whose base model is catalogued) → the Hugging Face hub.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from oomguard.errors import UnknownModel
from oomguard.facts.catalogue import LOCAL_MODEL_HINT, closest_names, lookup_entry
from oomguard.facts.hub import spec_from_hub
from oomguard.facts.local import spec_from_local
from oomguard.facts.quant import apply_quantization_flag, quant_from_name, strip_quant_suffix
from oomguard.memory.spec import ModelSpec


def _looks_like_path(ref: str) -> bool:
    return (
        ref.startswith(("/", "./", "../", "~"))
        or ref.endswith((".json", ".gguf"))
        or ref.count("/") > 1
    )


def resolve_model(ref: str, *, allow_hub: bool = True) -> ModelSpec:
    """ModelSpec for a local path, a catalogue name/alias, or a hub repo id.

    A quantized repo name (``…-AWQ``, ``…-FP8-dynamic``) not in the catalogue resolves to its
    catalogued base model with the format taken from the name. Raises :class:`UnknownModel`
    (listing close catalogue names and the local alternatives) when nothing matches.
    """
    ref = ref.strip()
    if not ref:
        raise UnknownModel(
            "empty model name", "pass a catalogue name, a hub repo id or a local path"
        )
    path = Path(ref).expanduser()
    if path.exists():
        return spec_from_local(path)
    if _looks_like_path(ref):
        raise UnknownModel(
            f"no such file or directory: {path}",
            "check the path to the model directory or config.json",
        )

    entry = lookup_entry(ref)
    if entry is not None:
        return entry.spec()
    quant = quant_from_name(ref)
    if quant is not None:
        base_entry = lookup_entry(strip_quant_suffix(ref))
        if base_entry is not None:
            base = base_entry.spec()
            return dataclasses.replace(
                base, name=ref, quant=quant, checkpoint_bytes_by_dtype={},
                source=f"{base.source}; weight format {quant.method} from the name {ref!r}",
            )  # fmt: skip
    if allow_hub:
        return spec_from_hub(ref)
    close = closest_names(ref)
    near = f"; closest catalogue names: {', '.join(close)}" if close else ""
    raise UnknownModel(
        f"model {ref!r} is not in the built-in catalogue{near}",
        f"{LOCAL_MODEL_HINT}, or allow hub access (drop --offline / HF_HUB_OFFLINE)",
    )


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
