"""One bench run: preflight, prompts, the stages the search asks for, the recommendation.

``run_bench(settings)`` returns a :class:`BenchResult`; the CLI renders it, the Python API
hands it back. Two modes:

- search (default): find the highest concurrency of the workload that runs with zero
  preemptions, KV usage at or below the high watermark and no errors (:mod:`.search`);
- fixed (``concurrency`` set): prove one concurrency (a stage of ``requests`` requests, or
  ``waves`` per slot, then ``hold_s`` more seconds of it), as the seeds' step 7 asks.
"""

from __future__ import annotations

import asyncio
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import aiohttp

from oomguard.bench.client import RequestRecord, completion_body, new_session, stream_completion
from oomguard.bench.prompts import (
    BuiltPrompt,
    LocalTokenizer,
    PromptMaker,
    ServerTokenizer,
    Tokenizer,
    TokenizerUnavailable,
)
from oomguard.bench.recommend import BenchRecommendation, recommend
from oomguard.bench.search import ConcurrencySearch, first_guess
from oomguard.bench.server import ServerClient, ServerInfo, preflight
from oomguard.bench.stage import Sample, StageListener, StageResult, StageRunner, StageSpec
from oomguard.bench.workload import LoadProfile, ReplayWorkload
from oomguard.calibration.prefix import PrefixCacheWindow, window_between
from oomguard.errors import BadInput
from oomguard.vllm_metrics import VllmSnapshot, parse_vllm_metrics

DEFAULT_BUDGET_S = 600.0
DEFAULT_MAX_CONCURRENCY = 256
_QUIET_TIMEOUT_S = 60.0
STAGE_ATTEMPTS = 3  # a stage a loaded machine spread out is run again, at most this often
_CONTEXT_ERROR_WORDS = ("max_model_len", "maximum context length", "context length", "too long",
                        "longer than")  # fmt: skip


@dataclass(frozen=True)
class BenchSettings:
    """Everything a run needs (see ``oomguard bench --help`` for the meaning of each)."""

    url: str
    workload: LoadProfile
    model: str | None = None
    budget_s: float = DEFAULT_BUDGET_S
    high_watermark: float = 0.95  # a safe stage keeps KV usage at or below this
    kv_stop: float = 0.98
    sample_interval_s: float = 0.25
    waves: int = 3  # requests per slot in a stage
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    start_concurrency: int | None = None  # the search's first stage (default: the pool's guess)
    concurrency: int | None = None  # fixed mode
    requests: int | None = None  # fixed mode: requests in the stage
    hold_s: float = 0.0
    metrics_url: str | None = None
    tokenizer: Path | None = None
    request_timeout_s: float = 600.0
    seed: str = ""

    def __post_init__(self) -> None:
        checks = [
            (self.budget_s > 0, "--budget-s must be positive"),
            (0 < self.high_watermark <= 1, "--high-watermark must be in (0, 1]"),
            (0 < self.sample_interval_s <= 0.5, "--sample-interval-s must be in (0, 0.5]"),
            (self.waves >= 1, "--waves must be at least 1"),
            (self.max_concurrency >= 1, "--max-concurrency must be at least 1"),
            (self.concurrency is None or self.concurrency >= 1, "--concurrency must be at least 1"),
            (self.requests is None or self.requests >= 1, "--requests must be at least 1"),
            (self.hold_s >= 0, "--hold-s must not be negative"),
        ]
        for ok, message in checks:
            if not ok:
                raise BadInput(message, "see `oomguard bench --help`")
        if self.requests is not None and self.concurrency is None:
            raise BadInput(
                "--requests applies to a fixed concurrency",
                "add --concurrency N, or leave --requests out to search",
            )


