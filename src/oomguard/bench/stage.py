"""One stage: a closed loop at fixed concurrency, sampled, stopped at the first sign of danger.

``concurrency`` slots each send a request, and the next one as soon as theirs ends, until the
stage's requests are sent (the first wave starts together: every request reaches its longest
at the same moment, the worst case for the pool). A sampler starts a server read every
``sample_interval_s`` (≤ 0.5 s; a slow read does not delay the next) and stops the stage at
the first preemption (the counter's delta since the stage began), at KV usage ≥ ``kv_stop``,
at a failing ``/health``, and at the first failed request. With distinct prompts the client
also knows, token by token, the KV its requests need at the engine's next step: when that
reaches ``kv_stop`` of the pool the stage stops at once, without waiting for a read (vLLM
preempts when the need passes the pool). Stopping cancels every request in flight (vLLM
aborts a request whose client went away) and measures how long it took.

Two figures time the stop: ``stop_latency_s`` from the first sign (a read showing the
preemption, or the client seeing the need) to every request cancelled, and ``stop_bound_s``
from the start of the last read that showed no preemption (the preemption came after that
page was rendered) to every request cancelled: an upper bound on the time from the
preemption to the stop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil

from oomguard.bench.client import LoopLagMonitor, RequestRecord, completion_body, stream_completion
from oomguard.bench.prompts import BuiltPrompt
from oomguard.bench.server import ServerClient, ServerInfo, ServerReading
from oomguard.bench.stats import percentile, summarize

STOP_REASONS = ("preemption", "kv_full", "error", "health", "budget")
HEALTH_INTERVAL_S = 0.5
HEALTH_TIMEOUTS_TO_STOP = 2
MAX_READS_IN_FLIGHT = 4


@dataclass(frozen=True)
class StageSpec:
    """What one stage runs and when it must stop."""

    index: int
    concurrency: int
    request_indices: tuple[int, ...]  # which of the workload's requests it sends, in order
    purpose: str = "search"  # "search", "fixed" or "hold"
    deadline_s: float = math.inf  # on the run's clock
    kv_limit: float = 0.95  # the high watermark a safe stage stays at or below
    kv_stop: float = 0.98
    sample_interval_s: float = 0.25
    client_kv_applies: bool = True  # distinct prompts: the client's KV estimate is exact


@dataclass
class Sample:
    """Server and client figures at one moment of a stage (run clock, seconds)."""

    t_s: float
    stage: int
    concurrency: int
    in_flight: int
    read_s: float  # how long the server read took
    kv_usage: float | None = None
    preemptions: float | None = None  # since the stage began
    running: float | None = None
    waiting: float | None = None
    waiting_for_capacity: float | None = None
    gateway_queue: float | None = None
    client_kv_usage: float | None = None
    health_ok: bool | None = None
    gpu_used_bytes: list[int] | None = None


@dataclass
class StageResult:
    """Everything one stage measured, and its verdict."""

    spec: StageSpec
    start_s: float
    end_s: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    stop_reason: str | None = None  # None: every request ran
    stop_detail: str = ""
    stop_latency_s: float | None = None  # first sign → every request cancelled
    stop_bound_s: float | None = None  # last clean read's start → every request cancelled
    server_quiet_s: float | None = None  # last clean read's start → server runs nothing
    loop_lags_s: list[float] = field(default_factory=list)
    client_cpu_fraction: float | None = None  # of one core
    kv_peak_client: float | None = None
    # the pool a first wave sent together needs at its peak (distinct prompts; None: unknown)
    wave_need: float | None = None
    counters: dict[str, float] = field(default_factory=dict)  # server counter deltas
    safe: bool | None = None
    reasons: list[str] = field(default_factory=list)
    staggered: str = ""  # why a clean stage did not test its concurrency (then safe is None)

    @property
    def concurrency(self) -> int:
        """The stage's concurrency."""
        return self.spec.concurrency

    @property
    def preemptions(self) -> float | None:
        """Preemptions during the stage (None: the server does not say)."""
        values = [s.preemptions for s in self.samples if s.preemptions is not None]
        return max(values) if values else None

    @property
    def kv_peak(self) -> float | None:
        """The highest KV usage the server reported in the stage."""
        values = [s.kv_usage for s in self.samples if s.kv_usage is not None]
        return max(values) if values else None

    def peak(self, name: str) -> float | None:
        """Largest sampled value of a :class:`Sample` field."""
        values = [getattr(s, name) for s in self.samples if getattr(s, name) is not None]
        return max(values) if values else None

    @property
    def ok_records(self) -> list[RequestRecord]:
        """Requests that completed with every token."""
        return [r for r in self.records if r.ok]

    @property
    def errors(self) -> list[RequestRecord]:
        """Requests that failed (cancelled ones are not failures)."""
        return [r for r in self.records if r.error and not r.cancelled]

    @property
    def duration_s(self) -> float:
        """Seconds from the first request to the stop."""
        return max(self.end_s - self.start_s, 1e-9)

    def output_tokens_per_s(self) -> float:
        """Output tokens of every request (finished or not) per second of the stage."""
        return sum(r.output_tokens for r in self.records) / self.duration_s

    def summary(self) -> dict[str, Any]:
        """Plain data for JSON and tables (seconds, fractions)."""
        ok = self.ok_records
        lags = sorted(self.loop_lags_s)
        return {
            "index": self.spec.index,
            "concurrency": self.concurrency,
            "purpose": self.spec.purpose,
            "safe": self.safe,
            "reasons": list(self.reasons),
            "staggered": self.staggered or None,
            "wave_need": _r(self.wave_need),
            "stop_reason": self.stop_reason,
            "stop_detail": self.stop_detail,
            "stop_latency_s": _r(self.stop_latency_s),
            "stop_bound_s": _r(self.stop_bound_s),
            "server_quiet_s": _r(self.server_quiet_s),
            "start_s": _r(self.start_s),
            "duration_s": _r(self.duration_s),
            "requests": {
                "planned": len(self.spec.request_indices),
                "sent": len(self.records),
                "ok": len(ok),
                "errors": len(self.errors),
                "cancelled": sum(1 for r in self.records if r.cancelled),
            },
            "error_examples": sorted({r.error for r in self.errors})[:3],
            "preemptions": self.preemptions,
            "kv_peak": _r(self.kv_peak),
            "kv_peak_client": _r(self.kv_peak_client),
            "running_peak": self.peak("running"),
            "waiting_peak": self.peak("waiting"),
            "gateway_queue_peak": self.peak("gateway_queue"),
            "samples": len(self.samples),
            "sample_interval_s": self.spec.sample_interval_s,
            "prompt_tokens": sum(r.prompt_tokens_reported or r.prompt_tokens for r in ok),
            "output_tokens": sum(r.output_tokens for r in self.records),
            "output_tokens_per_s": _r(self.output_tokens_per_s()),
            "requests_per_s": _r(len(ok) / self.duration_s),
            "ttft_s": summarize([r.ttft_s for r in ok]),
            "itl_s": summarize([g for r in ok for g in r.chunk_gaps_s]),
            "tpot_s": summarize([r.tpot_s for r in ok]),
            "e2e_s": summarize([r.e2e_s for r in ok]),
            "client_delay_s": summarize([r.client_delay_s for r in self.records]),
            "connection_wait_s_max": _r(
                max((r.connection_wait_s for r in self.records), default=0.0)
            ),
            "loop_lag_s": {
                "p50": _r(percentile(lags, 50)),
                "p99": _r(percentile(lags, 99)),
                "max": _r(lags[-1] if lags else None),
            },
            "client_cpu_fraction": _r(self.client_cpu_fraction),
            "server_counters": {k: round(v, 3) for k, v in self.counters.items()},
        }


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd)


