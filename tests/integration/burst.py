"""Send a burst of OpenAI completion requests at once and measure what happened.

Used by the guard integration tests and ``bench/guard_burst.py``. Streaming requests give the
time to first token; non-streamed ones are what a client retries least gracefully, so the crash
test uses those. Every request's outcome is kept: nothing is dropped from the statistics.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import psutil
from tinymodel import prompt_of_tokens
from vllm_server import fetch_metrics, free_port, metric_value

from oomguard.engine import group_pids, http_ok, start_group, stop_group


@dataclass(frozen=True)
class RequestShape:
    """One request of a mix: prompt and output length, streamed or not, chat or completions."""

    prompt_tokens: int
    max_tokens: int
    stream: bool = True
    chat: bool = False
    # Tokens it really generates when fewer than max_tokens (a client that sets max_tokens
    # far above its answers); None: exactly max_tokens.
    generate: int | None = None

    @property
    def output_tokens(self) -> int:
        """Tokens this request generates."""
        return self.max_tokens if self.generate is None else min(self.generate, self.max_tokens)


def _uniform_mix() -> list[RequestShape]:
    return [RequestShape(180, 300) for _ in range(32)]


def _long_short_mix() -> list[RequestShape]:
    """Long prompts with short answers and short prompts with long answers, interleaved;
    streamed and not, chat and completions (every combination equally often)."""
    out = []
    for i in range(24):
        long_prompt = i % 2 == 0
        out.append(
            RequestShape(
                700 if long_prompt else 40,
                40 if long_prompt else 400,
                stream=(i // 2) % 2 == 0,
                chat=(i // 4) % 2 == 0,
            )
        )
    return out


def _varied_mix() -> list[RequestShape]:
    """32 requests of seeded random shapes (prompt 50–600, output 30–400 tokens)."""
    import random

    rng = random.Random(7)
    return [
        RequestShape(rng.randint(50, 600), rng.randint(30, 400), i % 2 == 0, i % 3 == 0)
        for i in range(32)
    ]


def chatty_mix(seed: int = 11, requests: int = 32) -> list[RequestShape]:
    """Clients that set max_tokens far above their answers: prompts of 40–500 tokens,
    max_tokens 256, 512 or 768 (within the 1,024-token context), answers drawn from a
    long-tailed (log-normal) distribution with a median of 120 tokens; streamed and not, chat
    and completions, all from ``seed``."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        prompt = rng.randint(40, 500)
        max_tokens = min(rng.choice((256, 512, 768)), 1024 - prompt)
        answer = max(4, min(int(rng.lognormvariate(4.8, 0.8)), max_tokens))
        out.append(
            RequestShape(
                prompt,
                max_tokens,
                stream=rng.random() < 0.5,
                chat=rng.random() < 0.5,
                generate=answer,
            )
        )
    return out


MIXES = {
    "uniform": _uniform_mix,
    "long-short": _long_short_mix,
    "varied": _varied_mix,
    "chatty": chatty_mix,
}


@dataclass
class RequestResult:
    """One request's fate."""

    index: int
    ok: bool
    status: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    error: str = ""


@dataclass
class BurstResult:
    """All requests of one burst, and the backend's preemption counter around it."""

    label: str
    results: list[RequestResult]
    wall_s: float
    preemptions_before: float = 0.0
    preemptions_after: float = 0.0
    notes: list[str] = field(default_factory=list)
    # CPU seconds the guard process used during the burst (None: direct, or not read)
    guard_cpu_s: float | None = None

    @property
    def preemptions(self) -> float:
        """How much ``vllm:num_preemptions_total`` rose during the burst."""
        return self.preemptions_after - self.preemptions_before

    @property
    def succeeded(self) -> int:
        """Requests that returned 200 with the full completion."""
        return sum(1 for r in self.results if r.ok)

    @property
    def completion_tokens(self) -> int:
        """Completion tokens of the successful requests."""
        return sum(r.completion_tokens for r in self.results if r.ok)

    @property
    def throughput_tokens_per_s(self) -> float:
        """Completion tokens per second of wall time (first send to last answer)."""
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def percentiles(self, what: str) -> dict[str, float]:
        """p50/p90/p99 (seconds) of ``"ttft"`` or ``"e2e"`` over successful requests."""
        picked = (r.ttft_s if what == "ttft" else r.e2e_s for r in self.results if r.ok)
        values = sorted(v for v in picked if v is not None)
        if not values:
            return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
        return {f"p{q}": _percentile(values, q) for q in (50, 90, 99)}

    def summary(self) -> dict[str, object]:
        """Plain-data view for printing or JSON."""
        return {
            "label": self.label,
            "requests": len(self.results),
            "succeeded": self.succeeded,
            "preemptions": self.preemptions,
            "wall_s": round(self.wall_s, 2),
            "completion_tokens": self.completion_tokens,
            "throughput_tokens_per_s": round(self.throughput_tokens_per_s, 1),
            "guard_cpu_s": None if self.guard_cpu_s is None else round(self.guard_cpu_s, 2),
            "ttft_s": {k: round(v, 3) for k, v in self.percentiles("ttft").items()},
            "e2e_s": {k: round(v, 3) for k, v in self.percentiles("e2e").items()},
            "errors": sorted({r.error for r in self.results if not r.ok}),
        }


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[int(q) - 1]