@dataclass
class BenchResult:
    """What a run found: the stages, the answer, the recommendation and the conditions."""

    settings: BenchSettings
    server: ServerInfo
    stages: list[StageResult] = field(default_factory=list)
    max_safe_concurrency: int | None = None
    exact: bool | None = False  # max_safe + 1 was tested and found unsafe (None: fixed mode)
    first_guess: int | None = None
    recommendation: BenchRecommendation | None = None
    conditions: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stopped_by: str | None = None
    calibration: dict[str, Any] | None = None
    # vLLM's prefix-cache counters over the stages (None: the server does not export them)
    prefix_cache: PrefixCacheWindow | None = None

    @property
    def exit_code(self) -> int:
        """0: a safe point was found; 1: even the lowest concurrency preempted or failed."""
        return 0 if self.max_safe_concurrency else 1

    @property
    def samples(self) -> list[Sample]:
        """Every sample of every stage, in order."""
        return [s for st in self.stages for s in st.samples]

    @property
    def stops(self) -> list[StageResult]:
        """The stages stopped at a preemption or a full pool (the ones whose stop is timed)."""
        return [st for st in self.stages if st.stop_reason in ("preemption", "kv_full")]


Listener = Callable[[str, Any], None]


class _Run:
    """State of one run (the session lives for the whole of it)."""

    def __init__(self, settings: BenchSettings, listener: Listener | None) -> None:
        self.s = settings
        self.listener = listener
        self.t0 = time.perf_counter()
        self.prompts: dict[int, BuiltPrompt] = {}
        self.max_tokens: dict[int, int] = {}
        self.next_index = 0

    def note(self, result: BenchResult, text: str) -> None:
        """Add a note to the result and show it."""
        result.notes.append(text)
        if self.listener:
            self.listener("note", text)

    def elapsed(self) -> float:
        """Seconds since the run began."""
        return time.perf_counter() - self.t0

    async def run(self) -> BenchResult:
        """Preflight, warm-up, the stages of the chosen mode, the recommendation."""
        s = self.s
        limit = max(s.max_concurrency, s.concurrency or 0) + 16
        async with new_session(limit) as session:
            client = ServerClient(session, s.url)
            info = await preflight(client, model=s.model, metrics_url=s.metrics_url)
            result = BenchResult(settings=s, server=info)
            for text in info.notes:
                self.note(result, text)
            self._check_lengths(info)
            maker = PromptMaker(
                self._tokenizer(session, info, result),
                shared_prefix_tokens=s.workload.shared_prefix_tokens,
                run_seed=s.seed or f"{os.getpid()}-{time.time_ns()}-",
            )
            await self._warm_up(session, info, maker, result)
            runner = StageRunner(
                session,
                info,
                client,
                self.prompts,
                self.max_tokens,
                clock_zero=self.t0,
                listener=self._stage_listener(),
                gpu_reader=_gpu_reader(info, result, self),
                request_timeout_s=s.request_timeout_s,
            )
            await runner.wait_quiet(_QUIET_TIMEOUT_S)
            before = await _counters(client, info)
            try:
                if s.concurrency is not None:
                    await self._fixed(runner, maker, result)
                else:
                    await self._search(runner, maker, result)
            except asyncio.CancelledError:
                # Ctrl-C: keep what the finished stages proved and report it
                result.stopped_by = "interrupted"
                self.note(result, "interrupted: the result rests on the stages that finished")
            except TokenizerUnavailable as exc:
                result.stopped_by = "server_down"
                self.note(result, f"prompts could not be built any more: {exc.message}")
            after = await _counters(client, info)
            if before is not None and after is not None:
                result.prefix_cache = window_between(before[0], after[0], before[1], after[1])
        self._finish(result)
        return result

    # -- preparation -------------------------------------------------------------------
    def _check_lengths(self, info: ServerInfo) -> None:
        longest = self.s.workload.longest_sequence_tokens()
        if info.max_model_len and longest > info.max_model_len:
            raise BadInput(
                f"{self.s.workload.description}: {longest:,} tokens per request exceed the "
                f"server's max_model_len of {info.max_model_len:,}",
                "lower --prompt-tokens/--max-tokens, or serve with a larger --max-model-len",
            )

    def _tokenizer(self, session: Any, info: ServerInfo, result: BenchResult) -> Tokenizer:
        """The server's tokenizer (``/tokenize``), else ``--tokenizer``, else the served
        model's own ``tokenizer.json`` on this machine (its directory, or the Hugging Face
        cache; nothing is downloaded)."""
        if self.s.tokenizer is not None:
            return LocalTokenizer(self.s.tokenizer)
        if info.tokenize_url:
            return ServerTokenizer(session, info.tokenize_url, info.model)
        local = _local_tokenizer_file(info.model)
        if local is not None:
            self.note(result, f"{info.url} has no /tokenize: prompts are counted with {local}")
            return LocalTokenizer(local)
        raise BadInput(
            f"{info.url} has no /tokenize, so prompts of an exact length cannot be built",
            "pass --tokenizer with the model's tokenizer.json (or its directory)",
        )

    async def _prepare(self, maker: PromptMaker, count: int) -> tuple[int, ...]:
        """Build the next ``count`` requests' prompts; their indices."""
        indices = tuple(range(self.next_index, self.next_index + count))
        self.next_index += count
        shapes = [(i, self.s.workload.shape(i)) for i in indices]
        built = await maker.build_many(shapes)
        self.prompts.update(built)
        self.max_tokens.update({i: sh.max_tokens for i, sh in shapes})
        if self.listener:
            self.listener("prepared", count)
        return indices

    async def _warm_up(
        self, session: Any, info: ServerInfo, maker: PromptMaker, result: BenchResult
    ) -> None:
        """One short request of the workload's first shape: checks the prompt length the
        server counts and that it accepts the request at all."""
        (index,) = await self._prepare(maker, 1)
        prompt = self.prompts[index]
        rec = RequestRecord(
            index=index,
            stage=0,
            slot=0,
            prompt_tokens=prompt.tokens,
            max_tokens=1,
            due_s=time.perf_counter(),
        )
        await stream_completion(
            session,
            info.url,
            rec,
            completion_body(info.model, prompt.text, 1),
            request_timeout_s=self.s.request_timeout_s,
        )
        if rec.status == 400 or (
            rec.error and any(w in rec.error.lower() for w in _CONTEXT_ERROR_WORDS)
        ):
            raise BadInput(
                f"the server refused the workload's request: {rec.error}",
                "check --prompt-tokens/--max-tokens against the server's limits",
            )
        if rec.error:
            self.note(result, f"the warm-up request failed: {rec.error}")
        elif rec.prompt_tokens_reported is not None and rec.prompt_tokens_reported != prompt.tokens:
            self.note(
                result,
                f"the server counted {rec.prompt_tokens_reported} prompt tokens where "
                f"{prompt.tokens} were built (its tokenizer differs from the one used)",
            )
        result.conditions["warm_up"] = {
            "ok": not rec.error,
            "ttft_s": rec.ttft_s,
            "prompt_tokens_reported": rec.prompt_tokens_reported,
        }

    def _stage_listener(self) -> StageListener | None:
        if self.listener is None:
            return None
        listener = self.listener

        def forward(event: str, stage: StageResult, sample: Sample | None) -> None:
            listener(f"stage_{event}", (stage, sample))

        return forward

    def _spec(
        self,
        index: int,
        concurrency: int,
        indices: tuple[int, ...],
        purpose: str,
        deadline_s: float,
        info: ServerInfo,
    ) -> StageSpec:
        # generated prompts share nothing, so the client counts their KV exactly; replayed
        # texts may share prefixes (and their KV is then less than the sum)
        distinct = self.s.workload.shared_prefix_tokens == 0 and not isinstance(
            self.s.workload, ReplayWorkload
        )
        return StageSpec(
            index=index,
            concurrency=concurrency,
            request_indices=indices,
            purpose=purpose,
            deadline_s=deadline_s,
            kv_limit=self.s.high_watermark,
            kv_stop=self.s.kv_stop,
            sample_interval_s=self.s.sample_interval_s,
            client_kv_applies=distinct and info.metrics_source != "none",
        )

    # -- the two modes -----------------------------------------------------------------
    async def _search(self, runner: StageRunner, maker: PromptMaker, result: BenchResult) -> None:
        s, info = self.s, runner.info
        cap = info.capacity
        guess = first_guess(
            cap.usable_blocks if cap else None,
            cap.block_size if cap else None,
            s.workload.typical_sequence_tokens(),
            s.high_watermark,
        )
        result.first_guess = guess
        search = ConcurrencySearch(
            s.start_concurrency or guess or 1,
            s.max_concurrency,
            watch_saturation=info.metrics_source == "none",
        )
        while (c := search.next()) is not None:
            if not self._budget_allows(result):
                result.stopped_by = "budget"
                break
            stage = await self._run_stage(runner, maker, result, c, "search")
            search.record(c, stage.safe, stage.output_tokens_per_s())
            if await self._server_gone(runner, stage, result):
                break
        result.stopped_by = result.stopped_by or search.stopped_by
        result.max_safe_concurrency = search.best
        result.exact = search.exact
        if search.best and s.hold_s > 0 and self._budget_allows(result):
            await self._hold(runner, maker, result, search.best)

    async def _fixed(self, runner: StageRunner, maker: PromptMaker, result: BenchResult) -> None:
        c = self.s.concurrency
        assert c is not None
        stage = await self._run_stage(runner, maker, result, c, "fixed", requests=self.s.requests)
        result.max_safe_concurrency = c if stage.safe else None
        result.exact = None  # one concurrency proven (or not), nothing bracketed
        if stage.safe and self.s.hold_s > 0:
            await self._hold(runner, maker, result, c)

    async def _hold(
        self, runner: StageRunner, maker: PromptMaker, result: BenchResult, c: int
    ) -> None:
        """Keep ``c`` requests in flight for ``hold_s`` more seconds (the proof under time)."""
        stage = await self._run_stage(runner, maker, result, c, "hold", hold_s=self.s.hold_s)
        if stage.safe is False:
            result.max_safe_concurrency = None if c == 1 else c - 1
            result.exact = False
            self.note(
                result,
                f"concurrency {c} was not safe for {self.s.hold_s:g} s "
                f"({'; '.join(stage.reasons)}); {c - 1} was not held",
            )

    async def _run_stage(
        self,
        runner: StageRunner,
        maker: PromptMaker,
        result: BenchResult,
        c: int,
        purpose: str,
        *,
        requests: int | None = None,
        hold_s: float = 0.0,
    ) -> StageResult:
        """One stage, run again (``STAGE_ATTEMPTS`` in all) while its requests ran spread out
        and so did not test its concurrency (then it stays inconclusive)."""
        for attempt in range(1, STAGE_ATTEMPTS + 1):
            stage = await self._run_stage_once(
                runner, maker, result, c, purpose, requests=requests, hold_s=hold_s
            )
            if not stage.staggered:
                break
            then = "run again" if attempt < STAGE_ATTEMPTS else "inconclusive"
            self.note(result, f"stage {stage.spec.index}: {stage.staggered}; {then}")
        return stage

    async def _run_stage_once(
        self,
        runner: StageRunner,
        maker: PromptMaker,
        result: BenchResult,
        c: int,
        purpose: str,
        *,
        requests: int | None = None,
        hold_s: float = 0.0,
    ) -> StageResult:
        if hold_s > 0:
            count = max(c * self.s.waves, self._requests_for(c, hold_s, result))
        else:
            count = requests or c * self.s.waves
        indices = await self._prepare(maker, count)
        deadline = self.s.budget_s
        if hold_s > 0:  # from now: preparing the prompts is not part of the hold
            deadline = min(self.elapsed() + hold_s, self.s.budget_s)
        spec = self._spec(len(result.stages) + 1, c, indices, purpose, deadline, runner.info)
        stage = await runner.run(spec)
        if (
            hold_s > 0
            and stage.stop_reason in (None, "budget")
            and not stage.reasons
            and not stage.staggered
        ):
            # the hold ran its time (or its requests): that is the goal, not a cut
            stage.safe, stage.stop_reason = True, None
            stage.stop_detail = f"held {stage.duration_s:.0f} s of the {hold_s:g} s asked"
        result.stages.append(stage)
        if stage.stop_reason not in (None, "budget"):
            await runner.wait_quiet(_QUIET_TIMEOUT_S)
        return stage

    async def _server_gone(
        self, runner: StageRunner, stage: StageResult, result: BenchResult
    ) -> bool:
        """After a stage that failed requests or health: whether the server still answers
        (a search against a server that died would only collect errors)."""
        if stage.stop_reason not in ("error", "health") or await runner.server.health_ok():
            return False
        result.stopped_by = "server_down"
        self.note(
            result,
            f"the server stopped answering during stage {stage.spec.index} "
            f"({stage.stop_detail}): the search ends there",
        )
        return True

    def _requests_for(self, c: int, hold_s: float, result: BenchResult) -> int:
        """Requests enough to keep ``c`` slots busy for ``hold_s`` (from the e2e seen so far)."""
        e2e = [r.e2e_s for st in result.stages for r in st.ok_records if r.e2e_s]
        fastest = min(e2e) if e2e else 1.0  # enough even if every request is that quick
        return int(c * (hold_s / max(fastest, 0.05) + 2))

    def _budget_allows(self, result: BenchResult) -> bool:
        """Whether another stage is likely to end inside the budget (from the last one's length)."""
        left = self.s.budget_s - self.elapsed()
        last = result.stages[-1].duration_s if result.stages else 0.0
        return left > max(1.0, 0.5 * last)

    def _finish(self, result: BenchResult) -> None:
        s, info = self.s, result.server
        safe = result.max_safe_concurrency
        safe_stages = [st for st in result.stages if st.safe and st.concurrency == safe]
        proven = _server_cap(safe_stages)
        kv_at_safe = max(
            (v for st in safe_stages for v in (st.kv_peak, st.kv_peak_client) if v is not None),
            default=None,
        )
        result.recommendation = recommend(
            max_safe=safe,
            proven_running=proven,
            capacity=info.capacity,
            peak_sequence_tokens=s.workload.longest_sequence_tokens(),
            kv_peak_at_safe=kv_at_safe,
            kv_limit=s.high_watermark,
            model=info.model,
            max_model_len=info.max_model_len,
            backend_url=info.backends[0] if info.backends else info.url,
            gateway=info.metrics_source == "guard",
        )
        result.conditions.update(self._conditions(result))
        for text in client_warnings(result.stages):
            self.note(result, text)

    def _conditions(self, result: BenchResult) -> dict[str, Any]:
        s, info = self.s, result.server
        load = os.getloadavg()
        lags = sorted(x for st in result.stages for x in st.loop_lags_s)
        return {
            "url": info.url,
            "model": info.model,
            "vllm_version": info.vllm_version,
            "metrics_source": info.metrics_source,
            "metrics_url": info.metrics_url,
            "max_model_len": info.max_model_len,
            "capacity": None
            if info.capacity is None
            else {
                "usable_blocks": info.capacity.usable_blocks,
                "block_size": info.capacity.block_size,
                "num_gpu_blocks": info.capacity.num_gpu_blocks,
                "kv_cache_tokens": info.capacity.kv_cache_tokens,
                "kv_cache_memory_bytes": info.capacity.kv_cache_memory_bytes,
                "prefix_caching": info.capacity.prefix_caching,
                "source": info.capacity.source,
            },
            "workload": s.workload.description,
            "high_watermark": s.high_watermark,
            "kv_stop": s.kv_stop,
            "sample_interval_s": s.sample_interval_s,
            "waves": s.waves,
            "budget_s": s.budget_s,
            "elapsed_s": round(self.elapsed(), 2),
            "client": {
                "host": platform.node(),
                "cpu_count": os.cpu_count(),
                "load_average_1m_5m_15m": [round(x, 2) for x in load],
                "loop_lag_p99_s": round(lags[int(0.99 * (len(lags) - 1))], 4) if lags else None,
                "loop_lag_max_s": round(lags[-1], 4) if lags else None,
            },
            "gpu_memory": result.conditions.get("gpu_memory", "not sampled"),
            "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }


async def _counters(client: ServerClient, info: ServerInfo) -> tuple[VllmSnapshot, float] | None:
    """vLLM's counters now and the Unix time (None without a vLLM ``/metrics`` to read)."""
    if info.metrics_source != "vllm" or not info.metrics_url:
        return None
    try:
        status, text = await client.get_text(info.metrics_url)
        return (parse_vllm_metrics(text), time.time()) if status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


def _server_cap(stages: list[StageResult]) -> int | None:
    """The most requests the server ran at once where it held the rest of the client's
    requests in its own queue (its --max-num-seqs, or a gateway's admission), else None.

    A sampled running count below the concurrency alone proves nothing (the samples can miss
    the moment all ran); requests seen waiting in the server's queue while it ran fewer than
    the client sent do.
    """
    capped = [
        st
        for st in stages
        if (st.peak("waiting") or 0) > 0 and (st.peak("running") or 0) < st.concurrency
    ]
    if not capped:
        return None
    return int(max(st.peak("running") or 0 for st in capped)) or None


LAG_WARN_S = 0.05
CPU_WARN_FRACTION = 0.9


def client_warnings(stages: list[StageResult]) -> list[str]:
    """Where the figures may describe the client more than the server: stages whose event
    loop ran late by more than ``LAG_WARN_S`` (p99), or by more than half the median time per
    output token, and stages where the client used nearly a whole core (one note each)."""
    late: list[tuple[int, float]] = []
    busy: list[tuple[int, float]] = []
    for st in stages:
        lags = sorted(st.loop_lags_s)
        if lags:
            p99 = lags[int(0.99 * (len(lags) - 1))]
            tpots = sorted(t for r in st.ok_records if (t := r.tpot_s) is not None)
            tpot = tpots[len(tpots) // 2] if tpots else None
            if p99 > LAG_WARN_S or (tpot and p99 > 0.5 * tpot and p99 > 0.005):
                late.append((st.spec.index, p99))
        if st.client_cpu_fraction is not None and st.client_cpu_fraction > CPU_WARN_FRACTION:
            busy.append((st.spec.index, st.client_cpu_fraction))
    out = []
    if late:
        out.append(
            f"the client's event loop ran late in stage(s) {', '.join(str(i) for i, _ in late)} "
            f"(p99 up to {max(v for _, v in late) * 1000:.0f} ms): their latencies include that "
            "much of the client's own delay (a loaded machine, or too many requests for one "
            "process)"
        )
    if busy:
        out.append(
            f"the client used up to {max(v for _, v in busy):.0%} of a core in stage(s) "
            f"{', '.join(str(i) for i, _ in busy)}: it may be the bottleneck there"
        )
    return out


def _local_tokenizer_file(model: str) -> Path | None:
    """``tokenizer.json`` of ``model`` on this machine: a local directory, or the Hugging
    Face cache (offline lookup)."""
    path = Path(model).expanduser()
    if (path / "tokenizer.json").is_file():
        return path / "tokenizer.json"
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "tokenizer.json")
    except Exception:  # noqa: BLE001 - not a repo id, no cache: nothing local
        return None
    return Path(cached) if isinstance(cached, str) else None


def _gpu_reader(
    info: ServerInfo, result: BenchResult, run: _Run
) -> Callable[[], list[int] | None] | None:
    """NVML's used memory per GPU, when the server runs on this machine and NVML answers."""
    from oomguard.engine import gpu_memory

    if not info.local:
        result.conditions["gpu_memory"] = "not sampled: the server is not on this machine"
        return None
    if gpu_memory() is None:
        result.conditions["gpu_memory"] = "not sampled: NVML is not available on this machine"
        run.note(result, "NVML is not available here (no NVIDIA driver): GPU memory is not sampled")
        return None
    result.conditions["gpu_memory"] = "NVML, used bytes per GPU"

    def read() -> list[int] | None:
        devices = gpu_memory()
        return None if devices is None else [d.used_bytes for d in devices]

    return read


def run_bench(settings: BenchSettings, listener: Listener | None = None) -> BenchResult:
    """Run bench against ``settings.url`` and return what it found (see the module doc)."""
    return asyncio.run(_Run(settings, listener).run())
