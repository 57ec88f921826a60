"""Every catalogue entry (and every fixture config here) reads and matches its published size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.errors import MalformedConfig
from oomguard.facts.catalogue import (
    CatalogueEntry,
    ParamCheck,
    find_entry,
    list_entries,
    load_entry,
)
from oomguard.facts.config_reader import spec_from_config

DATA = Path(__file__).parent / "data"

ENTRIES = list_entries()


def _entry_id(entry: CatalogueEntry) -> str:
    """Test id that shows when an entry is checked against a rounded published figure."""
    if entry.published_params_rounding:
        return f"{entry.id} [published rounded to {entry.published_params_rounding:.0e}]"
    return entry.id


@pytest.mark.parametrize("entry", ENTRIES, ids=[_entry_id(e) for e in ENTRIES])
def test_catalogue_entry_matches_published_params(entry: CatalogueEntry) -> None:
    spec = entry.spec()
    assert spec.num_layers > 0 and spec.layers
    assert entry.published_params, f"{entry.id}: no published_params recorded"
    check = entry.check_params(spec)
    assert check.ok, check.describe()
    assert entry.config_source, f"{entry.id}: config_source missing"
    assert entry.published_params_source, f"{entry.id}: published_params_source missing"


# Entries whose computed count lies outside 1 % of the published figure and is accepted only
# because that figure is rounded. Kept explicit so a new one is a conscious decision.
ACCEPTED_ONLY_BY_ROUNDING: set[str] = {
    # 27.36B without the MTP layer (27.78B with it) against the card's rounded "27B"
    "Qwen/Qwen3.5-27B",
    "Qwen/Qwen3.6-27B",
    # 2.128B against a rounded 2.1B (1.3 %): the vision tower and the tied 151,936-row table
    "Qwen/Qwen3-VL-2B-Instruct",
}


def test_rounded_figures_are_declared_and_reported() -> None:
    """A figure that is a multiple of 1e6 is a rounded one (an exact count is that only by a
    one-in-a-million chance): it must say so, and those needing the half-unit are listed."""
    undeclared = [
        e.id
        for e in ENTRIES
        if e.published_params
        and e.published_params % 10**6 == 0
        and not e.published_params_rounding
    ]
    assert not undeclared, (
        f"rounded published figures without published_params_rounding: {undeclared}"
    )
    rounded = [e for e in ENTRIES if e.published_params_rounding]
    assert rounded  # most cards publish rounded figures
    needs = {e.id for e in rounded if e.check_params().needs_rounding_allowance}
    assert needs == ACCEPTED_ONLY_BY_ROUNDING, sorted(needs)


def test_rounding_allowance_is_half_the_last_digit() -> None:
    card_17b = ParamCheck("x/card-1.7B", computed=1_720_574_976, published=1_700_000_000)
    assert not card_17b.ok and "1.21%" in card_17b.describe()  # outside 1 %
    rounded = ParamCheck("x/card-1.7B", 1_720_574_976, 1_700_000_000, rounding=10**8)
    assert rounded.ok and rounded.needs_rounding_allowance and rounded.allowance == 5e7
    assert not ParamCheck("x/y", 1_750_000_001, 1_700_000_000, rounding=10**8).ok
    # for a precise figure the 1 % band is the larger allowance
    precise = ParamCheck("x/y", 7_680_000_000, 7_610_000_000, rounding=10**7)
    assert precise.allowance == pytest.approx(76_100_000) and precise.ok
    # "7B" has one significant digit: its half-unit (0.5B, 7 %) would check nothing
    one_digit = ParamCheck("x/y", 6_600_000_000, 7_000_000_000, rounding=10**9)
    assert one_digit.allowance == pytest.approx(70_000_000) and not one_digit.ok


def test_exact_count_with_stored_tied_head_matches_exactly() -> None:
    entry = find_entry("Qwen/Qwen3-1.7B")
    assert entry.published_params_includes_tied_lm_head and entry.published_params_rounding is None
    spec = entry.spec()
    assert spec.tie_word_embeddings and spec.total_params == 1_720_574_976
    assert entry.check_params(spec).computed == entry.published_params == 2_031_739_904


def _write_entry(tmp_path: Path, **extra: object) -> Path:
    data = {"id": "x/y", "config": {"model_type": "llama"}, **extra}
    path = tmp_path / "x__y.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"published_params": 1_700_000_000, "published_params_rounding": 3 * 10**7},
            "not a multiple",
        ),
        ({"published_params_rounding": 10**8}, "without published_params"),
        ({"published_params": 1_700_000_000, "published_params_rounding": -1}, "not a positive"),
        ({"published_params": "1.7B"}, "not a positive number"),
        ({"base_model": ["a/b"]}, "base_model is not a string"),
    ],
)
def test_loader_rejects_bad_count_fields(
    tmp_path: Path, extra: dict[str, object], message: str
) -> None:
    with pytest.raises(MalformedConfig, match=message):
        load_entry(_write_entry(tmp_path, **extra))


def test_loader_reads_observed_loading_with_its_source(tmp_path: Path) -> None:
    path = _write_entry(tmp_path, observed_loading_gib={"value": 8.58, "source": "https://x/log"})
    entry = load_entry(path)
    assert entry.observed_loading_gib == 8.58 and entry.observed_loading_source == "https://x/log"
    assert find_entry("google/gemma-3-4b-it").observed_loading_gib == 8.58


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
    check = ParamCheck(
        path.stem,
        spec.total_params,
        int(config["_published_params"]),
        config.get("_published_params_rounding"),
    )
    assert check.ok, check.describe()


def test_catalogue_is_not_empty() -> None:
    assert len(ENTRIES) >= 60