def make_prompts(model_dir: Path, n: int, prompt_tokens: int, seed_offset: int) -> list[str]:
    """``n`` distinct prompts of exactly ``prompt_tokens`` tokens (distinct across offsets too,
    so a second burst gets no prefix-cache hits from the first)."""
    return [prompt_of_tokens(model_dir, prompt_tokens, seed=seed_offset + i) for i in range(n)]


# Tokens the tiny models' chat template puts around one user message (bos, <|user|>, the
# newline, <|assistant|>): a chat request's content is this much shorter than its shape.
CHAT_TEMPLATE_TOKENS = 4


def make_shaped_prompts(
    model_dir: Path, shapes: Sequence[RequestShape], seed_offset: int
) -> list[str]:
    """Distinct prompts for ``shapes`` (exact lengths; a chat shape's template included)."""
    return [
        prompt_of_tokens(
            model_dir,
            s.prompt_tokens - (CHAT_TEMPLATE_TOKENS if s.chat else 0),
            seed=seed_offset + i,
        )
        for i, s in enumerate(shapes)
    ]


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    index: int,
    prompt: str,
    max_tokens: int,
    stream: bool,
    timeout_s: float,
    chat: bool = False,
    generate: int | None = None,
) -> RequestResult:
    body: dict[str, object] = {
        "model": model,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": stream,
    }
    if generate is not None and generate < max_tokens:
        body.update(stop_after(generate))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    res = RequestResult(index=index, ok=False)
    t0 = time.monotonic()
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with session.post(
            url + path, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            res.status = resp.status
            if not stream:
                text = await resp.text()
                res.e2e_s = time.monotonic() - t0
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {text[:200]}"
                    return res
                data = json.loads(text)
                usage = data.get("usage") or {}
                res.completion_tokens = int(usage.get("completion_tokens", 0))
                res.prompt_tokens = int(usage.get("prompt_tokens", 0))
            else:
                if resp.status != 200:
                    res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                    res.e2e_s = time.monotonic() - t0
                    return res
                done = False
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    event = json.loads(payload)
                    if "error" in event:
                        res.error = f"stream error: {str(event['error'])[:200]}"
                        break
                    choices = event.get("choices") or []
                    if res.ttft_s is None and choices and _chunk_text(choices[0]):
                        res.ttft_s = time.monotonic() - t0
                    usage = event.get("usage")
                    if usage:
                        res.completion_tokens = int(usage.get("completion_tokens", 0))
                        res.prompt_tokens = int(usage.get("prompt_tokens", 0))
                res.e2e_s = time.monotonic() - t0
                if not done and not res.error:
                    res.error = "stream ended without [DONE]"
            if not res.error:
                want = max_tokens if generate is None else min(generate, max_tokens)
                if want <= res.completion_tokens <= max_tokens:
                    res.ok = True
                else:
                    res.error = f"{res.completion_tokens} of {want} tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.e2e_s = time.monotonic() - t0
        res.error = f"{type(exc).__name__}: {exc}"[:200]
    return res


# Every token id but this one stops a request once it has its min_tokens (vLLM's sampling
# parameters stop_token_ids and min_tokens): the generated models' vocabulary is 4,096 ids.
_FILLER_TOKEN_ID = 4095


def stop_after(tokens: int) -> dict[str, object]:
    """Body fields that make vLLM end a request after ``tokens`` (+1: the stop token) tokens:
    until then only the filler id may be sampled, after it almost every id stops."""
    return {
        "min_tokens": tokens,
        "stop_token_ids": [i for i in range(_FILLER_TOKEN_ID)],
    }


def _chunk_text(choice: dict[str, object]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return str(delta.get("content") or "")
    return str(choice.get("text") or "")


async def send_shaped_burst(
    url: str,
    model: str,
    prompts: Sequence[str],
    shapes: Sequence[RequestShape],
    timeout_s: float = 900.0,
) -> tuple[list[RequestResult], float]:
    """Send requests of ``shapes`` at the same moment; return results (in order), wall time."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(
                _one(
                    session,
                    url,
                    model,
                    i,
                    p,
                    s.max_tokens,
                    s.stream,
                    timeout_s,
                    chat=s.chat,
                    generate=s.generate,
                )
                for i, (p, s) in enumerate(zip(prompts, shapes, strict=True))
            )
        )
        return list(results), time.monotonic() - t0


def run_shaped_burst(
    label: str,
    send_urls: Sequence[str],
    vllm_url: str | None,
    model: str,
    prompts: Sequence[str],
    shapes: Sequence[RequestShape],
) -> BurstResult:
    """One measured burst of ``shapes``, spread round-robin over ``send_urls`` (several guard
    replicas, or one URL); preemptions read from vLLM at ``vllm_url`` (None: not read)."""
    name = "vllm:num_preemptions_total"
    before = metric_value(fetch_metrics(vllm_url), name) if vllm_url else 0.0

    async def spread() -> tuple[list[RequestResult], float]:
        groups: dict[str, list[int]] = {}
        for i in range(len(shapes)):
            groups.setdefault(send_urls[i % len(send_urls)], []).append(i)
        t0 = time.monotonic()
        parts = await asyncio.gather(
            *(
                send_shaped_burst(u, model, [prompts[i] for i in idx], [shapes[i] for i in idx])
                for u, idx in groups.items()
            )
        )
        out: list[RequestResult] = [RequestResult(index=i, ok=False) for i in range(len(shapes))]
        for (results, _), idx in zip(parts, groups.values(), strict=True):
            for r, i in zip(results, idx, strict=True):
                r.index = i
                out[i] = r
        return out, time.monotonic() - t0

    results, wall_s = asyncio.run(spread())
    after = metric_value(fetch_metrics(vllm_url), name) if vllm_url else 0.0
    return BurstResult(label, results, wall_s, before, after)


async def send_burst(
    url: str,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    *,
    stream: bool = True,
    timeout_s: float = 900.0,
) -> tuple[list[RequestResult], float]:
    """Send every prompt at the same moment; return the results (in order) and the wall time."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(
                _one(session, url, model, i, p, max_tokens, stream, timeout_s)
                for i, p in enumerate(prompts)
            )
        )
        return list(results), time.monotonic() - t0


