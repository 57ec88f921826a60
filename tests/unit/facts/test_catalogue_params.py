"""Every catalogue entry (and every fixture config here) reads and matches its published size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.facts.catalogue import CatalogueEntry, find_entry, list_entries
from oomguard.facts.config_reader import spec_from_config
from oomguard.memory.spec import ModelSpec

DATA = Path(__file__).parent / "data"
TOLERANCE = 0.01


def _counts(spec: ModelSpec) -> tuple[int, int]:
    """Total parameters, and the total without MTP modules (published counts differ on that:
    DeepSeek-V3 is 671B main model or 685B with its MTP module)."""
    mtp = sum(g.count for g in spec.params if g.name == "mtp")
    return spec.total_params, spec.total_params - mtp


def _assert_close(name: str, spec: ModelSpec, published: int) -> None:
    total, main = _counts(spec)
    errors = [abs(n / published - 1) for n in {total, main}]
    assert min(errors) <= TOLERANCE, (
        f"{name}: computed {total:,} params ({main:,} without MTP) vs published {published:,} "
        f"({min(errors):.2%} off)"
    )


ENTRIES = list_entries()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_catalogue_entry_matches_published_params(entry: CatalogueEntry) -> None:
    spec = entry.spec()
    assert spec.num_layers > 0 and spec.layers
    assert entry.published_params, f"{entry.id}: no published_params recorded"
    _assert_close(entry.id, spec, entry.published_params)
    assert entry.config_source, f"{entry.id}: config_source missing"


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.id for e in ENTRIES])
def test_catalogue_entry_found_by_its_names(entry: CatalogueEntry) -> None:
    for name in entry.names:
        assert find_entry(name).id == entry.id or find_entry(name).id.lower() == name.lower()
        assert find_entry(name.upper()).id == find_entry(name).id


FIXTURES = sorted(DATA.glob("*.json"))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_fixture_config_matches_published_params(path: Path) -> None:
    config = json.loads(path.read_text())
    spec = spec_from_config(config, name=path.stem, source=str(path))
    _assert_close(path.stem, spec, int(config["_published_params"]))


def test_catalogue_is_not_empty() -> None:
    assert len(ENTRIES) >= 1
