"""The bands of the estimated terms: split conformal over sources, groups by mechanism, and the
way the memory model uses them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from oomguard.memory.activation import DEFAULT_COEFFICIENTS, activation_peak, non_torch
from oomguard.memory.bands import (
    ACTIVATION_GROUPS,
    GRAPH_GROUPS,
    MIN_GROUP_RESIDUALS,
    NON_TORCH_GROUPS,
    SHIPPED_BANDS,
    TERMS,
    WEIGHTS_GROUPS,
    ZERO_BANDS,
    Band,
    Residual,
    activation_group,
    band_from,
    bands_for_term,
    conformal_level,
    derive_bands,
    in_pool,
    non_torch_group,
    parents,
    source_weights,
    weighted_quantile,
    weights_group,
)
from oomguard.memory.engine import EngineSettings, predict
from oomguard.memory.spec import GPUSpec
from oomguard.memory.versions import resolve_era

from .builders import llama_3_1_8b

GIB = 2**30
H100 = GPUSpec(
    "H100 SXM",
    int(79.19 * GIB),
    80,
    compute_capability="9.0",
    device_name="NVIDIA H100 80GB HBM3",
    nvls=True,
)


def test_every_source_weighs_the_same_however_many_logs_it_gave() -> None:
    assert source_weights(["a", "a", "a", "b"]) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 1.0])
    # one source with three small errors and two with large ones: the median source is large
    values, sources = [0.1, 0.1, 0.1, 5.0, 6.0], ["a", "a", "a", "b", "c"]
    assert weighted_quantile(values, source_weights(sources), 0.5) == 5.0
    assert weighted_quantile(values, [1.0] * 5, 0.5) == 0.1  # per log it would be small


def test_conformal_level_needs_ten_sources_before_it_drops_below_the_maximum() -> None:
    assert conformal_level(0.9, 9) == 1.0
    assert conformal_level(0.9, 10) == pytest.approx(0.99)
    assert conformal_level(0.9, 100) == pytest.approx(0.909)
    # at level 1 the band is the largest error seen
    assert weighted_quantile([0.1, 0.4, 0.2], [1, 1, 1], 1.0) == 0.4


def test_band_is_symmetric_and_holds_the_largest_error_of_few_sources() -> None:
    residuals = [Residual("g", "a", 0.02), Residual("g", "a", 0.03), Residual("g", "b", -0.08)]
    band = band_from(residuals)
    assert band.half_width == pytest.approx(0.08)  # two sources: the largest error, either side
    assert (band.residuals, band.sources) == (3, 2)
    assert band.around(1.0) == pytest.approx((0.92, 1.08))
    assert band.around(0.05) == pytest.approx((0.0, 0.13))  # never below zero
    assert band.around_relative(2.0, 3.0) == pytest.approx((2.0 * 0.92, 3.0 * 1.08))


def test_with_many_sources_the_largest_errors_fall_outside() -> None:
    residuals = [Residual("g", f"s{i}", 0.01 * (i + 1)) for i in range(40)]
    band = band_from(residuals)
    # the 90 % level with the (1 + 1/40) correction: the 37th of 40 errors
    assert band.half_width == pytest.approx(0.37)
    inside = sum(abs(r.value) <= band.half_width for r in residuals)
    assert inside / len(residuals) >= 0.9


def test_sparse_groups_take_their_parents_residuals() -> None:
    residuals = [
        Residual("v1-triton", "a", 0.01),  # one log of the Triton era: too few
        Residual("v1-sort", "b", 0.05),
        Residual("v1-sort", "c", -0.02),
        Residual("v0", "d", 0.5),
        Residual("v0", "e", -0.4),
        Residual("v0", "f", 0.3),
    ]
    bands = bands_for_term("activation", ACTIVATION_GROUPS, residuals)
    assert MIN_GROUP_RESIDUALS == 3
    assert bands["v1-triton"].pooled_from == "v1"  # the V1 eras together: 3 residuals
    assert bands["v1-triton"].half_width == pytest.approx(0.05)
    assert bands["v1-sort"].pooled_from == "v1"
    assert bands["v0"].pooled_from == ""  # its own three
    assert bands["v0"].half_width == pytest.approx(0.5)
    # multimodal groups never borrow text-only residuals before "all"
    assert bands["v1-triton/mm"].pooled_from == "all"
    assert bands["v1-triton/mm"].half_width == pytest.approx(0.5)


def test_pools_follow_the_mechanisms() -> None:
    assert parents("activation", "v1-sort") == ["v1", "text", "all"]
    assert parents("activation", "v0/mm") == ["mm", "all"]
    assert parents("non_torch", "late/tp") == ["v1+late/tp", "all/tp", "all"]
    assert parents("non_torch", "v0/one") == ["all/one", "all"]
    assert in_pool("non_torch", "v1+late/tp", "v1/tp")
    assert not in_pool("non_torch", "v1+late/tp", "v0/tp")  # V0's snapshot precedes NCCL's set-up
    assert not in_pool("non_torch", "all/tp", "late/one")
    assert in_pool("activation", "text", "v0") and not in_pool("activation", "text", "v0/mm")
    assert activation_group("v1", "triton", True) == "v1-triton/mm"
    assert activation_group("v0", "sort") == "v0"
    assert non_torch_group("late", 4) == "late/tp"
    assert weights_group(quantized=True, multimodal=False) == "quantized"


def test_a_term_nothing_has_shown_may_lie_anywhere_up_to_twice_its_estimate() -> None:
    bands = bands_for_term("graph", GRAPH_GROUPS, [])
    assert bands["one"].unobserved and bands["tp"].unobserved
    assert bands["one"].around(0.8) == (0.0, 1.6)


def test_derive_bands_fills_every_group_of_every_term() -> None:
    logged = {"activation": "v0", "non_torch": "v0/one", "graph": "one", "weights": "dense"}
    residuals = {term: [Residual(logged[term], s, 0.1) for s in "abc"] for term in TERMS}
    bands = derive_bands(residuals)  # groups nobody logged fall back to "all"
    for table, groups in (
        (bands.activation, ACTIVATION_GROUPS),
        (bands.non_torch_gib, NON_TORCH_GROUPS),
        (bands.graph_gib, GRAPH_GROUPS),
        (bands.weights, WEIGHTS_GROUPS),
    ):
        assert set(table) == set(groups)
        assert all(b.half_width == pytest.approx(0.1) for b in table.values())


def test_the_shipped_table_covers_every_group_and_records_its_evidence() -> None:
    for term, groups in zip(
        TERMS, (ACTIVATION_GROUPS, NON_TORCH_GROUPS, GRAPH_GROUPS, WEIGHTS_GROUPS), strict=True
    ):
        table = SHIPPED_BANDS.table(term)
        assert set(table) == set(groups)
        for band in table.values():
            assert band.half_width >= 0
            assert band.unobserved or band.residuals >= MIN_GROUP_RESIDUALS


def test_the_model_takes_its_bands_from_the_coefficients() -> None:
    model, era = llama_3_1_8b(), resolve_era("0.19")
    kw = dict(era=era, max_num_batched_tokens=8192, max_num_seqs=1024, tp=1, dtype_bytes=2)
    bare = activation_peak(model, coef=replace(DEFAULT_COEFFICIENTS, bands=ZERO_BANDS), **kw)
    assert bare.low_bytes == bare.value_bytes == bare.high_bytes  # one sampler, no band
    wide = replace(ZERO_BANDS, activation={g: Band(0.5) for g in ACTIVATION_GROUPS})
    a = activation_peak(model, coef=replace(DEFAULT_COEFFICIENTS, bands=wide), **kw)
    assert a.low_bytes == pytest.approx(bare.value_bytes * 0.5, abs=1)
    assert a.high_bytes == pytest.approx(bare.value_bytes * 1.5, abs=1)
    nt = non_torch(
        era, tp=4, pp=1, nvls=True, coef=replace(DEFAULT_COEFFICIENTS, bands=SHIPPED_BANDS)
    )
    half = SHIPPED_BANDS.non_torch_gib["late/tp"].half_width
    assert (nt.high_bytes - nt.value_bytes) / GIB == pytest.approx(half, abs=1e-6)


def test_without_bands_the_kv_range_is_the_mechanisms_own_span() -> None:
    settings = EngineSettings(vllm_version="0.19", gpu_memory_utilization=0.95)
    bare = predict(
        llama_3_1_8b(), H100, settings, coefficients=replace(DEFAULT_COEFFICIENTS, bands=ZERO_BANDS)
    )
    assert bare.kv_cache_bytes_range == (bare.kv_cache_bytes, bare.kv_cache_bytes)
    shipped = predict(llama_3_1_8b(), H100, settings)
    low, high = shipped.kv_cache_bytes_range
    assert low < shipped.kv_cache_bytes < high
    assert shipped.kv_cache_bytes == bare.kv_cache_bytes  # bands never move the estimate
