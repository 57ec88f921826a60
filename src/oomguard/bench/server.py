"""What bench learns about the server before and while loading it.

Before the first stage: the model it serves and its ``max_model_len`` (``/v1/models``), vLLM's
version (``/version``), and where the server-side figures come from:

- ``vllm``: vLLM's own ``/metrics`` (the URL's, or ``--metrics-url``): KV usage, the
  preemption counter, running/waiting, and the pool (``vllm:cache_config_info``).
- ``guard``: an oomguard gateway (its ``/status``), which mirrors each backend's KV usage,
  preemption counter and queue gauges as it last polled them (every 0.25 s by default), and
  the pool it admits against.
- ``none``: no server-side figures (not vLLM, or a proxy that hides them): the run goes on
  with the client's figures only and says so; preemptions cannot be seen.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from oomguard.errors import BadInput, EnvironmentProblem
from oomguard.vllm_metrics import VllmSnapshot, parse_vllm_metrics


class ServerUnreachable(EnvironmentProblem):
    """The URL does not answer, or does not speak the OpenAI API."""


@dataclass(frozen=True)
class Capacity:
    """The KV pool the server states."""

    usable_blocks: int  # blocks requests can hold (vLLM's null block excluded)
    block_size: int
    kv_cache_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None  # when the server was started with it
    num_gpu_blocks: int | None = None  # as vLLM counts them (null block included)
    gpu_memory_utilization: float | None = None
    prefix_caching: bool | None = None
    source: str = ""

    @property
    def usable_tokens(self) -> int:
        """Tokens the usable blocks hold."""
        return self.usable_blocks * self.block_size

    @property
    def kv_bytes_per_token(self) -> float | None:
        """Pool bytes ÷ pool tokens, where the server states its pool in bytes."""
        if not self.kv_cache_memory_bytes or not self.num_gpu_blocks:
            return None
        blocks_bytes = self.kv_cache_memory_bytes // self.num_gpu_blocks  # vLLM floors
        return blocks_bytes / self.block_size


@dataclass(frozen=True)
class ServerReading:
    """Server-side figures at one moment (None: not available from this source)."""

    kv_usage: float | None = None
    preemptions_total: float | None = None
    running: float | None = None
    waiting: float | None = None
    waiting_for_capacity: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    requests_succeeded_total: float | None = None
    gateway_queue: float | None = None  # requests the guard holds in its own queue


@dataclass
class ServerInfo:
    """What the preflight found."""

    url: str
    model: str
    models: list[str]
    max_model_len: int | None
    vllm_version: str | None
    metrics_source: str  # "vllm", "guard" or "none"
    metrics_url: str | None
    capacity: Capacity | None
    local: bool
    tokenize_url: str | None  # a server whose /tokenize and /detokenize we may use
    notes: list[str] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)  # behind a gateway: its backends' URLs


def is_local(url: str) -> bool:
    """Whether ``url``'s host is this machine (so NVML figures describe the server's GPUs)."""
    host = urlsplit(url).hostname or ""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def reading_from_vllm(snap: VllmSnapshot) -> ServerReading:
    """The figures bench samples, from one vLLM ``/metrics`` page."""
    return ServerReading(
        kv_usage=snap.kv_cache_usage,
        preemptions_total=snap.preemptions_total,
        running=snap.requests_running,
        waiting=snap.requests_waiting,
        waiting_for_capacity=snap.waiting_for_capacity,
        prompt_tokens_total=snap.prompt_tokens_total,
        generation_tokens_total=snap.generation_tokens_total,
        requests_succeeded_total=snap.requests_succeeded_total,
    )


def capacity_from_vllm(snap: VllmSnapshot) -> Capacity | None:
    """The pool from ``vllm:cache_config_info`` (None when the page does not state it)."""
    if snap.usable_blocks is None or not snap.block_size:
        return None
    cfg = snap.cache_config

    def number(name: str) -> float | None:
        try:
            return float(cfg[name])
        except (KeyError, ValueError):
            return None

    memory = number("kv_cache_memory_bytes")
    prefix = cfg.get("enable_prefix_caching")
    return Capacity(
        usable_blocks=snap.usable_blocks,
        block_size=snap.block_size,
        kv_cache_tokens=snap.kv_cache_tokens,
        kv_cache_memory_bytes=int(memory) if memory else None,
        num_gpu_blocks=snap.num_gpu_blocks,
        gpu_memory_utilization=number("gpu_memory_utilization"),
        prefix_caching=None if prefix is None else prefix == "True",
        source="vllm:cache_config_info",
    )


def reading_from_guard(status: dict[str, Any]) -> ServerReading:
    """The figures bench samples, from an oomguard gateway's ``/status`` (summed over its
    backends; usage is the fullest backend's)."""
    backends = [b for b in status.get("backends") or [] if isinstance(b, dict)]

    def total(key: str) -> float | None:
        values = [float(b[key]) for b in backends if b.get(key) is not None]
        return sum(values) if values else None

    usages = [float(b["kv_cache_usage"]) for b in backends if b.get("kv_cache_usage") is not None]
    queue = status.get("queue") or {}
    return ServerReading(
        kv_usage=max(usages) if usages else None,
        preemptions_total=total("preemptions_total"),
        running=total("requests_running"),
        waiting=total("requests_waiting"),
        gateway_queue=float(queue["depth"])
        if isinstance(queue.get("depth"), int | float)
        else None,
    )


