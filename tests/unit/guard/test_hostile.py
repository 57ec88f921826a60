"""Hostile input: random methods, paths, headers and bodies against the gateway's own routes
never produce a 500 and never bring it down (hypothesis, real HTTP)."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomguard.guard import start_guard
from oomguard.guard.config import build_config

from .fake_vllm import start_fake

# Statuses the storm produced, so the follow-up test can check it reached real code paths.
SEEN: Counter[int] = Counter()


class _Servers:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        fake = await start_fake()
        guard = await start_guard(
            build_config(
                {
                    "backends": [fake.url],
                    "port": 0,
                    "max_body_bytes": 64 * 1024,
                    "max_queue_requests": 8,
                    "queue_timeout_s": 2,
                    "retry_wait_s": 2,
                }
            )
        )
        self.port = int(guard.url.rsplit(":", 1)[1])
        self.ready.set()
        await self._stop.wait()
        await guard.stop()
        await fake.stop()

    def stop(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def guard_port() -> Iterator[int]:
    servers = _Servers()
    servers.thread.start()
    assert servers.ready.wait(20)
    yield servers.port
    servers.stop()


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)
field_values = st.one_of(
    json_values,
    st.integers(min_value=-5, max_value=5000),
    st.sampled_from(["fake-model", "other", "", None]),
    st.lists(st.integers(min_value=0, max_value=50_000), max_size=10),
)
completion_keys = st.sampled_from(
    [
        "model",
        "prompt",
        "max_tokens",
        "n",
        "best_of",
        "stream",
        "priority",
        "messages",
        "max_completion_tokens",
        "temperature",
        "tools",
        "stream_options",
    ]
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["valid-ish", "json", "bytes", "chat"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    base: dict[str, Any]
    if kind == "chat":
        base = {
            "model": "fake-model",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
        }
    else:
        base = {"model": "fake-model", "prompt": "a b c", "max_tokens": 2}
    for key, value in draw(st.dictionaries(completion_keys, field_values, max_size=4)).items():
        base[key] = value
    return json.dumps(base).encode()


paths = st.one_of(
    st.sampled_from(
        [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/health",
            "/ready",
            "/metrics",
            "/status",
            "/v1/embeddings",
            "/v1/",
            "/",
            "/tokenize",
        ]
    ),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/_-.%?=&", max_size=30).map(
        lambda s: "/" + s
    ),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz/_-.%?=&", max_size=20).map(lambda s: "/v1/" + s),
)
header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
headers = st.dictionaries(
    st.sampled_from(
        [
            "x-priority",
            "x-queue-timeout",
            "content-type",
            "authorization",
            "x-request-id",
            "accept-encoding",
        ]
    ),
    header_values,
    max_size=3,
)


def _send(port: int, method: str, path: str, hdrs: dict[str, str], body: bytes) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        try:
            conn.request(
                method, path, body=body if method not in ("GET", "HEAD") else None, headers=hdrs
            )
        except (ValueError, http.client.InvalidURL):
            return  # the client library refused to send it; nothing reached the gateway
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    SEEN[resp.status] += 1
    assert resp.status != 500, (method, path, hdrs, body[:200], data[:300])
    assert resp.status < 600
    own_route = not path.startswith("/v1/") or path.split("?")[0] in (
        "/v1/completions",
        "/v1/chat/completions",
    )
    if own_route and resp.status >= 400 and method != "HEAD":
        # The gateway's own errors are OpenAI-style; other /v1/* answers are the backend's.
        err = json.loads(data)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert set(err) == {"message", "type", "param", "code"}


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@_settings(300)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    hdrs=headers,
    body=bodies(),
)
def test_generation_routes_never_500(
    guard_port: int, path: str, hdrs: dict[str, str], body: bytes
) -> None:
    _send(guard_port, "POST", path, hdrs, body)


@_settings(150)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    path=paths,
    hdrs=headers,
    body=bodies(),
)
def test_any_route_never_500(
    guard_port: int, method: str, path: str, hdrs: dict[str, str], body: bytes
) -> None:
    _send(guard_port, method, path, hdrs, body)


def test_still_serving_after_the_storm(guard_port: int) -> None:
    if SEEN:  # the storm ran in this session: it must have hit successes and rejections
        assert SEEN[200] > 0 and SEEN[400] > 0 and SEEN[404] > 0, SEEN
    conn = http.client.HTTPConnection("127.0.0.1", guard_port, timeout=10)
    conn.request(
        "POST",
        "/v1/completions",
        body=json.dumps({"model": "fake-model", "prompt": "x", "max_tokens": 1}),
        headers={"content-type": "application/json"},
    )
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200, body
    conn.request("GET", "/status")
    st_ = json.loads(conn.getresponse().read())
    assert st_["queue"]["depth"] == 0
    assert st_["backends"][0]["reserved_blocks"] == 0
    conn.close()
