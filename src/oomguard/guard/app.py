"""The gateway's HTTP application (aiohttp server + pooled aiohttp client).

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/chat/completions/batch``,
``/v1/responses`` and ``/v1/messages`` (admission-controlled, streamed chunk by chunk or not),
``/v1/models`` (from the pollers' cache), any other ``/v1/*`` passed through (streamed), and the
gateway's own ``/health``, ``/ready``, ``/metrics`` and ``/status``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from oomguard import vllm_http
from oomguard.guard import llama_backend
from oomguard.guard.admission import AdmissionSettings, RequestCost
from oomguard.guard.auth import ApiKeys, ClientIdentity
from oomguard.guard.backends import Backend, BackendPool
from oomguard.guard.config import GuardConfig
from oomguard.guard.gate import Gate, NeverFits, QueueFull, QueueTimeout, Ticket
from oomguard.guard.openai_body import (
    NON_TEXT_PART_TOKENS,
    ROUTES,
    ApiError,
    CharsPerTokenLearner,
    GenerationRequest,
    InputLimits,
    RouteKind,
    bad_request,
    estimate_prompt_tokens,
    parse_generation,
    parse_json_body,
    parse_priority_header,
    prompt_tokens_lower_bound,
)
from oomguard.guard.output_lengths import OutputLengths, OutputLengthSettings, length_class
from oomguard.guard.projection import ProgressSettings
from oomguard.guard.queue import AdmissionQueue, DrainRateMeter
from oomguard.guard.shared import SharedAdmission
from oomguard.guard.sse import (
    SseSplitter,
    StreamAssembler,
    chunk_progress,
    client_usage_wishes,
    is_usage_only,
    stream_error,
    strip_usage,
    with_progress_stream,
)
from oomguard.guard.telemetry import Telemetry
from oomguard.guard.tokenizer import (
    INLINE_CHARS,
    LARGE_ENCODES,
    LocalTokenizers,
    count_request,
    request_chars,
    request_kind,
)

log = logging.getLogger("oomguard.guard")

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", "X-Request-Id")
# Upstream failures that mean "try again elsewhere or later": nothing reached the client yet.
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)
# When a model's context limit and every capacity are still unknown, a request without
# max_tokens reserves this much output; it is re-checked when capacities become known.
_UNKNOWN_CONTEXT_OUTPUT_TOKENS = 4096
# Request fields whose streamed form vLLM does not assemble back into the non-streamed answer
# one to one (or that streaming rejects): such non-streamed requests are not converted.
_NOT_CONVERTIBLE = (
    "echo",
    "best_of",
    "use_beam_search",
    "prompt_logprobs",
    "return_token_ids",
    "stream_options",
    "return_prompt_text",
    "kv_transfer_params",
)
_PROMPT_TOKENS_RE = re.compile(rb'"prompt_tokens":\s*(\d+)')
_DONE = b"[DONE]"
# What the last events of a complete stream carry, by route (OpenAI's [DONE], the Responses
# API's terminal events, the Messages API's message_stop).
_STREAM_END: dict[RouteKind, tuple[bytes, ...]] = {
    "completions": (_DONE,),
    "chat": (_DONE,),
    "chat_batch": (_DONE,),
    "responses": (b"response.completed", b"response.incomplete", b"response.failed"),
    "messages": (b"message_stop",),
}
# Request headers that carry a client's credentials for the gateway, not for the backend.
_CLIENT_KEY_HEADERS = frozenset({"authorization", "x-api-key"})


@dataclass
class _Retry:
    reason: str


def _error_response(err: ApiError) -> web.Response:
    return web.Response(
        status=err.status,
        body=err.body_bytes(),
        content_type="application/json",
        headers=err.headers,
    )


def _sse_error(message: str, code: int = 502, kind: RouteKind = "completions") -> bytes:
    """The event that ends a broken stream, in the form the route's clients parse."""
    event: dict[str, Any]
    if kind == "responses":
        event = {"type": "error", "code": "upstream_error", "message": message, "param": None}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    if kind == "messages":
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    payload = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"


class _EndWatcher:
    """Whether a relayed stream reached its route's final event (markers may span chunks)."""

    def __init__(self, kind: RouteKind) -> None:
        self.markers = _STREAM_END[kind]
        self.tail = b""
        self.seen = False

    def feed(self, chunk: bytes) -> None:
        if self.seen:
            return
        window = self.tail + chunk
        self.seen = any(m in window for m in self.markers)
        self.tail = window[-32:]


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except ApiError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        message = (
            exc.reason if exc.status != 404 else f"no route for {request.method} {request.path}"
        )
        return _error_response(ApiError(exc.status, message, headers=headers))
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return _error_response(
            ApiError(500, "internal error in the gateway (logged)", type_="internal_error")
        )