def run_burst(
    label: str,
    send_url: str,
    vllm_url: str | None,
    model: str,
    prompts: Sequence[str],
    max_tokens: int,
    *,
    stream: bool = True,
) -> BurstResult:
    """One measured burst against ``send_url``; preemptions read from vLLM at ``vllm_url``
    (None: not read, e.g. when vLLM is restarted during the burst)."""
    name = "vllm:num_preemptions_total"
    before = metric_value(fetch_metrics(vllm_url), name) if vllm_url else 0.0
    results, wall_s = asyncio.run(send_burst(send_url, model, prompts, max_tokens, stream=stream))
    after = metric_value(fetch_metrics(vllm_url), name) if vllm_url else 0.0
    return BurstResult(label, results, wall_s, before, after)


class GuardProcess:
    """``oomguard guard`` as a subprocess in its own process group, log to a file."""

    def __init__(
        self, backend_urls: Sequence[str], log_path: Path, extra_args: Sequence[str] = ()
    ) -> None:
        self.port = free_port()
        self.log_path = log_path
        exe = Path(sys.executable).parent / "oomguard"
        base = (
            [str(exe)]
            if exe.exists()
            else [sys.executable, "-c", "from oomguard.cli import main; main()"]
        )
        self.argv = [
            *base,
            "guard",
            *(a for url in backend_urls for a in ("--backend", url)),
            "--port",
            str(self.port),
            *extra_args,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The guard's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GuardProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = start_group(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"guard exited with {self.proc.returncode}: {self.log_path.read_text()[-3000:]}"
                )
            if http_ok(self.url + "/ready", timeout_s=1.0):
                return self
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise RuntimeError(f"guard not ready after 60 s: {self.log_path.read_text()[-3000:]}")

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system) the guard process has used so far (None: unknown)."""
        if self.proc is None:
            return None
        try:
            times = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return None
        return float(times.user + times.system)

    def status(self) -> dict[str, object]:
        """The guard's ``/status`` JSON."""
        with urllib.request.urlopen(self.url + "/status", timeout=5) as resp:
            return dict(json.loads(resp.read()))

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_group(self.proc.pid, grace_s=5, leader=self.proc)

    def alive(self) -> bool:
        """Whether the guard process still runs."""
        return (
            self.proc is not None and self.proc.poll() is None and bool(group_pids(self.proc.pid))
        )


