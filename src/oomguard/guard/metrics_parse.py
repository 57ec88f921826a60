"""Read the few vLLM ``/metrics`` values the gateway needs (prometheus text format).

Names as vLLM V1 exports them (``vllm/v1/metrics/loggers.py``, see vllm-memory.md §10):
``vllm:kv_cache_usage_perc`` (0–1; ``vllm:gpu_cache_usage_perc`` on ≤0.10),
``vllm:num_preemptions_total``, ``vllm:num_requests_waiting``/``running`` and the info gauge
``vllm:cache_config_info`` whose labels carry ``num_gpu_blocks`` and ``block_size``.
A vLLM ``/metrics`` page holds hundreds of histogram lines; only the lines of these families are
handed to prometheus_client's parser, which keeps a sub-second poll cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_FAMILIES = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:cache_config_info",
    "process_start_time_seconds",
)
_PREFIXES = (
    _FAMILIES + tuple(f"# TYPE {f}" for f in _FAMILIES) + tuple(f"# HELP {f}" for f in _FAMILIES)
)


@dataclass(frozen=True)
class VllmMetrics:
    """One scrape. Counts are summed over engines (data-parallel ranks); usage is the maximum."""

    kv_cache_usage: float | None = None
    preemptions_total: float | None = None
    requests_waiting: float | None = None
    requests_running: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    prefix_caching: bool | None = None
    # Unix time the server process started (prometheus_client's process collector).
    process_start_time_s: float | None = None


def _int_label(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or raw in ("", "None"):
        return None
    try:
        return int(float(raw))
    except ValueError:
        return None


def parse_vllm_metrics(text: str) -> VllmMetrics:
    """Parse a ``/metrics`` page; absent values are None. Malformed lines raise ValueError."""
    kept = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES)) + "\n"
    usage: float | None = None
    legacy_usage: float | None = None
    preemptions: float | None = None
    waiting: float | None = None
    running: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None
    prefix_caching: bool | None = None
    started: float | None = None
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if name == "vllm:kv_cache_usage_perc":
                usage = value if usage is None else max(usage, value)
            elif name == "vllm:gpu_cache_usage_perc":
                legacy_usage = value if legacy_usage is None else max(legacy_usage, value)
            elif name == "vllm:num_preemptions_total":
                preemptions = value + (preemptions or 0.0)
            elif name == "vllm:num_requests_waiting":
                waiting = value + (waiting or 0.0)
            elif name == "vllm:num_requests_running":
                running = value + (running or 0.0)
            elif name == "vllm:cache_config_info" and num_gpu_blocks is None:
                num_gpu_blocks = _int_label(sample.labels, "num_gpu_blocks")
                block_size = _int_label(sample.labels, "block_size")
                flag = sample.labels.get("enable_prefix_caching")
                prefix_caching = None if flag is None else flag == "True"
            elif name == "process_start_time_seconds" and started is None:
                started = value
    return VllmMetrics(
        kv_cache_usage=usage if usage is not None else legacy_usage,
        preemptions_total=preemptions,
        requests_waiting=waiting,
        requests_running=running,
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        prefix_caching=prefix_caching,
        process_start_time_s=started,
    )