def capacity_from_guard(status: dict[str, Any]) -> Capacity | None:
    """The pool of the gateway's first backend that knows it."""
    for b in status.get("backends") or []:
        if isinstance(b, dict) and b.get("capacity_blocks") and b.get("block_size"):
            blocks, size = int(b["capacity_blocks"]), int(b["block_size"])
            return Capacity(
                blocks,
                size,
                kv_cache_tokens=(blocks + 1) * size,
                num_gpu_blocks=blocks + 1,
                source="guard /status",
            )
    return None


def looks_like_guard(data: Any) -> bool:
    """Whether a ``/status`` answer is an oomguard gateway's."""
    return isinstance(data, dict) and isinstance(data.get("backends"), list) and "queue" in data


class ServerClient:
    """The HTTP calls bench makes besides the load: preflight, sampling, health."""

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float = 5.0) -> None:
        self.session = session
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def get_json(self, url: str) -> tuple[int, Any]:
        """(status, parsed JSON or None)."""
        async with self.session.get(url, timeout=self.timeout) as resp:
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, None

    async def get_text(self, url: str) -> tuple[int, str]:
        """(status, body text)."""
        async with self.session.get(url, timeout=self.timeout) as resp:
            return resp.status, await resp.text()

    async def health(self) -> bool | None:
        """``/health``: True when it answers 200, False when it answers anything else or
        cannot be reached, None when no answer came within the timeout."""
        try:
            async with self.session.get(self.url + "/health", timeout=self.timeout) as resp:
                return resp.status == 200
        except asyncio.TimeoutError:
            return None
        except (aiohttp.ClientError, OSError):
            return False

    async def health_ok(self) -> bool:
        """Whether ``/health`` answers 200 (any error or timeout counts as no)."""
        return await self.health() is True

    async def read(self, source: str, metrics_url: str | None) -> ServerReading | None:
        """One sample from ``source`` (None when the read failed)."""
        try:
            if source == "vllm" and metrics_url:
                status, text = await self.get_text(metrics_url)
                return reading_from_vllm(parse_vllm_metrics(text)) if status == 200 else None
            if source == "guard":
                status, data = await self.get_json(self.url + "/status")
                return (
                    reading_from_guard(data) if status == 200 and looks_like_guard(data) else None
                )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return None
        return None


