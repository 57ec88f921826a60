"""The built-in model catalogue: one JSON file per model under ``catalogue/models/``.

Each file holds the model's own ``config.json`` (key ``config``) plus provenance and the
published parameter count; it is read through the same :func:`spec_from_config` as a user's
local files, so the catalogue exercises the reader rather than bypassing it.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from oomguard.errors import MalformedConfig, UnknownModel
from oomguard.facts.config_reader import spec_from_config
from oomguard.memory.spec import ModelSpec, QuantSpec

CATALOGUE_DIR = Path(__file__).parent / "catalogue" / "models"
# what to do instead of naming an unknown model (every face takes the model the same way)
LOCAL_MODEL_HINT = (
    "give the path of the model's local directory, its config.json or a .gguf file "
    "in place of the name"
)
_REQUIRED_KEYS = ("id", "config")


PARAM_TOLERANCE = 0.01  # computed vs published parameter count, relative


@dataclass(frozen=True)
class ParamCheck:
    """A computed parameter count against a published one.

    Accepted when ``|computed - published| <= allowance``, where the allowance is the larger of
    1 % of the published count and, for a figure published rounded (``rounding`` = the unit of
    its last digit, 1e8 for "1.7B"), half that unit: the exact count may lie anywhere the
    rounding maps to the figure. A figure with a single significant digit ("7B") is too coarse
    for its half-unit to check anything, so only the 1 % band applies to it.
    """

    entry_id: str
    computed: int
    published: int
    rounding: int | None = None
    # a wider relative band, for an entry whose own file explains why (a tower whose size is
    # known only from its name): ``published_params_tolerance``
    tolerance: float = PARAM_TOLERANCE

    @property
    def allowance(self) -> float:
        """Largest accepted absolute difference, in parameters."""
        coarse = self.rounding is not None and self.rounding * 10 > self.published
        half_unit = self.rounding / 2 if self.rounding and not coarse else 0.0
        return max(self.tolerance * self.published, half_unit)

    @property
    def error(self) -> float:
        """Relative difference ``computed / published - 1``."""
        return self.computed / self.published - 1

    @property
    def ok(self) -> bool:
        """True when the difference is within :attr:`allowance`."""
        return abs(self.computed - self.published) <= self.allowance

    @property
    def needs_rounding_allowance(self) -> bool:
        """True when only the rounding half-unit (not the 1 % band) accepts the count."""
        return self.ok and abs(self.error) > self.tolerance

    def describe(self) -> str:
        """One line: computed vs published, the difference, and the allowance used."""
        rounded = f", published rounded to {self.rounding:.0e}" if self.rounding else ""
        return (
            f"{self.entry_id}: computed {self.computed:,} vs published {self.published:,} "
            f"({self.error:+.2%}; allowed ±{self.allowance:,.0f}{rounded})"
        )


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
    observed_loading_source: str = ""
    notes: str = ""
    published_params_rounding: int | None = None
    published_params_includes_tied_lm_head: bool = False
    published_params_tolerance: float = PARAM_TOLERANCE
    base_model: str = ""

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

    def check_params(self, spec: ModelSpec | None = None) -> ParamCheck:
        """Compare the computed parameter count with the published one (see :class:`ParamCheck`).

        The computed count is taken with and without MTP modules (published totals differ on
        that: DeepSeek-V3 is 671B main model, 685B with its MTP module) and, when the entry
        says the published figure counts the checkpoint's stored copy of a tied LM head, with
        that copy added. Raises :class:`MalformedConfig` when no published count is recorded.
        """
        if not self.published_params:
            raise MalformedConfig(
                f"catalogue entry {self.id} records no published_params",
                f"add published_params to {self.path.name}",
            )
        spec = spec or self.spec()
        # weights vLLM allocates beyond the checkpoint (Gemma 4's V copy) are not published
        total = spec.total_params - sum(g.count for g in spec.params if g.name == "runtime_copy")
        mtp = sum(g.count for g in spec.params if g.name == "mtp")
        extra = 0
        if self.published_params_includes_tied_lm_head and spec.tie_word_embeddings:
            extra = spec.vocab_size * spec.hidden_size
        candidates = {total + extra, total - mtp + extra}
        computed = min(candidates, key=lambda n: abs(n - self.published_params))  # type: ignore[operator]
        return ParamCheck(
            entry_id=self.id,
            computed=computed,
            published=self.published_params,
            rounding=self.published_params_rounding,
            tolerance=self.published_params_tolerance,
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
    published, rounding = _published_params(data, path)
    observed = data.get("observed_loading_gib")
    observed_source = ""
    if isinstance(observed, dict):
        observed_source = str(observed.get("source") or "")
        observed = observed.get("value")
    base_model = data.get("base_model") or ""
    if not isinstance(base_model, str):
        raise MalformedConfig(
            f"catalogue file {path}: base_model is not a string",
            "set base_model to the base repo id, e.g. meta-llama/Llama-3.1-8B",
        )
    return CatalogueEntry(
        id=str(data["id"]),
        config=data["config"],
        path=path,
        aliases=tuple(str(a) for a in data.get("aliases") or ()),
        config_source=str(data.get("config_source") or ""),
        second_source=str(data.get("second_source") or ""),
        published_params=published,
        published_params_source=str(data.get("published_params_source") or ""),
        param_bytes_by_dtype={
            str(k): int(v) for k, v in (data.get("param_bytes_by_dtype") or {}).items()
        },
        param_bytes_source=str(data.get("param_bytes_source") or ""),
        observed_loading_gib=float(observed) if isinstance(observed, (int, float)) else None,
        observed_loading_source=observed_source,
        notes=str(data.get("notes") or ""),
        published_params_rounding=rounding,
        published_params_includes_tied_lm_head=bool(
            data.get("published_params_includes_tied_lm_head", False)
        ),
        base_model=base_model,
        published_params_tolerance=_tolerance(data, path),
    )


def _tolerance(data: dict[str, Any], path: Path) -> float:
    """``published_params_tolerance`` (relative), at least the default 1 %, at most 5 %."""
    value = data.get("published_params_tolerance", PARAM_TOLERANCE)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (PARAM_TOLERANCE <= value <= 0.05)
    ):
        raise MalformedConfig(
            f"catalogue file {path}: published_params_tolerance is {value!r}, "
            "not between 0.01 and 0.05",
            f"fix it in {path.name}",
        )
    return float(value)


def _published_params(data: dict[str, Any], path: Path) -> tuple[int | None, int | None]:
    """``published_params`` and ``published_params_rounding``, validated together."""
    fix = f"fix published_params / published_params_rounding in {path.name}"
    published = data.get("published_params")
    if published is not None and (
        not isinstance(published, (int, float)) or isinstance(published, bool) or published <= 0
    ):
        raise MalformedConfig(
            f"catalogue file {path}: published_params is {published!r}, not a positive number", fix
        )
    rounding = data.get("published_params_rounding")
    if rounding is None:
        return (int(published) if published is not None else None), None
    if not isinstance(rounding, (int, float)) or isinstance(rounding, bool) or rounding <= 0:
        raise MalformedConfig(
            f"catalogue file {path}: published_params_rounding is {rounding!r}, "
            "not a positive number",
            fix,
        )
    if published is None:
        raise MalformedConfig(
            f"catalogue file {path}: published_params_rounding without published_params", fix
        )
    if int(published) % int(rounding):
        raise MalformedConfig(
            f"catalogue file {path}: published_params {int(published):,} is not "
            f"a multiple of its rounding {int(rounding):,}",
            fix,
        )
    return int(published), int(rounding)


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
    """The entry whose id or alias matches ``name`` (case-insensitive, org prefix optional), or
    None.

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