class GuardApp:
    """State and handlers of one gateway process."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.settings = AdmissionSettings(
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            projected_watermark=config.projected_watermark,
            tighten_factor=config.tighten_factor,
            min_capacity_fraction=config.min_capacity_fraction,
            relax_step=config.relax_step,
            calm_period_s=config.calm_period_s,
            track_mode=config.track_progress,
            track_above_fraction=config.track_above_fraction,
            stagger=config.stagger_admissions,
            share_prefix_blocks=config.share_prefix_blocks,
            engine_queue_requests=config.engine_queue_requests,
            first_chunk_tokens=config.first_chunk_tokens,
            learned_watermark=config.learned_watermark,
            learned_sum=config.output_length_projection == "sum",
            progress=ProgressSettings(
                lag_s=config.progress_lag_s,
                lag_floor_tokens=config.progress_lag_floor_tokens,
                start_allowance_s=config.progress_start_allowance_s,
                rate_quantile=config.rate_quantile,
                start_quantile=config.start_latency_quantile,
                earliest_start_share=config.progress_earliest_start_share,
            ),
        )
        self.chars_per_token = CharsPerTokenLearner(config.estimate_chars_per_token)
        self.keys = ApiKeys(config.api_keys)
        self.limits = InputLimits(
            config.max_tokens_limit, config.max_prompts_per_request, config.max_n
        )
        self._tokenize_slots: asyncio.Semaphore | None = None
        self.local_tokenizers = LocalTokenizers()
        self._large_encodes = asyncio.Semaphore(LARGE_ENCODES)
        self.queue = AdmissionQueue(config.max_queue_requests, config.max_queue_tokens)
        self.drain = DrainRateMeter()
        self.pool = BackendPool(config, self.settings, on_change=self._on_pool_change)
        self.shared: SharedAdmission | None = None
        if config.redis_url:
            self.shared = SharedAdmission(
                config.redis_url,
                config.redis_prefix,
                lease_s=config.lease_s,
                snapshot_max_age_s=config.snapshot_max_age_s,
                timeout_s=config.redis_timeout_s,
                replicas=config.replicas,
                max_head_bypass=config.max_head_bypass,
            )
            self.pool.shared = self.shared
            self.shared.backends = lambda: [(b.url, b.admission) for b in self.pool.backends]
        self.telemetry = Telemetry(
            self.pool, self.queue, self.drain, self.chars_per_token, self.shared
        )
        self.gate = Gate(
            self.pool,
            self.queue,
            self.drain,
            retry_fallback_s=min(config.queue_timeout_s, 30.0),
            max_retry_after_s=config.max_retry_after_s,
            on_queue_wait=self.telemetry.queue_wait.observe,
            max_head_bypass=config.max_head_bypass,
            shared=self.shared,
            log_admissions=config.log_admissions,
            lengths=OutputLengths(
                OutputLengthSettings(
                    quantile=config.output_length_quantile,
                    min_samples=config.output_length_min_samples,
                    window=config.output_length_window,
                )
            ),
        )
        if self.shared is not None:
            self.shared.on_change = self.gate.pump
        self.session: aiohttp.ClientSession | None = None
        self._timeout = aiohttp.ClientTimeout(total=config.upstream_timeout_s)
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=30, sock_read=config.upstream_timeout_s
        )
        self._tokenize_timeout = aiohttp.ClientTimeout(total=config.tokenize_timeout_s)

    def _on_pool_change(self) -> None:
        self.gate.pump()

    # -- lifecycle -----------------------------------------------------------------------
    async def startup(self, _app: web.Application) -> None:
        self._tokenize_slots = asyncio.Semaphore(self.config.tokenize_concurrency)
        self.session = vllm_http.session(
            limit=0,
            ttl_dns_cache=300,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
        if self.shared is not None:
            await self.shared.start()
        await self.pool.start()

    async def cleanup(self, _app: web.Application) -> None:
        await self.pool.stop()
        if self.shared is not None:
            await self.shared.stop()
        if self.session is not None:
            await self.session.close()

    # -- own routes ----------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        ready = [b.url for b in self.pool.backends if b.healthy and b.admission.known]
        status = 200 if ready else 503
        return web.json_response({"ready": bool(ready), "backends_ready": ready}, status=status)

    async def metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.telemetry.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def status(self, _request: web.Request) -> web.Response:
        c = self.config
        now = time.monotonic()
        backends = [b.snapshot(now) for b in self.pool.backends]
        return web.json_response(
            {
                "backends": backends,
                "capacity_tokens": sum(b.capacity_tokens or 0 for b in self.pool.backends),
                "reserved_tokens": sum(b.admission.reserved_tokens for b in self.pool.backends),
                "projected_peak_blocks": sum(b["projected_peak_blocks"] for b in backends),
                "in_flight": sum(b.in_flight for b in self.pool.backends),
                "tracked_requests": sum(b["tracked_requests"] for b in backends),
                "progress_tracking": {
                    "mode": c.track_progress,
                    "above_fraction": c.track_above_fraction,
                    "lag_s": c.progress_lag_s,
                    "start_allowance_s": c.progress_start_allowance_s,
                },
                "queue": {
                    "depth": self.queue.depth,
                    "tokens": self.queue.tokens,
                    "max_requests": c.max_queue_requests,
                    "max_tokens": c.max_queue_tokens,
                    "timeout_s": c.queue_timeout_s,
                    "drain_rate_per_s": round(self.drain.rate_per_s(time.monotonic()), 3),
                },
                "watermarks": {"high": c.high_watermark, "low": c.low_watermark},
                "tokenizer": c.tokenizer,
                "local_tokenizers": self.local_tokenizers.status(),
                "shared_state": None if self.shared is None else self.shared.status(),
                "estimate_chars_per_token": {
                    "value": round(self.chars_per_token.value, 4),
                    "configured": c.estimate_chars_per_token,
                    "samples": self.chars_per_token.samples,
                },
            }
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        models: dict[str, dict[str, Any]] = {}
        for b in self.pool.backends:
            if b.healthy:
                for k, v in b.models.items():
                    models.setdefault(k, v)
        if not models:
            return await self.passthrough(request)
        return web.json_response({"object": "list", "data": list(models.values())})

    # -- passthrough ---------------------------------------------------------------------
    def _upstream_headers(self, request: web.Request, backend: Backend) -> dict[str, str]:
        """The client's headers for ``backend``: hop-by-hop ones dropped; the client's key
        replaced by the backend's own when configured, dropped when it was the gateway's."""
        drop = _HOP_BY_HOP | _CLIENT_KEY_HEADERS if self.keys.enabled else _HOP_BY_HOP
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        if backend.config.api_key:
            headers = {k: v for k, v in headers.items() if k.lower() not in _CLIENT_KEY_HEADERS}
            headers["Authorization"] = f"Bearer {backend.config.api_key}"
        return headers

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Forward any other ``/v1/*`` request to a healthy backend, without admission.

        The answer is relayed as it arrives (a stream stays a stream)."""
        assert self.session is not None
        if request.path in ROUTES:
            raise ApiError(
                405,
                f"{request.method} is not allowed on {request.path}; use POST",
                headers={"Allow": "POST"},
            )
        self.keys.identify(request.headers)
        body = await self._read_body(request)
        backends = sorted(
            (b for b in self.pool.backends if b.healthy),
            key=lambda b: b.admission.free_blocks,
            reverse=True,
        )
        if not backends:
            raise self._no_backend_error()
        last_error = ""
        for backend in backends[:2]:
            try:
                async with self.session.request(
                    request.method,
                    backend.url + request.path_qs,
                    data=body or None,
                    headers=self._upstream_headers(request, backend),
                    timeout=self._stream_timeout,
                ) as resp:
                    headers = {h: resp.headers[h] for h in _RESPONSE_HEADERS if h in resp.headers}
                    if resp.status >= 500:
                        data = await resp.read()
                        return web.Response(status=502, body=data, headers=headers)
                    out = web.StreamResponse(status=resp.status, headers=headers)
                    await out.prepare(request)
                    try:
                        async for chunk in resp.content.iter_any():
                            await out.write(chunk)
                        await out.write_eof()
                    except (ConnectionError, *_UPSTREAM_ERRORS):
                        pass  # a cut relay ends the response; the client sees it incomplete
                    return out
            except _UPSTREAM_ERRORS as exc:
                last_error = f"{type(exc).__name__}: {exc}"
                if isinstance(exc, aiohttp.ClientConnectorError):
                    self.pool.eject(backend, last_error)
        raise ApiError(502, f"backend unreachable: {last_error}", type_="upstream_error")

    def _no_backend_error(self, model: str | None = None) -> ApiError:
        """503 for a request no healthy backend can take, with the backends' states and a
        ``Retry-After`` from the health checks (the expected end of a restart, else the time
        the next polls take)."""
        now = time.monotonic()
        retry = min(math.ceil(self.pool.expected_back_in_s(now)), self.config.max_retry_after_s)
        states = "; ".join(
            f"{b.url} {b.state}" + (f" ({b.last_error})" if b.last_error else "")
            for b in self.pool.backends
            if b.serves(model)
        )
        what = f" for model {model}" if model else ""
        return ApiError(
            503,
            f"no healthy backend{what}: {states or 'none configured'}; retry after {retry} s",
            type_="service_unavailable",
            code="no_healthy_backend",
            headers={"Retry-After": str(retry)},
        )

    # -- generation ----------------------------------------------------------------------
    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(
                413, f"request body of {length} bytes exceeds the limit of {limit} bytes"
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes") from None

    def handler(self, kind: RouteKind) -> Any:
        """The aiohttp handler of generation route ``kind``."""

        async def handle(request: web.Request) -> web.StreamResponse:
            return await self._generate(request, kind)

        return handle

    def _queue_timeout_s(self, request: web.Request) -> float:
        raw = request.headers.get("x-queue-timeout")
        limit = self.config.queue_timeout_s
        if raw is None:
            return limit
        try:
            v = float(raw)
        except ValueError:
            raise bad_request(
                f"header x-queue-timeout must be seconds, got {raw[:40]!r}", "x-queue-timeout"
            ) from None
        if not v > 0:
            raise bad_request("header x-queue-timeout must be positive", "x-queue-timeout")
        return min(v, limit)

    def _priority(
        self, request: web.Request, req: GenerationRequest, identity: ClientIdentity
    ) -> int:
        """The queue priority: the client's (header, else body) when its key allows it."""
        header = parse_priority_header(request.headers.get("x-priority"))
        wanted = header if header is not None else req.priority
        if wanted is None:
            return 0
        if not identity.may_set_priority:
            self.telemetry.priority_ignored.inc()
            return 0
        return wanted

    def _check_any_healthy(self, model: str | None) -> None:
        if not self.pool.candidates(model):
            self.telemetry.outcome["no_backend"].inc()
            raise self._no_backend_error(model)

    async def _generate(self, request: web.Request, kind: RouteKind) -> web.StreamResponse:
        t0 = time.perf_counter()
        tel = self.telemetry
        try:
            identity = self.keys.identify(request.headers)
            raw = await self._read_body(request)
            body = parse_json_body(raw)
            req = parse_generation(body, kind=kind, limits=self.limits)
            priority = self._priority(request, req, identity)
            timeout_s = self._queue_timeout_s(request)
            self._check_model(req.model)
            self._check_any_healthy(req.model)
            if "priority" in body and not (
                self.config.forward_priority and identity.may_set_priority
            ):
                del body["priority"]
                raw = json.dumps(body).encode()
            # What can never fit is refused on a cheap bound before any tokenizing.
            cheap = self._cost_from(req, [prompt_tokens_lower_bound(req)], True)
            self._refuse_never_fitting(cheap, req.model, lower_bound=True)
            cost = await self._cost(req)
            self._refuse_never_fitting(cost, req.model)
            lc = length_class(req.model, kind, identity.name, cost.prompt_tokens)
            cost = replace(cost, length_class=lc)
        except ApiError as err:
            if err.code not in ("context_length_exceeded", "no_healthy_backend"):
                tel.outcome["client_error"].inc()
            raise
        try:
            return await self._admit_and_forward(request, raw, req, cost, priority, timeout_s, t0)
        except asyncio.CancelledError:
            tel.outcome["client_disconnected"].inc()
            raise

    def _refuse_never_fitting(
        self, cost: RequestCost, model: str | None, lower_bound: bool = False
    ) -> None:
        reason = self.gate.never_fit_reason(cost, model, lower_bound)
        if reason is not None:
            self.telemetry.outcome["never_fits"].inc()
            raise ApiError(400, reason, param="max_tokens", code="context_length_exceeded")

    async def _admit_and_forward(
        self,
        request: web.Request,
        raw: bytes,
        req: GenerationRequest,
        cost: RequestCost,
        priority: int,
        timeout_s: float,
        t0: float,
    ) -> web.StreamResponse:
        tel = self.telemetry
        attempts = 0
        queued_s = 0.0
        upstream_s = 0.0
        while True:
            tq = time.perf_counter()
            try:
                ticket = await self.gate.acquire(
                    cost, req.model, priority, timeout_s, front=attempts > 0
                )
            except QueueFull as exc:
                tel.shed_full.inc()
                tel.outcome["shed_queue_full"].inc()
                raise ApiError(
                    429,
                    f"the gateway queue is full ({self.queue.depth} requests waiting); "
                    f"retry after {exc.retry_after_s} s",
                    type_="rate_limit_exceeded",
                    code="queue_full",
                    headers={"Retry-After": str(exc.retry_after_s)},
                ) from None
            except QueueTimeout as exc:
                tel.shed_timeout.inc()
                tel.outcome["shed_queue_timeout" if attempts == 0 else "upstream_failed"].inc()
                if attempts == 0:
                    message = f"timed out after {exc.waited_s:.1f} s waiting for KV capacity"
                    code = "queue_timeout"
                else:
                    message = (
                        f"the backend failed this request and no healthy backend came back "
                        f"within {exc.waited_s:.0f} s (restart_wait_s); it was not completed"
                    )
                    code = "backend_restart_timeout"
                raise ApiError(
                    503,
                    f"{message}; retry after {exc.retry_after_s} s",
                    type_="service_unavailable",
                    code=code,
                    headers={"Retry-After": str(exc.retry_after_s)},
                ) from None
            except NeverFits as exc:
                tel.outcome["never_fits"].inc()
                raise ApiError(
                    400, str(exc), param="max_tokens", code="context_length_exceeded"
                ) from None
            queued_s += time.perf_counter() - tq
            tu = time.perf_counter()
            try:
                result = await self._forward(request, ticket, raw, req, cost)
            finally:
                self.gate.release(ticket)
            upstream_s += time.perf_counter() - tu
            if not isinstance(result, _Retry):
                if not req.stream:
                    tel.added_latency.observe(
                        max(time.perf_counter() - t0 - queued_s - upstream_s, 0.0)
                    )
                return result
            attempts += 1
            if attempts > self.config.max_retries:
                tel.outcome["upstream_failed"].inc()
                raise ApiError(
                    502,
                    f"the backends failed this request {attempts} times (last: {result.reason})",
                    type_="upstream_error",
                    code="upstream_failed",
                )
            tel.retries.inc()
            timeout_s = self.pool.restart_wait_s()

    def _check_model(self, model: str | None) -> None:
        if model is None:
            return
        known = self.pool.all_models()
        if known and model not in known:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; served: {', '.join(sorted(known))}",
                param="model",
                code="model_not_found",
            )

    async def _cost(self, req: GenerationRequest) -> RequestCost:
        counts, exact = await self._prompt_tokens(req)
        return self._cost_from(req, counts, exact)

    def _cost_from(self, req: GenerationRequest, counts: list[int], exact: bool) -> RequestCost:
        """The request's KV cost with prompts of ``counts`` tokens (``exact``: not estimated)."""
        prompt = max(counts)
        mml = self.pool.max_model_len(req.model)
        if req.max_tokens is not None:
            new_tokens = req.max_tokens
        elif mml is not None:
            new_tokens = max(mml - prompt, 0)
        else:
            cap = self.pool.largest_capacity_tokens()
            new_tokens = max(cap - prompt, 1) if cap else _UNKNOWN_CONTEXT_OUTPUT_TOKENS
        return RequestCost(
            prompt_tokens=prompt,
            max_new_tokens=new_tokens,
            num_sequences=req.num_sequences * max(req.inputs, 1),
            inputs=max(req.inputs, 1),
            prompt_exact=exact,
            trackable=_trackable(req),
        )

    def _tokenizer_backend(self, model: str | None) -> Backend | None:
        now = time.monotonic()
        for b in self.pool.candidates(model):
            if b.tokenize_supported or now >= b.tokenize_retry_at_s:
                return b
        return None

    async def _prompt_tokens(self, req: GenerationRequest) -> tuple[list[int], bool]:
        """Prompt length of each input: exact from the backend's /tokenize, else estimated.

        Routes whose input is converted to chat messages (Responses, Messages) are tokenized
        that way, plus an allowance per non-text part: close, but counted as estimated.
        """
        if not req.chat and all(isinstance(p, list) for p in req.prompts):
            return [len(p) for p in req.prompts], True
        if self.config.tokenizer == "backend":
            backend = self._tokenizer_backend(req.model)
            counts = await self._local_counts(req, backend)
            if counts is None and backend is not None:
                counts = await self._tokenize(backend, req)
            if counts is not None:
                converted = req.kind in ("responses", "messages")
                extra = req.non_text_parts * NON_TEXT_PART_TOKENS
                return [c + extra for c in counts], not converted
        self.telemetry.estimated_prompts.inc()
        return estimate_prompt_tokens(req, self.chars_per_token.value), False

    async def _local_counts(
        self, req: GenerationRequest, backend: Backend | None
    ) -> list[int] | None:
        """Counts by the model's own tokenizer in-process (see ``guard/tokenizer.py``); the
        backend's ``/tokenize`` also counts a kind of request until both agreed."""
        root = self._model_root(req.model)
        tok = None if root is None else self.local_tokenizers.get(root)
        kind = request_kind(req)
        if root is None or tok is None or not self.local_tokenizers.usable(root, kind):
            return None
        mml = self.pool.max_model_len(req.model)
        if request_chars(req) <= INLINE_CHARS:
            counts = count_request(tok, req, mml)
        else:
            async with self._large_encodes:
                counts = await asyncio.to_thread(count_request, tok, req, mml)
        if counts is None or backend is None or llama_backend.is_llama(backend):
            return counts
        if self.local_tokenizers.needs_check(root, kind):
            remote = await self._tokenize(backend, req)
            if remote is None:
                return counts
            self.local_tokenizers.check(root, kind, counts, remote)
            return remote
        return counts

    def _model_root(self, model: str | None) -> str | None:
        """Where the backends load ``model`` from (``root`` in ``/v1/models``)."""
        if not self.config.local_tokenizer:
            return None
        for b in self.pool.candidates(model):
            if llama_backend.is_llama(b):
                continue
            entry = b.models.get(model) if model else None
            if entry is None and len(b.models) == 1:
                entry = next(iter(b.models.values()))
            root = entry.get("root") if entry else None
            if isinstance(root, str) and root:
                return root
        return None

    def _tokenize_payloads(self, req: GenerationRequest) -> list[dict[str, Any] | int]:
        """One ``/tokenize`` body per input (token-id prompts are counted in place)."""
        payloads: list[dict[str, Any] | int] = []
        if req.chat:
            for conversation in req.conversations:
                payload: dict[str, Any] = {"messages": conversation}
                for key in (
                    "add_generation_prompt",
                    "continue_final_message",
                    "chat_template",
                    "chat_template_kwargs",
                    "tools",
                    "documents",
                    "mm_processor_kwargs",
                    "add_special_tokens",
                ):
                    if key in req.body and req.kind in ("chat", "chat_batch"):
                        payload[key] = req.body[key]
                payloads.append(payload)
        else:
            special = req.body.get("add_special_tokens")
            extra = {} if special is None else {"add_special_tokens": special}
            for p in req.prompts:
                payloads.append(len(p) if isinstance(p, list) else {"prompt": p, **extra})
        if req.model:
            for item in payloads:
                if isinstance(item, dict):
                    item["model"] = req.model
        return payloads

    async def _tokenize(self, backend: Backend, req: GenerationRequest) -> list[int] | None:
        """Counts of every input, at most ``tokenize_concurrency_per_request`` calls at once
        for this request and ``tokenize_concurrency`` for the whole gateway."""
        payloads = self._tokenize_payloads(req)
        mine = asyncio.Semaphore(self.config.tokenize_concurrency_per_request)
        shared = self._tokenize_slots
        assert shared is not None

        async def one(item: dict[str, Any]) -> int | None:
            async with mine, shared:
                return await self._tokenize_one(backend, req.model, item)

        pending = [item for item in payloads if isinstance(item, dict)]
        if len(pending) == 1:
            counts: list[int | None] = [await one(pending[0])]
        else:
            tasks = [asyncio.ensure_future(one(item)) for item in pending]
            try:
                counts = list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
        it = iter(counts)
        results: list[int] = []
        for item in payloads:
            c = item if isinstance(item, int) else next(it)
            if c is None:
                return None
            results.append(c)
        return results

    async def _tokenize_one(
        self, backend: Backend, model: str | None, payload: dict[str, Any]
    ) -> int | None:
        assert self.session is not None
        if llama_backend.is_llama(backend):
            try:
                return await llama_backend.count_tokens(
                    self.session, backend, payload, self._tokenize_timeout
                )
            except (*_UPSTREAM_ERRORS, ValueError):
                return None
        try:
            async with self.session.post(
                backend.url + "/tokenize", json=payload, timeout=self._tokenize_timeout
            ) as resp:
                status = resp.status
                data = await resp.read()
        except _UPSTREAM_ERRORS:
            return None
        if status == 200:
            try:
                answer = json.loads(data)
                count = int(answer["count"])
            except (ValueError, KeyError, TypeError):
                return None
            backend.tokenize_supported = True
            backend.note_max_model_len(model, answer.get("max_model_len"))
            return count
        message = ""
        try:
            err = json.loads(data)
            message = str(err.get("error", {}).get("message") or err.get("message") or "")
        except (ValueError, AttributeError):
            pass
        if status in (404, 405, 501) and "model" not in message.lower():
            backend.tokenize_supported = False
            backend.tokenize_retry_at_s = time.monotonic() + 60.0
            return None
        if status == 404:
            raise ApiError(404, message or "model not found", param="model", code="model_not_found")
        if 400 <= status < 500:
            raise ApiError(status, message or f"the backend rejected the prompt ({status})")
        return None

    def _learn_prompt(self, req: GenerationRequest, cost: RequestCost, exact: int | None) -> None:
        """An exact prompt count for a request whose prompt was estimated: learn from it."""
        if exact is not None and not cost.prompt_exact and self.config.learn_chars_per_token:
            self.chars_per_token.observe(req, exact)

    def _response_headers(self, cost: RequestCost, ticket: Ticket) -> dict[str, str]:
        return {
            "x-oomguard-prompt-tokens": "exact" if cost.prompt_exact else "estimated",
            "x-oomguard-progress": "tracked" if ticket.tracked else "reserved",
        }

    async def _forward(
        self,
        request: web.Request,
        ticket: Ticket,
        body: bytes,
        req: GenerationRequest,
        cost: RequestCost,
    ) -> web.StreamResponse | _Retry:
        """One upstream attempt. Returns the finished response, or _Retry if nothing was sent."""
        assert self.session is not None
        backend = ticket.backend
        tel = self.telemetry
        if ticket.tracked:
            # Ask for a stream with per-chunk usage: that is how progress is read.
            body = json.dumps(with_progress_stream(req.body)).encode()
        streamed_upstream = req.stream or ticket.tracked
        try:
            async with self.session.post(
                backend.url + request.path_qs,
                data=body,
                headers=self._upstream_headers(request, backend),
                timeout=self._stream_timeout if req.stream else self._timeout,
            ) as resp:
                if resp.status >= 500:
                    await resp.read()
                    return _Retry(f"{backend.url} answered {resp.status}")
                if not streamed_upstream or resp.status != 200:
                    data = await resp.read()
                    headers = {h: resp.headers[h] for h in _RESPONSE_HEADERS if h in resp.headers}
                    headers.update(self._response_headers(cost, ticket))
                    if resp.status < 400:
                        tel.outcome["ok"].inc()
                        if not cost.prompt_exact:
                            m = _PROMPT_TOKENS_RE.search(data)
                            self._learn_prompt(req, cost, int(m.group(1)) if m else None)
                    else:
                        tel.outcome["upstream_client_error"].inc()
                    return web.Response(status=resp.status, body=data, headers=headers)
                if not req.stream:
                    return await self._assemble(resp, ticket, req, cost)
                first = await resp.content.readany()
                if not first:
                    return _Retry(f"{backend.url} closed the stream before any data")
                return await self._relay_stream(request, resp, first, ticket, req, cost)
        except aiohttp.ClientConnectorError as exc:
            self.pool.eject(backend, f"connect failed: {exc}")
            return _Retry(f"connect to {backend.url} failed")
        except asyncio.TimeoutError:
            tel.outcome["upstream_failed"].inc()
            raise ApiError(
                504,
                f"the backend did not answer within {self.config.upstream_timeout_s:.0f} s",
                type_="upstream_error",
                code="upstream_timeout",
            ) from None
        except _UPSTREAM_ERRORS as exc:
            return _Retry(f"{backend.url}: {type(exc).__name__}")

    def _note_event(self, ticket: Ticket, event: dict[str, Any]) -> int | None:
        """Report one chunk's progress; returns the exact prompt tokens it states, if any."""
        prompt: int | None = None
        for cp in chunk_progress(event):
            self.gate.note_progress(
                ticket, cp.index, cp.completion_tokens, cp.finished, cp.prompt_tokens
            )
            if cp.prompt_tokens is not None:
                prompt = cp.prompt_tokens if prompt is None else max(prompt, cp.prompt_tokens)
        return prompt

    async def _assemble(
        self,
        resp: aiohttp.ClientResponse,
        ticket: Ticket,
        req: GenerationRequest,
        cost: RequestCost,
    ) -> web.Response | _Retry:
        """Read a tracked non-streamed request's upstream stream; answer the assembled body."""
        splitter = SseSplitter()
        assembler = StreamAssembler(chat=req.chat)
        done = False
        prompt: int | None = None
        while not done:
            chunk = await resp.content.readany()
            if not chunk:
                break
            for payload in splitter.feed(chunk):
                if payload == _DONE:
                    done = True
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if not isinstance(event, dict):
                    continue
                err = stream_error(event)
                if err is not None:
                    status, err_body = err
                    if status >= 500:
                        return _Retry(f"{ticket.backend.url} failed the request ({status})")
                    self.telemetry.outcome["upstream_client_error"].inc()
                    return web.json_response(err_body, status=status)
                p = self._note_event(ticket, event)
                if p is not None:
                    prompt = p if prompt is None else max(prompt, p)
                assembler.add(event)
        if not done:
            return _Retry(f"{ticket.backend.url} ended the stream before [DONE]")
        self._learn_prompt(req, cost, prompt)
        self.telemetry.outcome["ok"].inc()
        return web.Response(
            body=json.dumps(assembler.result()).encode(),
            content_type="application/json",
            headers=self._response_headers(cost, ticket),
        )

    async def _relay_stream(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        first: bytes,
        ticket: Ticket,
        req: GenerationRequest,
        cost: RequestCost,
    ) -> web.StreamResponse:
        tel = self.telemetry
        backend = ticket.backend
        out = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
                **self._response_headers(cost, ticket),
            },
        )
        await out.prepare(request)
        rewrite = _StreamRewriter(self, ticket, req) if ticket.tracked else None
        end = _EndWatcher(req.kind)
        chunk = first
        upstream_error: str | None = None
        while True:
            data = chunk if rewrite is None else rewrite.feed(chunk)
            end.feed(chunk)
            try:
                if data:
                    await out.write(data)
            except ConnectionError:
                tel.outcome["client_disconnected"].inc()
                return out
            try:
                chunk = await resp.content.readany()
            except _UPSTREAM_ERRORS as exc:
                upstream_error = (
                    f"the backend {backend.url} failed mid-stream ({type(exc).__name__})"
                )
                break
            if not chunk:
                break
        if rewrite is not None:
            self._learn_prompt(req, cost, rewrite.prompt_tokens)
        if upstream_error is None and not end.seen:
            upstream_error = f"the backend {backend.url} ended the stream before its last event"
        try:
            if upstream_error is not None:
                tel.outcome["stream_error"].inc()
                message = upstream_error + "; the response is incomplete"
                await out.write(_sse_error(message, kind=req.kind))
            else:
                tel.outcome["ok"].inc()
            await out.write_eof()
        except ConnectionError:
            tel.outcome["client_disconnected"].inc()
        return out


