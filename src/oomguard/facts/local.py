"""Model facts from local files: a model directory, a ``config.json``, safetensors headers.

Exact checkpoint bytes by dtype come from the safetensors headers (8-byte little-endian header
length, then a JSON header with each tensor's dtype and byte range) when the weight files are
present, else from ``model.safetensors.index.json`` ``metadata.total_size`` (key ``"ALL"``:
total bytes, dtype split unknown).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from oomguard.errors import MalformedConfig, UnknownModel
from oomguard.facts.config_reader import spec_from_config
from oomguard.memory.spec import ModelSpec
from oomguard.units import MIB

_MAX_HEADER_BYTES = 100 * MIB  # the safetensors format caps headers at 100 MB
INDEX_TOTAL_KEY = "ALL"


def read_json(path: Path) -> Any:
    """Parse a JSON file; :class:`MalformedConfig` names the path and the problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MalformedConfig(
            f"cannot read {path}: {exc.strerror or exc}", "check the path and permissions"
        ) from None
    except UnicodeDecodeError:
        raise MalformedConfig(
            f"{path} is not UTF-8 text", "point at the model's config.json"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise MalformedConfig(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            "repair the file or download it again",
        ) from None


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of one ``.safetensors`` file (tensor name → dtype, shape, data_offsets)."""
    try:
        with path.open("rb") as fh:
            raw_len = fh.read(8)
            if len(raw_len) != 8:
                raise MalformedConfig(
                    f"{path} is too short to be a safetensors file", "download it again"
                )
            (header_len,) = struct.unpack("<Q", raw_len)
            size = path.stat().st_size
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise MalformedConfig(
                    f"{path}: header length {header_len} does not fit the file ({size} bytes)",
                    "the file is truncated or not safetensors; download it again",
                )
            header_bytes = fh.read(header_len)
    except OSError as exc:
        raise MalformedConfig(
            f"cannot read {path}: {exc.strerror or exc}", "check the path and permissions"
        ) from None
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MalformedConfig(
            f"{path}: safetensors header is not valid JSON", "download the file again"
        ) from None
    if not isinstance(header, dict):
        raise MalformedConfig(
            f"{path}: safetensors header is not a JSON object", "download the file again"
        )
    return header


def bytes_by_dtype_from_header(header: dict[str, Any], path: Path) -> dict[str, int]:
    """Sum tensor byte ranges per dtype for one safetensors header."""
    out: dict[str, int] = {}
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise MalformedConfig(
                f"{path}: tensor {tensor!r} has no valid dtype/data_offsets",
                "download the file again",
            ) from None
        if end < start:
            raise MalformedConfig(
                f"{path}: tensor {tensor!r} has a negative byte range", "download the file again"
            )
        out[dtype] = out.get(dtype, 0) + (end - start)
    return out


def checkpoint_bytes_by_dtype(directory: Path) -> dict[str, int]:
    """Exact bytes by safetensors dtype for a model directory ({} when nothing is known)."""
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        total: dict[str, int] = {}
        for shard in shards:
            for dtype, n in bytes_by_dtype_from_header(
                read_safetensors_header(shard), shard
            ).items():
                total[dtype] = total.get(dtype, 0) + n
        return total
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index)
        size = data.get("metadata", {}).get("total_size") if isinstance(data, dict) else None
        if not isinstance(size, (int, float)):
            raise MalformedConfig(
                f"{index} has no metadata.total_size", "download the index file again"
            )
        return {INDEX_TOTAL_KEY: int(size)}
    return {}


def spec_from_local(path: str | Path) -> ModelSpec:
    """ModelSpec from a local model directory, a ``config.json`` file, or a ``.gguf`` file.

    Raises :class:`UnknownModel` when the path does not exist and :class:`MalformedConfig` when a
    file in it cannot be read.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise UnknownModel(
            f"no such file or directory: {p}",
            "check the path to the model directory or config.json",
        )
    if p.is_file() and p.suffix.lower() == ".gguf":
        from oomguard.facts.gguf import spec_from_gguf

        return spec_from_gguf(p)
    if p.is_dir():
        config_path = p / "config.json"
        if not config_path.is_file():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                from oomguard.facts.gguf import spec_from_gguf

                return spec_from_gguf(ggufs[0])
            raise MalformedConfig(
                f"{p} has no config.json",
                "point at a Hugging Face model directory or its config.json",
            )
        directory = p
    else:
        config_path, directory = p, p.parent
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise MalformedConfig(
            f"{config_path} is not a JSON object", "point at the model's config.json"
        )
    name = directory.name if config_path.name == "config.json" else config_path.stem
    return spec_from_config(
        config,
        name=name,
        source=str(config_path),
        param_bytes_by_dtype=checkpoint_bytes_by_dtype(directory),
    )
