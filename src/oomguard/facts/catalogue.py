"""The built-in model catalogue: one JSON file per model under ``catalogue/models/``.

Each file holds the model's own ``config.json`` (key ``config``) plus provenance and the
published parameter count; it is read through the same :func:`spec_from_config` as a user's
local files, so the catalogue exercises the reader rather than bypassing it.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from oomguard.errors import MalformedConfig, UnknownModel
from oomguard.facts.config_reader import spec_from_config
from oomguard.memory.spec import ModelSpec

CATALOGUE_DIR = Path(__file__).parent / "catalogue" / "models"
_REQUIRED_KEYS = ("id", "config")


@dataclass(frozen=True)
class CatalogueEntry:
    """One catalogue file: the config plus where it and its parameter count come from."""

    id: str
    config: dict[str, Any] = field(hash=False, compare=False)
    path: Path
    aliases: tuple[str, ...] = ()
    config_source: str = ""
    second_source: str = ""
    published_params: int | None = None
    published_params_source: str = ""
    param_bytes_by_dtype: dict[str, int] = field(default_factory=dict, hash=False, compare=False)
    param_bytes_source: str = ""
    observed_loading_gib: float | None = None
    notes: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)

    def spec(self) -> ModelSpec:
        """The entry's ModelSpec, read through the same path as a local config.json."""
        return spec_from_config(
            self.config,
            name=self.id,
            source=f"catalogue {self.path.name} (config: {self.config_source or 'unrecorded'})",
            param_bytes_by_dtype=self.param_bytes_by_dtype or None,
        )


def load_entry(path: Path) -> CatalogueEntry:
    """Read one catalogue JSON file; :class:`MalformedConfig` names the file and the problem."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise MalformedConfig(
            f"cannot read catalogue file {path}: {exc}", "reinstall oomguard"
        ) from None
    except json.JSONDecodeError as exc:
        raise MalformedConfig(
            f"catalogue file {path} is not valid JSON (line {exc.lineno}: {exc.msg})",
            "fix or remove the file",
        ) from None
    if not isinstance(data, dict):
        raise MalformedConfig(
            f"catalogue file {path} is not a JSON object", "fix or remove the file"
        )
    missing = [k for k in _REQUIRED_KEYS if k not in data]
    if missing or not isinstance(data.get("config"), dict):
        raise MalformedConfig(
            f"catalogue file {path} lacks {', '.join(missing) or 'a config object'}",
            "fix or remove the file",
        )
    published = data.get("published_params")
    observed = data.get("observed_loading_gib")
    return CatalogueEntry(
        id=str(data["id"]),
        config=data["config"],
        path=path,
        aliases=tuple(str(a) for a in data.get("aliases") or ()),
        config_source=str(data.get("config_source") or ""),
        second_source=str(data.get("second_source") or ""),
        published_params=int(published) if isinstance(published, (int, float)) else None,
        published_params_source=str(data.get("published_params_source") or ""),
        param_bytes_by_dtype={
            str(k): int(v) for k, v in (data.get("param_bytes_by_dtype") or {}).items()
        },
        param_bytes_source=str(data.get("param_bytes_source") or ""),
        observed_loading_gib=float(observed) if isinstance(observed, (int, float)) else None,
        notes=str(data.get("notes") or ""),
    )


@lru_cache(maxsize=4)
def _load_all(directory: Path) -> tuple[CatalogueEntry, ...]:
    if not directory.is_dir():
        return ()
    return tuple(load_entry(p) for p in sorted(directory.glob("*.json")))


def list_entries(directory: Path | None = None) -> list[CatalogueEntry]:
    """Every catalogue entry, sorted by file name (cached per directory)."""
    return list(_load_all(directory or CATALOGUE_DIR))


def _norm(name: str) -> str:
    return name.strip().strip("/").lower()


def _short(name: str) -> str:
    return _norm(name).rsplit("/", 1)[-1]


def lookup_entry(name: str, directory: Path | None = None) -> CatalogueEntry | None:
    """The entry whose id or alias matches ``name`` (case-insensitive, org prefix optional), or None.

    A full ``org/name`` must match a full id/alias; a bare name matches the part after the
    org. When a bare name matches several entries the id that equals it wins, else the first
    by file order.
    """
    entries = list_entries(directory)
    wanted = _norm(name)
    if not wanted:
        return None
    for entry in entries:
        if any(_norm(n) == wanted for n in entry.names):
            return entry
    if "/" in wanted:
        wanted = wanted.rsplit("/", 1)[-1]  # another org's copy of the same model name
    for entry in entries:
        if any(_short(n) == wanted for n in entry.names):
            return entry
    return None


def closest_names(name: str, directory: Path | None = None, n: int = 5) -> list[str]:
    """Catalogue ids closest to ``name`` (difflib), best first."""
    entries = list_entries(directory)
    by_short: dict[str, str] = {}
    for entry in entries:
        for alias in entry.names:
            by_short.setdefault(_short(alias), entry.id)
            by_short.setdefault(_norm(alias), entry.id)
    hits = difflib.get_close_matches(_norm(name), list(by_short), n=n * 3, cutoff=0.5)
    hits += difflib.get_close_matches(_short(name), list(by_short), n=n * 3, cutoff=0.5)
    out: list[str] = []
    for hit in hits:
        ident = by_short[hit]
        if ident not in out:
            out.append(ident)
    return out[:n]


def find_entry(name: str, directory: Path | None = None) -> CatalogueEntry:
    """The catalogue entry for ``name``; :class:`UnknownModel` lists close names and alternatives."""
    entry = lookup_entry(name, directory)
    if entry is not None:
        return entry
    close = closest_names(name, directory)
    near = f"; closest catalogue names: {', '.join(close)}" if close else ""
    raise UnknownModel(
        f"model {name!r} is not in the built-in catalogue{near}",
        "pass a local model directory or config.json (--model /path/to/dir), a .gguf file, "
        "or a Hugging Face repo id with network access",
    )
