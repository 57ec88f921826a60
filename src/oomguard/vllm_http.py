"""How oomguard's HTTP clients hold connections to vLLM's OpenAI server.

vLLM serves through uvicorn, which closes a keep-alive connection after 5 s idle
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, default 5, ``vllm/envs.py``). A client that reuses an idle
connection near that moment sometimes writes its request into a connection the server is
closing, and the request fails before the server read it. Two defences, both here and used by
every client of oomguard that talks to vLLM:

- idle connections are dropped well before the server drops them (``KEEPALIVE_S``);
- a request whose *reused* connection was closed before any response arrived is sent again on
  another connection (``stale_retry``). A fresh connection that fails is a real failure and is
  not retried. The server closes an idle connection only when no request is being read on
  it, so the first attempt never reached it: sending again cannot run a request twice. The
  client's own clock can run late on a loaded machine (its event loop stalls for a second or
  more), so the idle limit alone cannot prevent the race; the retry closes it.
"""

from __future__ import annotations

import contextvars
from typing import Any

import aiohttp

KEEPALIVE_S = 2.0  # well below uvicorn's 5 s in vLLM's server
MAX_STALE_RETRIES = 8  # each retry closes one stale pooled connection; then a fresh one

# Set by the middleware around each attempt; the connection-pool trace marks it when the
# attempt got a pooled connection. The trace runs in the attempt's own task, so a context
# variable links the two without reaching into aiohttp's internals.
_REUSED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "oomguard_reused", default=None
)


async def _on_reuse(_s: Any, _ctx: Any, _p: Any) -> None:
    box = _REUSED.get()
    if box is not None:
        box[0] = True


def reuse_trace() -> aiohttp.TraceConfig:
    """Marks the running attempt as one on a reused (pooled) connection."""
    tc = aiohttp.TraceConfig()
    tc.on_connection_reuseconn.append(_on_reuse)
    return tc


async def stale_retry(
    req: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
) -> aiohttp.ClientResponse:
    """Client middleware: send once more when a reused connection was closed under the
    request before its response began (see the module's note)."""
    for attempt in range(MAX_STALE_RETRIES + 1):
        box = [False]
        token = _REUSED.set(box)
        try:
            return await handler(req)
        except aiohttp.ClientConnectorError:
            raise  # could not connect at all: not a stale connection
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if not box[0] or attempt == MAX_STALE_RETRIES:
                raise
        finally:
            _REUSED.reset(token)
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def connector(**kwargs: Any) -> aiohttp.TCPConnector:
    """A connection pool whose idle connections close before vLLM's server closes them."""
    return aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, **kwargs)


def session(
    *, trace_configs: list[aiohttp.TraceConfig] | None = None, **kwargs: Any
) -> aiohttp.ClientSession:
    """A client session to vLLM: the pool of ``connector`` (its arguments: ``limit``,
    ``limit_per_host``, ``ttl_dns_cache``) and the stale-connection retry; other arguments go
    to ``aiohttp.ClientSession``."""
    pool = {k: kwargs.pop(k) for k in ("limit", "limit_per_host", "ttl_dns_cache") if k in kwargs}
    return aiohttp.ClientSession(
        connector=connector(**pool),
        trace_configs=[*(trace_configs or []), reuse_trace()],
        middlewares=(stale_retry,),
        **kwargs,
    )