class _StreamRewriter:
    """Relays a tracked stream: reports progress, removes the usage the client did not ask for."""

    def __init__(self, guard: GuardApp, ticket: Ticket, req: GenerationRequest) -> None:
        self.guard = guard
        self.ticket = ticket
        self.splitter = SseSplitter()
        self.include_usage, self.continuous = client_usage_wishes(req.body)
        self.prompt_tokens: int | None = None

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send the client for ``chunk`` (complete events only)."""
        out: list[bytes] = []
        for payload in self.splitter.feed(chunk):
            if payload == _DONE:
                out.append(b"data: [DONE]\n\n")
                continue
            try:
                event = json.loads(payload)
            except ValueError:
                event = None
            if not isinstance(event, dict):
                out.append(b"data: " + payload + b"\n\n")
                continue
            p = self.guard._note_event(self.ticket, event)
            if p is not None:
                self.prompt_tokens = p if self.prompt_tokens is None else max(self.prompt_tokens, p)
            if is_usage_only(event):
                if self.include_usage:
                    out.append(b"data: " + payload + b"\n\n")
                continue
            if not self.continuous:
                payload = strip_usage(payload, event)
            out.append(b"data: " + payload + b"\n\n")
        return b"".join(out)


def _trackable(req: GenerationRequest) -> bool:
    """Whether the request's progress can be read: streams, and convertible non-streams."""
    body = req.body
    if req.kind not in ("completions", "chat") or body.get("use_beam_search"):
        return False
    if req.stream:
        return True
    return not any(body.get(k) not in (None, False) for k in _NOT_CONVERTIBLE)