def wave_peak_blocks(wave: Sequence[RequestRecord], block_size: int) -> int:
    """The most blocks requests sent together hold at one engine step, each storing its
    prompt and growing one token a step until it ends after its ``max_tokens`` (the bench's
    requests ignore EOS): the sum peaks at the step before one of them ends."""
    sizes = [(r.prompt_tokens, r.max_tokens) for r in wave]
    peak = 0
    for _p, end in sizes:
        step = end - 1
        held = sum(-(-(p + min(step, m - 1)) // block_size) for p, m in sizes if m > step)
        peak = max(peak, held)
    return peak


class KvTracker:
    """The KV blocks the client's own requests hold, from the tokens they streamed so far.

    With distinct prompts nothing is shared, so this is what vLLM holds for them: a request
    that has produced k of M tokens holds ``ceil((P + min(k, M − 1)) / block_size)`` blocks
    (the slot for the next token is allocated before it is computed; the last token is never
    stored). It sees every token, so it catches peaks that fall between two samples.
    """

    def __init__(self, usable_blocks: int, block_size: int) -> None:
        self.usable_blocks, self.block_size = usable_blocks, block_size
        self.held: dict[int, int] = {}
        self.finishing: dict[int, int] = {}
        self.total = 0
        self.peak = 0

    def _blocks(self, record: RequestRecord) -> int:
        prompt = record.prompt_tokens_reported or record.prompt_tokens
        tokens = prompt + min(record.output_tokens, record.max_tokens - 1)
        return -(-tokens // self.block_size)

    def update(self, record: RequestRecord) -> None:
        """A request streamed more tokens."""
        blocks = self._blocks(record)
        self.total += blocks - self.held.get(record.index, 0)
        self.held[record.index] = blocks
        self.peak = max(self.peak, self.total)

    def remove(self, record: RequestRecord) -> None:
        """A request ended (its blocks are free)."""
        self.total -= self.held.pop(record.index, 0)
        self.finishing.pop(record.index, None)

    def mark_finishing(self, record: RequestRecord) -> None:
        """A request produced its last token: its blocks are freed before the next step."""
        self.finishing[record.index] = self.held.get(record.index, 0)

    @property
    def needed(self) -> int:
        """Blocks the engine's next step needs for these requests (a lower bound: requests
        still waiting or in prefill are not counted, ones about to end are left out)."""
        return self.total - sum(self.finishing.values())

    def usage(self, blocks: int | None = None) -> float:
        """``blocks`` (default: held now) as a fraction of the usable pool."""
        return (self.total if blocks is None else blocks) / self.usable_blocks


StageListener = Callable[[str, "StageResult", "Sample | None"], None]


class StageRunner:
    """Runs stages against one server with one client session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        info: ServerInfo,
        server: ServerClient,
        prompts: dict[int, BuiltPrompt],
        max_tokens: dict[int, int],
        *,
        clock_zero: float,
        listener: StageListener | None = None,
        gpu_reader: Callable[[], list[int] | None] | None = None,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.session, self.info, self.server = session, info, server
        self.prompts, self.max_tokens = prompts, max_tokens
        self.t0 = clock_zero
        self.listener = listener
        self.gpu_reader = gpu_reader
        self.request_timeout_s = request_timeout_s

    def now(self) -> float:
        """Seconds on the run's clock."""
        return time.perf_counter() - self.t0

    async def read(self) -> ServerReading | None:
        """One server reading from the run's metrics source."""
        return await self.server.read(self.info.metrics_source, self.info.metrics_url)

    async def run(self, spec: StageSpec) -> StageResult:
        """Run one stage to its end or its first stop reason, and judge it."""
        return await _Stage(self, spec).run()

    async def wait_quiet(self, timeout_s: float = 60.0, poll_s: float = 0.05) -> float | None:
        """Wait until the server runs and queues nothing; seconds waited (None: not seen)."""
        if self.info.metrics_source == "none":
            return None
        start = time.perf_counter()
        while time.perf_counter() - start < timeout_s:
            reading = await self.read()
            if (
                reading is not None
                and not (reading.running or 0)
                and not (reading.waiting or 0)
                and not (reading.gateway_queue or 0)
            ):
                return time.perf_counter() - start
            await asyncio.sleep(poll_s)
        return None


class _Stage:
    """The moving parts of one running stage."""

    def __init__(self, runner: StageRunner, spec: StageSpec) -> None:
        self.r, self.spec = runner, spec
        self.result = StageResult(spec, start_s=runner.now())
        cap = runner.info.capacity
        self.tracker = KvTracker(cap.usable_blocks, cap.block_size) if cap else None
        self.pending = iter(spec.request_indices)
        self.stop = asyncio.Event()
        self.clean_since: float | None = None  # run clock: read start of the last clean sample
        self.baseline: ServerReading | None = None
        self.reads: set[asyncio.Task[None]] = set()
        self.health: bool | None = None
        self._sign_s = 0.0

    def _trigger(self, reason: str, detail: str, sign_s: float | None) -> None:
        if self.stop.is_set():
            return
        self.result.stop_reason, self.result.stop_detail = reason, detail
        self._sign_s = sign_s if sign_s is not None else self.r.now()
        self.stop.set()

    def _emit(self, event: str, sample: Sample | None = None) -> None:
        if self.r.listener is not None:
            self.r.listener(event, self.result, sample)

    async def run(self) -> StageResult:
        """Load, sample, stop, wait for the server to be quiet, judge."""
        res = self.result
        self.baseline = await self.r.read()
        cpu0 = psutil.Process().cpu_times()
        lag = LoopLagMonitor()
        lag.start()
        res.start_s = self.r.now()
        self.clean_since = res.start_s if self.baseline is not None else None
        self._emit("start")
        try:
            await self._load()
        finally:
            res.end_s = self.r.now()
            res.loop_lags_s = lag.take()
            await lag.stop()
        cpu1 = psutil.Process().cpu_times()
        res.client_cpu_fraction = (
            (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
        ) / res.duration_s
        quiet = await self.r.wait_quiet()
        if res.stop_reason is not None and quiet is not None and self.clean_since is not None:
            res.server_quiet_s = self.r.now() - self.clean_since
        await self._final_counters()
        if self.tracker is not None and self.spec.client_kv_applies:
            res.kv_peak_client = self.tracker.usage(self.tracker.peak)
            wave = res.records[: self.spec.concurrency]
            res.wave_need = self.tracker.usage(wave_peak_blocks(wave, self.tracker.block_size))
        judge(res)
        self._emit("end")
        return res

    async def _load(self) -> None:
        """The closed loop and the sampler, until the requests end or a stop reason."""
        res = self.result
        slots = [asyncio.create_task(self._slot(s)) for s in range(self.spec.concurrency)]
        sampler = asyncio.create_task(self._sample_loop())
        stopper: asyncio.Future[Any] = asyncio.create_task(self.stop.wait())
        all_slots: asyncio.Future[Any] = asyncio.gather(*slots, return_exceptions=True)
        try:
            timeout = max(0.0, self.spec.deadline_s - self.r.now())
            done, _ = await asyncio.wait(
                {all_slots, stopper}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                self._trigger("budget", "the run's time budget ended during this stage", None)
            if self.stop.is_set():
                for task in slots:
                    task.cancel()
                await asyncio.gather(*slots, return_exceptions=True)
                stopped = self.r.now()
                res.stop_latency_s = stopped - self._sign_s
                await self._reads_done()  # reads in flight settle which page was the last clean
                if self.clean_since is not None:
                    res.stop_bound_s = stopped - self.clean_since
            await asyncio.gather(all_slots, return_exceptions=True)
        finally:  # also when the run itself is cancelled (Ctrl-C): leave nothing running
            pending: list[asyncio.Future[Any]] = [*slots, sampler, stopper]
            for future in pending:
                future.cancel()
            await asyncio.gather(*slots, sampler, stopper, return_exceptions=True)
            await self._reads_done(cancel=True)
            res.samples.sort(key=lambda x: x.t_s)

    async def _slot(self, slot: int) -> None:
        due = self.result.start_s
        while not self.stop.is_set():
            index = next(self.pending, None)
            if index is None:
                return
            prompt = self.r.prompts[index]
            rec = RequestRecord(
                index=index,
                stage=self.spec.index,
                slot=slot,
                prompt_tokens=prompt.tokens,
                max_tokens=self.r.max_tokens[index],
                due_s=due + self.r.t0,
            )
            self.result.records.append(rec)
            body = completion_body(self.r.info.model, prompt.text, rec.max_tokens)
            try:
                await stream_completion(
                    self.r.session,
                    self.r.info.url,
                    rec,
                    body,
                    on_progress=self._progress,
                    request_timeout_s=self.r.request_timeout_s,
                )
            finally:
                if self.tracker is not None:
                    self.tracker.remove(rec)
            due = (rec.end_s or time.perf_counter()) - self.r.t0
            if rec.error:
                self._trigger("error", rec.error, due)

    def _progress(self, record: RequestRecord) -> None:
        tracker = self.tracker
        if tracker is None:
            return
        tracker.update(record)
        if record.output_tokens >= record.max_tokens:
            tracker.mark_finishing(record)
        if self.spec.client_kv_applies and tracker.usage(tracker.needed) >= self.spec.kv_stop:
            self._trigger(
                "kv_full",
                f"the requests in flight need {tracker.usage(tracker.needed):.3f} "
                f"of the pool at the next step (seen by the client)",
                None,
            )

    async def _sample_loop(self) -> None:
        """Start a read every interval, not waiting for the last (a slow server must not
        stretch the period); check ``/health`` alongside."""
        health = asyncio.create_task(self._health_loop())
        try:
            while True:
                started = self.r.now()
                if len(self.reads) < MAX_READS_IN_FLIGHT:
                    task = asyncio.create_task(self._read_once(started))
                    self.reads.add(task)
                    task.add_done_callback(self.reads.discard)
                await asyncio.sleep(
                    max(0.0, self.spec.sample_interval_s - (self.r.now() - started))
                )
        finally:
            health.cancel()
            await asyncio.gather(health, return_exceptions=True)

    async def _health_loop(self) -> None:
        """A ``/health`` that answers badly stops the stage at once; one that does not answer
        in time stops it the second time in a row (a loaded client can miss one timeout on
        its own: its event loop runs late)."""
        timeouts = 0
        while True:
            started = self.r.now()
            answer = await self.r.server.health()
            timeouts = timeouts + 1 if answer is None else 0
            self.health = answer
            if answer is False:
                self._trigger("health", "/health did not answer 200", None)
            elif timeouts >= HEALTH_TIMEOUTS_TO_STOP:
                self._trigger("health", f"/health did not answer {timeouts} times in a row", None)
            await asyncio.sleep(max(0.0, HEALTH_INTERVAL_S - (self.r.now() - started)))

    async def _read_once(self, started: float) -> None:
        reading = await self.r.read()
        read_s = self.r.now() - started
        gpu = await asyncio.to_thread(self.r.gpu_reader) if self.r.gpu_reader else None
        sample = self._sample(started, read_s, reading, self.health, gpu)
        self.result.samples.append(sample)
        self._check(sample, started)
        self._emit("sample", sample)

    async def _reads_done(self, cancel: bool = False) -> None:
        pending = list(self.reads)
        if cancel:
            for future in pending:
                future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _sample(
        self,
        t: float,
        read_s: float,
        reading: ServerReading | None,
        health: bool | None,
        gpu: list[int] | None,
    ) -> Sample:
        base = self.baseline
        preempted = None
        if reading is not None and reading.preemptions_total is not None:
            before = base.preemptions_total if base and base.preemptions_total is not None else 0.0
            preempted = max(0.0, reading.preemptions_total - before)
        return Sample(
            t_s=t,
            stage=self.spec.index,
            concurrency=self.spec.concurrency,
            in_flight=sum(1 for r in self.result.records if r.end_s is None),
            read_s=read_s,
            kv_usage=reading.kv_usage if reading else None,
            preemptions=preempted,
            running=reading.running if reading else None,
            waiting=reading.waiting if reading else None,
            waiting_for_capacity=reading.waiting_for_capacity if reading else None,
            gateway_queue=reading.gateway_queue if reading else None,
            client_kv_usage=self.tracker.usage() if self.tracker else None,
            health_ok=health,
            gpu_used_bytes=gpu,
        )

    def _check(self, sample: Sample, read_started: float) -> None:
        if sample.preemptions:
            self._trigger(
                "preemption",
                f"{sample.preemptions:g} preemption(s) at concurrency {self.spec.concurrency}",
                None,
            )
        elif sample.kv_usage is not None and sample.kv_usage >= self.spec.kv_stop:
            self._trigger("kv_full", f"KV usage {sample.kv_usage:.3f} >= {self.spec.kv_stop}", None)
        elif sample.kv_usage is not None or sample.preemptions is not None:
            # a clean page: the first sign of trouble comes after it was rendered (pages read
            # after a stop the client called before any preemption say nothing about it)
            if self.stop.is_set() and read_started > self._sign_s:
                return
            if self.clean_since is None or read_started > self.clean_since:
                self.clean_since = read_started

    async def _final_counters(self) -> None:
        end = await self.r.read()
        base = self.baseline
        if end is None or base is None:
            return
        for name in (
            "prompt_tokens_total",
            "generation_tokens_total",
            "requests_succeeded_total",
            "preemptions_total",
        ):
            a, b = getattr(base, name), getattr(end, name)
            if a is not None and b is not None:
                self.result.counters[name] = b - a
        total = self.result.counters.get("preemptions_total")
        if total and not self.result.preemptions:
            # a preemption after the last sample (or one the stop raced): still counts
            self.result.samples.append(
                Sample(
                    t_s=self.r.now(),
                    stage=self.spec.index,
                    concurrency=self.spec.concurrency,
                    in_flight=0,
                    read_s=0.0,
                    preemptions=total,
                )
            )


def judge(res: StageResult) -> None:
    """Set ``res.safe`` and the reasons: safe means no preemption, KV at or below the high
    watermark (the server's samples and the client's token-exact estimate), no failed
    request and every planned request run. A stage cut short by the budget alone is
    inconclusive (None)."""
    spec = res.spec
    reasons: list[str] = []
    if res.preemptions:
        reasons.append(f"{res.preemptions:g} preemption(s)")
    if res.kv_peak is not None and res.kv_peak > spec.kv_limit:
        reasons.append(f"KV usage peaked at {res.kv_peak:.3f} (> {spec.kv_limit:g})")
    client = res.kv_peak_client if spec.client_kv_applies else None
    if client is not None and client > spec.kv_limit + 1e-9 and (res.kv_peak is not None):
        reasons.append(
            f"the requests' KV reached {client:.3f} of the pool at its peak "
            f"(> {spec.kv_limit:g}; counted by the client, between two samples)"
        )
    if res.errors:
        reasons.append(f"{len(res.errors)} failed request(s): {res.errors[0].error}")
    if res.stop_reason == "health":
        reasons.append("/health failed")
    if res.stop_reason == "kv_full" and not any("KV" in r for r in reasons):
        reasons.append(res.stop_detail)
    res.reasons = reasons
    if reasons:
        res.safe = False
    elif res.stop_reason == "budget":
        res.safe = None
    elif staggered := _staggered(res):
        res.safe, res.staggered = None, staggered
    else:
        res.safe = True


def _staggered(res: StageResult) -> str:
    """Why a clean stage did not test its concurrency, or "". Its first wave, sent together,
    needs more of the pool than the watermark, so run together it would have stopped the
    stage; it did not, and nothing held a request back (no queue at the engine or the
    gateway): the requests ran spread out, as a machine that stalls the client or the
    server delivers them. Arithmetic, not timing: a loaded client cannot fake it."""
    need = res.wave_need
    if need is None or need <= res.spec.kv_limit or res.kv_peak is None:
        return ""  # (without server samples the client's count is not a verdict either)
    if (res.peak("waiting") or 0) > 0 or (res.peak("gateway_queue") or 0) > 0:
        return ""
    return (
        f"its first {res.concurrency} requests need {need:.2f} of the pool together, yet "
        "nothing stopped them and none waited at the server: they ran spread out (a loaded "
        f"machine), so concurrency {res.concurrency} was not tested"
    )
