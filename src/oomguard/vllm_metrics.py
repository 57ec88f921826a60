"""Read a vLLM server's ``/metrics`` page (Prometheus text format) into one typed snapshot.

Names as vLLM's V1 engine exports them (``vllm/v1/metrics/loggers.py``; docs/memory-model.md §10).
prometheus_client appends ``_total`` to counters in the exposition, so the counter registered
as ``vllm:num_preemptions`` is scraped as ``vllm:num_preemptions_total``. Every metric carries
``model_name`` and ``engine`` (the data-parallel rank) labels: counts are summed over engines,
usage is the largest engine's (the first pool to fill is the one that preempts).

A ``/metrics`` page holds hundreds of histogram lines; only the families read here are handed
to prometheus_client's parser, which keeps a sub-second poll cheap. bench, watch and the guard
read the same snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # ≤0.10; hidden in 0.11, removed in 0.12
PREEMPTIONS = "vllm:num_preemptions"  # scraped with the _total suffix
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"  # 0.20+
CACHE_CONFIG = "vllm:cache_config_info"
PROMPT_TOKENS = "vllm:prompt_tokens"  # counter
GENERATION_TOKENS = "vllm:generation_tokens"  # counter
REQUEST_SUCCESS = "vllm:request_success"  # counter, label finished_reason
SLEEP_STATE = "vllm:engine_sleep_state"  # 0.12+
PROCESS_START = "process_start_time_seconds"  # prometheus_client's process collector
# prompt tokens looked up in / served from the local prefix cache, counted at admission of new
# (not re-admitted preempted) requests, only while prefix caching is on (0.32:
# vllm/v1/metrics/loggers.py registers them, vllm/v1/core/kv_cache_manager.py counts them)
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"  # counter, tokens
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"  # counter, tokens

FAMILIES = (
    KV_USAGE, KV_USAGE_LEGACY, PREEMPTIONS, RUNNING, WAITING, WAITING_BY_REASON, CACHE_CONFIG,
    PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS, SLEEP_STATE, PROCESS_START,
    PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS,
)  # fmt: skip
_PREFIXES = (
    FAMILIES + tuple(f"# TYPE {f}" for f in FAMILIES) + tuple(f"# HELP {f}" for f in FAMILIES)
)


@dataclass(frozen=True)
class VllmSnapshot:
    """One scrape of a vLLM server. A value the page does not carry is None."""

    kv_cache_usage: float | None = None  # 0-1, the fullest engine's
    preemptions_total: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    waiting_by_reason: dict[str, float] = field(default_factory=dict)  # e.g. {"capacity": 2}
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    requests_succeeded_total: float | None = None
    num_gpu_blocks: int | None = None  # per engine, as in cache_config_info
    block_size: int | None = None
    engines: int = 0  # engines (DP ranks) seen in the page
    cache_config: dict[str, str] = field(default_factory=dict)  # every label of cache_config_info
    sleeping: bool | None = None
    process_start_time_s: float | None = None  # Unix time the server process started
    prefix_cache_queries_total: float | None = None  # prompt tokens looked up, all engines
    prefix_cache_hits_total: float | None = None  # of them, tokens found cached
    model_name: str | None = None  # the served model name (every vLLM metric's label)

    @property
    def prefix_caching(self) -> bool | None:
        """Whether the pool shares prompt blocks between requests (``enable_prefix_caching``
        of ``cache_config_info``; None where the page does not say)."""
        flag = self.cache_config.get("enable_prefix_caching")
        return None if flag is None else flag == "True"

    @property
    def is_vllm(self) -> bool:
        """Whether the page looked like a vLLM server's (it carried any vLLM metric)."""
        return (
            self.engines > 0 or self.kv_cache_usage is not None or self.num_gpu_blocks is not None
        )

    @property
    def waiting_for_capacity(self) -> float | None:
        """Requests waiting because the KV pool is full (None where vLLM does not say)."""
        if not self.waiting_by_reason:
            return None
        return self.waiting_by_reason.get("capacity", 0.0)

    @property
    def kv_cache_tokens(self) -> int | None:
        """The pool of one engine in tokens, as vLLM states it (``kv_cache_size_tokens``,
        0.24+), else ``num_gpu_blocks × block_size`` (its "KV cache size" line for one group)."""
        stated = _int_label(self.cache_config, "kv_cache_size_tokens")
        if stated is not None:
            return stated
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size

    @property
    def usable_blocks(self) -> int | None:
        """Blocks requests can hold: all but the null block, which vLLM 0.10.2+ also leaves
        out of ``kv_cache_usage_perc`` (``1 − free / (num_blocks − 1)``)."""
        return None if self.num_gpu_blocks is None else max(self.num_gpu_blocks - 1, 0)


