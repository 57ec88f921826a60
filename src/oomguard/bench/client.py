"""The load generator's side of one request, and checks on the load generator itself.

Every request is a streamed ``/v1/completions`` call with ``ignore_eos`` (so it generates
exactly ``max_tokens`` and holds its worst-case KV) and per-chunk usage (so tokens are counted
exactly even when a chunk carries several). Its clock starts when it was *due* (the moment its
slot of the closed loop freed), not when the client got round to sending it: time lost in the
client (a busy event loop, a connection pool wait) is counted as latency, so a slow client is
never mistaken for a fast server. The connection pool's own queueing is traced separately,
and :class:`LoopLagMonitor` measures how late the event loop runs.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from oomguard import vllm_http

ProgressCallback = Callable[["RequestRecord"], None]

_ERROR_TEXT_CHARS = 300


@dataclass
class RequestRecord:
    """One request's life; times are seconds on the run's clock (``time.perf_counter``)."""

    index: int
    stage: int
    slot: int
    prompt_tokens: int  # as built (exact for generated prompts)
    max_tokens: int
    due_s: float
    sent_s: float | None = None
    connection_wait_s: float = 0.0  # queued in the connection pool (traced)
    first_token_s: float | None = None
    end_s: float | None = None
    output_tokens: int = 0
    prompt_tokens_reported: int | None = None  # the server's usage figure
    chunk_gaps_s: list[float] = field(default_factory=list)  # between content chunks
    status: int = 0
    error: str = ""
    cancelled: bool = False

    @property
    def ok(self) -> bool:
        """Completed with every requested token."""
        return (
            not self.error
            and not self.cancelled
            and self.end_s is not None
            and self.output_tokens == self.max_tokens
        )

    @property
    def ttft_s(self) -> float | None:
        """Time to first token from when the request was due."""
        return None if self.first_token_s is None else self.first_token_s - self.due_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency from when the request was due."""
        return None if self.end_s is None else self.end_s - self.due_s

    @property
    def client_delay_s(self) -> float | None:
        """Time between due and sent: the client's own queueing."""
        return None if self.sent_s is None else self.sent_s - self.due_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_s is None or self.end_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def sequence_tokens(self) -> int:
        """Tokens the request holds in KV now: its prompt and what it generated so far."""
        prompt = self.prompt_tokens_reported or self.prompt_tokens
        return prompt + self.output_tokens


def completion_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The request body: streamed, ``ignore_eos``, greedy, usage in every chunk."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def trace_config() -> aiohttp.TraceConfig:
    """Traces connection-pool queueing into the request's ``trace_request_ctx`` dict."""
    tc = aiohttp.TraceConfig()

    async def queued_start(_s: Any, ctx: Any, _p: Any) -> None:
        info = ctx.trace_request_ctx
        if isinstance(info, dict):
            info["queued_at"] = time.perf_counter()

    async def queued_end(_s: Any, ctx: Any, _p: Any) -> None:
        info = ctx.trace_request_ctx
        if isinstance(info, dict) and "queued_at" in info:
            info["queued_s"] = info.get("queued_s", 0.0) + time.perf_counter() - info["queued_at"]

    tc.on_connection_queued_start.append(queued_start)
    tc.on_connection_queued_end.append(queued_end)
    return tc


def new_session(connection_limit: int) -> aiohttp.ClientSession:
    """The one session of a run: a pool larger than the concurrency, a large read buffer
    (long streams collapse with aiohttp's 64 KiB default), connection queueing traced."""
    return vllm_http.session(
        limit=connection_limit,
        limit_per_host=connection_limit,
        trace_configs=[trace_config()],
        read_bufsize=2**20,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
    )


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    record: RequestRecord,
    body: dict[str, Any],
    *,
    on_progress: ProgressCallback | None = None,
    request_timeout_s: float = 600.0,
) -> RequestRecord:
    """Send one streamed completion and fill ``record`` as the chunks arrive.

    Never raises for a failed request (the error is recorded); a cancelled task marks the
    record cancelled and re-raises, closing the connection (vLLM then aborts the request).
    """
    trace: dict[str, float] = {}
    record.sent_s = time.perf_counter()
    try:
        async with session.post(
            url + "/v1/completions",
            json=body,
            trace_request_ctx=trace,
            timeout=aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=10),
        ) as resp:
            record.status = resp.status
            record.connection_wait_s = trace.get("queued_s", 0.0)
            if resp.status != 200:
                text = await resp.text()
                record.error = f"HTTP {resp.status}: {_error_message(text)}"
                record.end_s = time.perf_counter()
                return record
            await _read_stream(resp, record, on_progress)
    except asyncio.CancelledError:
        record.cancelled = True
        record.end_s = time.perf_counter()
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:_ERROR_TEXT_CHARS]
    except ValueError as exc:  # a chunk that is not JSON
        record.error = f"malformed stream: {exc}"[:_ERROR_TEXT_CHARS]
    if record.end_s is None:
        record.end_s = time.perf_counter()
    return record


async def _read_stream(
    resp: aiohttp.ClientResponse, record: RequestRecord, on_progress: ProgressCallback | None
) -> None:
    done = False
    last_chunk_s: float | None = None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        event = json.loads(payload)
        if "error" in event:
            record.error = f"stream error: {_error_message(json.dumps(event['error']))}"
            break
        now = time.perf_counter()
        usage = event.get("usage") or {}
        choices = event.get("choices") or []
        text = choices[0].get("text") if choices else None
        before = record.output_tokens
        if usage.get("completion_tokens") is not None:
            record.output_tokens = int(usage["completion_tokens"])
        elif text:
            record.output_tokens += 1
        if usage.get("prompt_tokens") is not None:
            record.prompt_tokens_reported = int(usage["prompt_tokens"])
        if record.output_tokens > before or text:
            if record.first_token_s is None:
                record.first_token_s = now
            elif last_chunk_s is not None:
                record.chunk_gaps_s.append(now - last_chunk_s)
            last_chunk_s = now
            if on_progress is not None:
                on_progress(record)
    record.end_s = time.perf_counter()
    if not done and not record.error:
        record.error = "stream ended before [DONE]"
    elif not record.error and record.output_tokens != record.max_tokens:
        record.error = f"generated {record.output_tokens} of {record.max_tokens} tokens"


def _error_message(text: str) -> str:
    """The message of an OpenAI-style error body, else the text itself (shortened)."""
    try:
        data = json.loads(text)
    except ValueError:
        return " ".join(text.split())[:_ERROR_TEXT_CHARS]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_ERROR_TEXT_CHARS]
        if isinstance(err, str):
            return err[:_ERROR_TEXT_CHARS]
    return " ".join(text.split())[:_ERROR_TEXT_CHARS]


class LoopLagMonitor:
    """How late the event loop wakes up: a task sleeps ``interval_s`` and measures overshoot.

    Lag here delays every timestamp the client takes; large lag means the figures describe
    the client, not the server.
    """

    def __init__(self, interval_s: float = 0.01) -> None:
        self.interval_s = interval_s
        self.lags_s: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start measuring on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags_s.append(max(0.0, time.perf_counter() - t0 - self.interval_s))

    def take(self) -> list[float]:
        """The lags measured since the last call (and forget them)."""
        out, self.lags_s = self.lags_s, []
        return out

    async def stop(self) -> None:
        """Stop measuring."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
