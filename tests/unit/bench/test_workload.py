"""Workloads: the peak shape, distributions from a file, real requests from JSONL."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomguard.bench.workload import (
    DistributionWorkload,
    FixedWorkload,
    ReplayWorkload,
    load_workload,
)
from oomguard.errors import BadInput, MalformedConfig


def test_fixed_is_the_peak_shape_every_time() -> None:
    w = FixedWorkload(2048, 512)
    assert w.shape(0) == w.shape(99)
    assert w.longest_sequence_tokens() == 2560 and w.typical_sequence_tokens() == 2560
    with pytest.raises(BadInput, match="--prompt-tokens 0"):
        FixedWorkload(0, 10)
    with pytest.raises(BadInput, match="--shared-prefix 100 is not shorter"):
        FixedWorkload(100, 10, shared_prefix_tokens=100)


def test_distribution_file_is_seeded_and_clamped(tmp_path: Path) -> None:
    path = tmp_path / "w.yaml"
    path.write_text(
        "prompt_tokens: {mean: 800, stdev: 300, min: 100, max: 1200}\n"
        "max_tokens: {min: 50, max: 200}\nseed: 7\n"
    )
    w = load_workload(path, default_max_tokens=None)
    assert isinstance(w, DistributionWorkload)
    shapes = [w.shape(i) for i in range(2000)]
    assert shapes == [w.shape(i) for i in range(2000)]  # deterministic
    assert all(100 <= s.prompt_tokens <= 1200 and 50 <= s.max_tokens <= 200 for s in shapes)
    mean_prompt = sum(s.prompt_tokens for s in shapes) / len(shapes)
    assert 760 < mean_prompt < 840
    assert len({s.max_tokens for s in shapes}) > 100  # uniform, not fixed
    assert w.longest_sequence_tokens() == 1400


def test_weighted_values_and_max_tokens_from_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text('{"prompt_tokens": {"values": [100, 1000], "weights": [3, 1]}}')
    w = load_workload(path, default_max_tokens=64)
    shapes = [w.shape(i) for i in range(4000)]
    share_long = sum(s.prompt_tokens == 1000 for s in shapes) / len(shapes)
    assert 0.2 < share_long < 0.3 and {s.max_tokens for s in shapes} == {64}
    assert w.typical_sequence_tokens() == pytest.approx(325 + 64)


def test_jsonl_replays_real_requests(tmp_path: Path) -> None:
    path = tmp_path / "reqs.jsonl"
    path.write_text(
        '{"prompt": "hello there", "max_tokens": 30}\n\n{"prompt_tokens": 500, "max_tokens": 20}\n'
    )
    w = load_workload(path, default_max_tokens=None)
    assert isinstance(w, ReplayWorkload)
    assert w.shape(0).prompt_text == "hello there" and w.shape(0).max_tokens == 30
    assert w.shape(1).prompt_tokens == 500 and w.shape(3).prompt_tokens == 500  # cycles


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.jsonl", '{"prompt": "x"}\n', "line 1 has no positive max_tokens"),
        ("a.jsonl", "not json\n", "line 1 is not JSON"),
        ("a.jsonl", '{"messages": [], "max_tokens": 3}\n', "chat request"),
        ("a.yaml", "prompt_tokens: {mean: 10}\nmax_tokens: 5\nfoo: 1\n", "unknown key"),
        ("a.yaml", "prompt_tokens: {min: 10}\nmax_tokens: 5\n", "needs max"),
        ("a.yaml", "prompt_tokens: -3\nmax_tokens: 5\n", "not a positive whole number"),
        ("a.yaml", "prompt_tokens: 100\n", "no max_tokens"),
        ("a.yaml", "prompt_tokens: [oops\n", "not valid YAML"),
    ],
)
def test_bad_workload_files_name_the_problem(
    tmp_path: Path, name: str, text: str, match: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(MalformedConfig, match=match):
        load_workload(path, default_max_tokens=None)


def test_missing_file_is_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="cannot read workload"):
        load_workload(tmp_path / "nope.yaml", default_max_tokens=None)