ALIASES_PATH = Path(__file__).parent / "catalogue" / "aliases.json"


@dataclass(frozen=True)
class AliasEntry:
    """A re-release or fine-tune served with a catalogued model's architecture."""

    id: str
    base: str
    overrides: dict[str, Any] = field(hash=False, compare=False)
    source: str = ""

    def config(self, base: CatalogueEntry) -> dict[str, Any]:
        """The base entry's config with the overrides put where the base keeps each key
        (the text config of a multimodal model, else the top level)."""
        config = copy.deepcopy(base.config)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else None
        for key, value in self.overrides.items():
            target = text if text is not None and key in text else config
            target[key] = value
        return config

    def spec(self, directory: Path | None = None) -> ModelSpec:
        """The ModelSpec: the base's config with the overrides, named and sourced as the alias."""
        base = find_entry(self.base, directory)
        changed = ", ".join(f"{k} {v}" for k, v in self.overrides.items())
        return spec_from_config(
            self.config(base),
            name=self.id,
            source=f"alias of catalogue {base.id} ({changed}; {self.source})",
            param_bytes_by_dtype=base.param_bytes_by_dtype or None,
        )


@lru_cache(maxsize=4)
def _load_aliases(path: Path) -> tuple[AliasEntry, ...]:
    if not path.is_file():
        return ()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        rows = data["aliases"]
        return tuple(
            AliasEntry(
                id=str(r["id"]),
                base=str(r["base"]),
                overrides=dict(r.get("overrides") or {}),
                source=str(r.get("source") or ""),
            )
            for r in rows
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise MalformedConfig(
            f"catalogue alias file {path} is malformed ({exc})",
            "fix the file or reinstall oomguard",
        ) from None


def list_aliases(path: Path | None = None) -> list[AliasEntry]:
    """Every alias of the catalogue (cached)."""
    return list(_load_aliases(path or ALIASES_PATH))


def lookup_alias(name: str, path: Path | None = None) -> AliasEntry | None:
    """The alias whose id matches ``name`` (case-insensitive; another org's copy matches by
    the part after the org), or None."""
    wanted = _norm(name)
    aliases = list_aliases(path)
    for alias in aliases:
        if _norm(alias.id) == wanted:
            return alias
    short = wanted.rsplit("/", 1)[-1]
    return next((a for a in aliases if _short(a.id) == short), None)


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


def known_quantized_variants(
    base_id: str, directory: Path | None = None
) -> list[tuple[str, QuantSpec]]:
    """Catalogued quantized checkpoints of ``base_id``: ``(repo id, weight format)``, fewest bits
    first.

    Built from entries that declare ``base_model`` and whose config (or name) says the format.
    ``base_id`` may be any name or alias of a catalogued base, case-insensitive; a base that is
    not catalogued itself (a fine-tune) matches on its exact id. Empty when none is known.
    """
    base = lookup_entry(base_id, directory)
    wanted = {_norm(n) for n in base.names} if base is not None else {_norm(base_id)}
    out: list[tuple[str, QuantSpec]] = []
    for entry in list_entries(directory):
        if not entry.base_model:
            continue
        named = lookup_entry(entry.base_model, directory)
        names = {_norm(n) for n in named.names} if named is not None else {_norm(entry.base_model)}
        if not names & wanted:
            continue
        quant = entry.spec().quant
        if quant.method is not None:
            out.append((entry.id, quant))
    return sorted(out, key=lambda item: (item[1].weight_bits, item[0].lower()))


def find_entry(name: str, directory: Path | None = None) -> CatalogueEntry:
    """The catalogue entry for ``name``; :class:`UnknownModel` lists close names and
    alternatives."""
    entry = lookup_entry(name, directory)
    if entry is not None:
        return entry
    close = closest_names(name, directory)
    near = f"; closest catalogue names: {', '.join(close)}" if close else ""
    raise UnknownModel(
        f"model {name!r} is not in the built-in catalogue{near}",
        f"{LOCAL_MODEL_HINT}, or a Hugging Face repo id with network access",
    )