def _int_label(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name)
    if raw is None or raw in ("", "None"):
        return None
    try:
        return int(float(raw))
    except ValueError:
        return None


def _add(current: float | None, value: float) -> float:
    return value if current is None else current + value


def parse_vllm_metrics(text: str) -> VllmSnapshot:
    """Parse a ``/metrics`` page; absent values are None. Malformed lines raise ValueError."""
    kept = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES)) + "\n"
    values: dict[str, float | None] = {}
    usage: dict[str, float] = {}
    legacy_usage: dict[str, float] = {}
    by_reason: dict[str, float] = {}
    engines: set[str] = set()
    cache_config: dict[str, str] = {}
    sleeping: bool | None = None
    started: float | None = None
    model_name: str | None = None
    for family in text_string_to_metric_families(kept):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            engine = labels.get("engine", "0")
            if name.startswith("vllm:"):
                engines.add(engine)
                model_name = model_name or labels.get("model_name")
            if name == KV_USAGE:
                usage[engine] = value
            elif name == KV_USAGE_LEGACY:
                legacy_usage[engine] = value
            elif name == PREEMPTIONS + "_total":
                values["preemptions"] = _add(values.get("preemptions"), value)
            elif name == RUNNING:
                values["running"] = _add(values.get("running"), value)
            elif name == WAITING:
                values["waiting"] = _add(values.get("waiting"), value)
            elif name == WAITING_BY_REASON:
                reason = labels.get("reason", "unknown")
                by_reason[reason] = by_reason.get(reason, 0.0) + value
            elif name == PROMPT_TOKENS + "_total":
                values["prompt"] = _add(values.get("prompt"), value)
            elif name == GENERATION_TOKENS + "_total":
                values["generation"] = _add(values.get("generation"), value)
            elif name == REQUEST_SUCCESS + "_total":
                values["success"] = _add(values.get("success"), value)
            elif name == CACHE_CONFIG and not cache_config:
                cache_config = dict(labels)
            elif name == SLEEP_STATE:
                # one sample per state (awake, weights_offloaded, discard_all); 1 marks the current
                asleep = value > 0 and labels.get("sleep_state", "awake") != "awake"
                sleeping = bool(sleeping) or asleep
            elif name == PREFIX_CACHE_QUERIES + "_total":
                values["prefix_queries"] = _add(values.get("prefix_queries"), value)
            elif name == PREFIX_CACHE_HITS + "_total":
                values["prefix_hits"] = _add(values.get("prefix_hits"), value)
            elif name == PROCESS_START and started is None:
                started = value
    chosen = usage or legacy_usage
    return VllmSnapshot(
        kv_cache_usage=max(chosen.values()) if chosen else None,
        preemptions_total=values.get("preemptions"),
        requests_running=values.get("running"),
        requests_waiting=values.get("waiting"),
        waiting_by_reason=by_reason,
        prompt_tokens_total=values.get("prompt"),
        generation_tokens_total=values.get("generation"),
        requests_succeeded_total=values.get("success"),
        num_gpu_blocks=_int_label(cache_config, "num_gpu_blocks"),
        block_size=_int_label(cache_config, "block_size"),
        engines=len(engines),
        cache_config=cache_config,
        sleeping=sleeping,
        process_start_time_s=started,
        prefix_cache_queries_total=values.get("prefix_queries"),
        prefix_cache_hits_total=values.get("prefix_hits"),
        model_name=model_name,
    )
