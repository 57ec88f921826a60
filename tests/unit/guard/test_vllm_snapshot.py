"""What the guard reads from vLLM's /metrics page through the one shared parser
(oomguard.vllm_metrics, which bench and watch read too)."""

from __future__ import annotations

import pytest

from oomguard.vllm_metrics import parse_vllm_metrics

PAGE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.61
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 12.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",cpu_offload_gb="0",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",\
num_cpu_blocks="None",num_gpu_blocks="2221",num_gpu_blocks_override="None",\
prefix_caching_hash_algo="sha256",sliding_window="None",swap_space="4",\
swap_space_bytes="4294967296"} 1.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="m"} 0.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 0.0
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.76409e+09
"""


def test_reads_the_values_the_gateway_needs() -> None:
    m = parse_vllm_metrics(PAGE)
    assert m.kv_cache_usage == pytest.approx(0.61)  # max over engines
    assert m.preemptions_total == 13.0  # summed
    assert m.requests_running == 5.0
    assert m.requests_waiting == 7.0  # the _by_reason family is not double counted
    assert m.num_gpu_blocks == 2221
    assert m.block_size == 16
    assert m.prefix_caching is True
    assert m.process_start_time_s == pytest.approx(1.76409e9)


def test_old_usage_name_and_missing_values() -> None:
    page = (
        '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.25\n'
    )
    m = parse_vllm_metrics(page)
    assert m.kv_cache_usage == 0.25
    assert m.preemptions_total is None and m.num_gpu_blocks is None
    assert m.prefix_caching is None and m.process_start_time_s is None


def test_empty_and_unrelated_pages() -> None:
    assert parse_vllm_metrics("").kv_cache_usage is None
    assert parse_vllm_metrics("process_cpu_seconds_total 1.0\n").num_gpu_blocks is None


def test_malformed_value_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_vllm_metrics('vllm:kv_cache_usage_perc{engine="0"} not-a-number\n')