@dataclass
class CostProfile:
    """What one engine step costs on a running server, measured from the client side.

    ``decode_step_s[b]``: time per engine step of ``b`` requests decoding together: the wall
    time of ``b`` concurrent requests generating 129 tokens minus that of ``b`` generating 1,
    over 128 (fastest of several; non-streamed; the API server's per-step output work is included,
    as in a real burst, without the per-token streaming that would blur the client's clock).
    ``prefill_s``: added latency (fastest of several) of one request with a ``prefill_tokens``
    prompt over one with a ``base_tokens`` prompt (the cost of recomputing a preempted sequence of
    that length).
    """

    decode_step_s: dict[int, float]
    prefill_tokens: int
    prefill_s: float

    def recompute_in_steps(self, batch: int) -> float:
        """The prefill's cost in decode steps at ``batch``."""
        return self.prefill_s / self.decode_step_s[batch]

    def summary(self) -> dict[str, object]:
        """Plain-data view (milliseconds)."""
        return {
            "decode_step_ms": {b: round(s * 1e3, 2) for b, s in self.decode_step_s.items()},
            "prefill_tokens": self.prefill_tokens,
            "prefill_ms": round(self.prefill_s * 1e3, 1),
            "recompute_in_decode_steps": {
                b: round(self.recompute_in_steps(b), 1) for b in self.decode_step_s
            },
        }


async def _measure_costs(
    url: str,
    model: str,
    model_dir: Path,
    batches: Sequence[int],
    prefill_tokens: int,
    repeats: int,
) -> CostProfile:
    connector = aiohttp.TCPConnector(limit=0)
    seed = 50_000
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(prompt_tokens: int, max_tokens: int, stream: bool) -> RequestResult:
            nonlocal seed
            seed += 1
            prompt = prompt_of_tokens(model_dir, prompt_tokens, seed=seed)
            r = await _one(session, url, model, seed, prompt, max_tokens, stream, 300.0)
            if not r.ok:
                raise RuntimeError(f"cost probe failed: {r.error}")
            return r

        async def batch_wall_s(b: int, max_tokens: int) -> float:
            t0 = time.monotonic()
            await asyncio.gather(*(one(32, max_tokens, False) for _ in range(b)))
            return time.monotonic() - t0

        await batch_wall_s(2, 8)  # warm-up
        decode: dict[int, float] = {}
        steps = 128
        for b in batches:
            short = [await batch_wall_s(b, 1) for _ in range(repeats)]
            long = [await batch_wall_s(b, steps + 1) for _ in range(repeats)]
            decode[b] = max(min(long) - min(short), 0.0) / steps
        base = [(await one(16, 1, False)).e2e_s for _ in range(repeats)]
        full = [(await one(prefill_tokens, 1, False)).e2e_s for _ in range(repeats)]
        prefill_s = max(min(full) - min(base), 0.0)
    return CostProfile(decode, prefill_tokens, prefill_s)


def measure_costs(
    url: str,
    model: str,
    model_dir: Path,
    batches: Sequence[int] = (1, 3, 7),
    prefill_tokens: int = 480,
    repeats: int = 5,
) -> CostProfile:
    """Decode-step and prefill cost of the server at ``url`` (idle before and after).

    Each figure is a difference of the fastest of ``repeats`` timings: on a shared machine
    other processes only ever add time, so the minimum is the least disturbed measurement.
    Prompts are distinct, so prefix caching does not shorten the prefill; the batches must
    fit the KV pool (``b × 160`` tokens) so that nothing is preempted while measuring.
    """
    return asyncio.run(_measure_costs(url, model, model_dir, batches, prefill_tokens, repeats))