_APP_KEY = web.AppKey("oomguard_guard", GuardApp)


def create_app(config: GuardConfig) -> web.Application:
    """Build the gateway's aiohttp application (pollers start with the app).

    Serve it with ``handler_cancellation=True`` (as :func:`run_guard` and :func:`start_guard`
    do) so a client that disconnects leaves the queue and frees its reservation at once.
    """
    guard = GuardApp(config)
    app = web.Application(middlewares=[_error_middleware], client_max_size=config.max_body_bytes)
    app[_APP_KEY] = guard
    app.on_startup.append(guard.startup)
    app.on_cleanup.append(guard.cleanup)
    r = app.router
    for path, kind in ROUTES.items():
        r.add_post(path, guard.handler(kind))
    r.add_get("/v1/models", guard.models)
    r.add_get("/health", guard.health)
    r.add_get("/ready", guard.ready)
    r.add_get("/metrics", guard.metrics)
    r.add_get("/status", guard.status)
    r.add_route("*", "/v1/{tail:.*}", guard.passthrough)
    return app


def guard_state(app: web.Application) -> GuardApp:
    """The :class:`GuardApp` behind an application made by :func:`create_app`."""
    return app[_APP_KEY]


@dataclass
class GuardServer:
    """A running gateway (see :func:`start_guard`)."""

    runner: web.AppRunner
    url: str
    app: web.Application

    @property
    def state(self) -> GuardApp:
        return guard_state(self.app)

    async def stop(self) -> None:
        """Stop serving and close the pollers and upstream connections."""
        await self.runner.cleanup()


