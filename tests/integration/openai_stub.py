"""A small OpenAI-compatible completion server that is not vLLM: no ``/metrics``, no
``/tokenize``. It streams ``max_tokens`` chunks at a fixed pace and reports usage, counting
prompt tokens with a given ``tokenizer.json``. bench must run against it with client figures
only, and say so.

Runs on its own event loop in a thread: ``with OpenAIStub(tokenizer_json) as stub: stub.url``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web


class OpenAIStub:
    """The server, on 127.0.0.1 and a free port, while the ``with`` block runs."""

    def __init__(
        self, tokenizer_json: Path, model: str = "stub-model", token_s: float = 0.002
    ) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.model, self.token_s = model, token_s
        self.completions = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _models(self, _r: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _health(self, _r: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body: dict[str, Any] = await request.json()
        prompt_tokens = len(self.tokenizer.encode(str(body.get("prompt", ""))).ids)
        max_tokens = int(body.get("max_tokens", 16))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = time.monotonic()
        for i in range(1, max_tokens + 1):
            await asyncio.sleep(max(0.0, start + i * self.token_s - time.monotonic()))
            event = {
                "choices": [{"index": 0, "text": " tok"}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": i},
            }
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        self.completions += 1
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