async def preflight(
    client: ServerClient, *, model: str | None, metrics_url: str | None
) -> ServerInfo:
    """Find out what the server is and where its figures come from.

    Raises :class:`ServerUnreachable` (exit 5) when the URL does not answer or has no
    OpenAI-compatible ``/v1/models``, and :class:`BadInput` for a model it does not serve.
    """
    url = client.url
    try:
        status, data = await client.get_json(url + "/v1/models")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise ServerUnreachable(
            f"cannot reach {url}: {_reason(exc)}",
            "check that the server runs and the URL (scheme, host, port) is right",
        ) from None
    if status != 200 or not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise ServerUnreachable(
            f"{url} is not an OpenAI-compatible server (GET /v1/models answered {status})",
            "give the base URL of a vLLM server or of a gateway in front of one",
        )
    cards = [c for c in data["data"] if isinstance(c, dict) and c.get("id")]
    names = [str(c["id"]) for c in cards]
    if not names:
        raise ServerUnreachable(
            f"{url} serves no model (/v1/models is empty)",
            "wait until the server has loaded its model",
        )
    if model is not None and model not in names:
        raise BadInput(
            f"{url} does not serve model {model!r} (it serves: {', '.join(names)})",
            "pass one of those to --model, or leave --model out",
        )
    chosen = model or names[0]
    card = next(c for c in cards if c["id"] == chosen)
    max_len = card.get("max_model_len")
    info = ServerInfo(
        url=url,
        model=chosen,
        models=names,
        max_model_len=int(max_len) if isinstance(max_len, int) else None,
        vllm_version=await _vllm_version(client),
        metrics_source="none",
        metrics_url=None,
        capacity=None,
        local=is_local(metrics_url or url),
        tokenize_url=None,
    )
    await _find_metrics(client, info, metrics_url)
    await _find_tokenizer(client, info)
    return info


async def _vllm_version(client: ServerClient) -> str | None:
    try:
        status, data = await client.get_json(client.url + "/version")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None
    if status == 200 and isinstance(data, dict) and isinstance(data.get("version"), str):
        return str(data["version"])
    return None


async def _find_metrics(client: ServerClient, info: ServerInfo, metrics_url: str | None) -> None:
    candidates = [metrics_url] if metrics_url else [client.url + "/metrics"]
    for candidate in candidates:
        try:
            status, text = await client.get_text(candidate)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            if metrics_url:
                raise ServerUnreachable(
                    f"cannot read --metrics-url {metrics_url}: {_reason(exc)}",
                    "give vLLM's /metrics URL",
                ) from None
            continue
        snap = parse_vllm_metrics(text) if status == 200 else None
        if snap is not None and snap.is_vllm:
            info.metrics_source, info.metrics_url = "vllm", candidate
            info.capacity = capacity_from_vllm(snap)
            if info.capacity is None:
                info.notes.append("vLLM's /metrics does not state its pool (cache_config_info)")
            return
        if metrics_url:
            raise BadInput(
                f"--metrics-url {metrics_url} is not a vLLM /metrics page",
                "give vLLM's own /metrics URL",
            ) from None
    try:
        status, data = await client.get_json(client.url + "/status")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        status, data = 0, None
    if status == 200 and looks_like_guard(data):
        info.metrics_source = "guard"
        info.capacity = capacity_from_guard(data)
        info.backends = [
            str(b["url"]) for b in data["backends"] if isinstance(b, dict) and b.get("url")
        ]
        info.notes.append(
            "server-side figures come from the oomguard gateway's /status (each backend's KV "
            "usage, preemptions and queues as the gateway last polled them); pass "
            "--metrics-url http://VLLM/metrics to read vLLM directly"
        )
        return
    info.notes.append(
        f"{client.url} exposes no vLLM metrics: client figures only; preemptions and KV usage "
        "cannot be seen (pass --metrics-url with vLLM's /metrics if a proxy hides them)"
    )


async def _find_tokenizer(client: ServerClient, info: ServerInfo) -> None:
    """A server whose ``/tokenize`` makes exact-length prompts: the URL's, else (behind the
    gateway) its first backend's."""
    candidates = [client.url, *info.backends]
    if info.metrics_url:
        parts = urlsplit(info.metrics_url)
        candidates.append(f"{parts.scheme}://{parts.netloc}")
    for base in dict.fromkeys(candidates):
        try:
            async with client.session.post(
                base + "/tokenize",
                json={"model": info.model, "prompt": "a b"},
                timeout=client.timeout,
            ) as resp:
                data = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("tokens"), list):
            info.tokenize_url = base
            if base != client.url:
                info.notes.append(f"prompts are tokenized by {base}/tokenize")
            return


def _reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer (timed out)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return str(exc.os_error.strerror or exc.os_error).lower()
    return str(exc) or type(exc).__name__