async def start_guard(config: GuardConfig) -> GuardServer:
    """Start the gateway on the running event loop; ``config.port`` 0 picks a free port."""
    app = create_app(config)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    return GuardServer(runner=runner, url=f"http://{host}:{port}", app=app)


def run_guard(config: GuardConfig) -> None:
    """Serve the gateway until interrupted (blocking).

    One process, or with ``workers`` > 1 that many processes listening on the same port
    (``SO_REUSEPORT``: the kernel spreads connections over them), each a replica on the shared
    Redis state; a worker that dies is started again.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if config.workers <= 1:
        _serve_one(config, reuse_port=False)
        return
    from oomguard.guard.workers import run_workers

    run_workers(config, _serve_worker)


def _serve_worker(config: GuardConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _serve_one(config, reuse_port=True)


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    """The event loop a guard process serves on: uvloop's when ``kind`` is ``uvloop`` and it
    is installed (libuv does the socket work of each relayed request in C), else asyncio's."""
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed: serving on asyncio's event loop")
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _serve_one(config: GuardConfig, reuse_port: bool) -> None:
    web.run_app(
        create_app(config),
        host=config.host,
        port=config.port,
        access_log=None,
        handler_cancellation=True,
        reuse_port=reuse_port or None,
        print=lambda msg: log.info("%s", msg),
        loop=new_event_loop(config.event_loop),
    )
