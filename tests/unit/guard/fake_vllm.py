"""A small stand-in for vLLM's OpenAI server, for the guard's tests (a real HTTP server).

Serves ``/v1/completions`` and ``/v1/chat/completions`` (streamed and not), ``/tokenize``,
``/v1/models``, ``/health`` and ``/metrics`` with vLLM's metric names (``vllm:kv_cache_usage_perc``,
``vllm:num_preemptions_total``, ``vllm:num_requests_waiting``/``running``,
``vllm:cache_config_info{num_gpu_blocks,block_size}``). Tokens are whitespace-separated words
(+1 for BOS; chat adds 4 per message). KV use is simulated from the running requests' blocks;
a request that does not fit is *preempted* (counted) and waits, like vLLM's recompute.

Streams honour ``stream_options`` like vLLM: ``include_usage`` adds a final usage-only chunk,
``continuous_usage_stats`` puts the choice's token count so far on every chunk.

Knobs: first-token delay, a hold (an event admitted requests wait on), token rate, pool size; per
request, header ``x-fake-cut-after: N`` aborts the connection after N streamed tokens,
``x-fake-tokens: N`` generates N tokens instead of max_tokens. ``POST /_control`` with
``{"fail_next": k}`` makes the next k generation requests answer 503. Run as a script (``python
fake_vllm.py --port N``) to have a process to SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class FakeState:
    model: str = "fake-model"
    max_model_len: int = 1024
    num_gpu_blocks: int = 129  # 128 usable
    block_size: int = 16
    delay_s: float = 0.0
    hold: asyncio.Event | None = None  # when given, admitted requests wait until it is set
    token_rate: float = 0.0  # tokens per second; 0 = instant
    running_blocks: int = 0
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    fail_next: int = 0
    requests_seen: int = 0
    completed: int = 0
    peak_running_blocks: int = 0
    tokenize_calls: int = 0
    streams_with_usage: int = 0
    tokenize_delay_s: float = 0.0
    tokenize_active: int = 0
    tokenize_peak: int = 0
    # When given, a streamed Responses/Messages answer waits on it after its first delta.
    stream_gate: asyncio.Event | None = None
    # ``root`` in /v1/models (where vLLM loaded the model from); a counting function for
    # /tokenize's body instead of the word count.
    root: str | None = None
    tokenize_count: Any = None
    active_transports: set[Any] = field(default_factory=set)

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1


def count_prompt(prompt: Any) -> int:
    if isinstance(prompt, list):
        return len(prompt)
    return len(str(prompt).split()) + 1


def count_messages(messages: list[dict[str, Any]]) -> int:
    total = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += len(str(content or "").split()) + 4
    return total + 2


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return web.json_response(body, status=status)


class FakeVllm:
    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.app = web.Application()
        r = self.app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/responses", self.responses)
        r.add_post("/v1/messages", self.messages)
        r.add_post("/tokenize", self.tokenize)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self.metrics)
        r.add_post("/_control", self.control)
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self, port: int = 0) -> str:
        self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        host, real_port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{real_port}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def kill(self) -> None:
        """Die abruptly: reset every open connection, then stop listening."""
        for t in list(self.state.active_transports):
            t.abort()
        if self.runner is not None:
            for site in list(self.runner.sites):
                await site.stop()
        await self.stop()

    # -- endpoints ----------------------------------------------------------------------
    async def health(self, _r: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _r: web.Request) -> web.Response:
        s = self.state
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": s.model,
                        "object": "model",
                        "owned_by": "vllm",
                        "max_model_len": s.max_model_len,
                        **({"root": s.root} if s.root else {}),
                    }
                ],
            }
        )

    async def metrics(self, _r: web.Request) -> web.Response:
        s = self.state
        usage = min(s.running_blocks / s.usable_blocks, 1.0)
        lab = f'engine="0",model_name="{s.model}"'
        text = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{lab}}} {float(s.running)}
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{lab}}} {float(s.waiting)}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{lab}}} {usage}
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{{lab}}} {float(s.preemptions)}
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="{s.block_size}",cache_dtype="auto",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",\
num_gpu_blocks="{s.num_gpu_blocks}",num_gpu_blocks_override="None"}} 1.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{{lab}}} 0.0
"""
        return web.Response(text=text, content_type="text/plain")

    async def control(self, r: web.Request) -> web.Response:
        body = await r.json()
        for k, v in body.items():
            setattr(self.state, k, v)
        return web.json_response({"ok": True})

    async def tokenize(self, r: web.Request) -> web.Response:
        s = self.state
        s.tokenize_calls += 1
        s.tokenize_active += 1
        s.tokenize_peak = max(s.tokenize_peak, s.tokenize_active)
        try:
            if s.tokenize_delay_s:
                await asyncio.sleep(s.tokenize_delay_s)
        finally:
            s.tokenize_active -= 1
        body = await r.json()
        if body.get("model") not in (None, s.model):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        if s.tokenize_count is not None:
            count = s.tokenize_count(body)
        elif "messages" in body:
            count = count_messages(body["messages"])
        else:
            count = count_prompt(body.get("prompt", ""))
        return web.json_response(
            {"count": count, "tokens": list(range(count)), "max_model_len": s.max_model_len}
        )

    async def completions(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        prompt = body.get("prompt", "")
        prompts = (
            prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
            else [prompt]
        )
        return await self._generate(r, body, max(count_prompt(p) for p in prompts), chat=False)

    async def chat(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        return await self._generate(r, body, count_messages(body.get("messages", [])), chat=True)

    async def _generate(
        self, r: web.Request, body: dict[str, Any], prompt_tokens: int, chat: bool
    ) -> web.StreamResponse:
        s = self.state
        s.requests_seen += 1
        if s.fail_next > 0:
            s.fail_next -= 1
            return _error(503, "engine is shutting down")
        if body.get("model") not in (None, s.model):
            return _error(404, f"The model `{body.get('model')}` does not exist.")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None:
            max_tokens = s.max_model_len - prompt_tokens
        if prompt_tokens + max_tokens > s.max_model_len:
            return _error(
                400,
                f"This model's maximum context length is {s.max_model_len} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens.",
            )
        n_tokens = min(int(r.headers.get("x-fake-tokens", max_tokens)), max_tokens)
        cut_after = r.headers.get("x-fake-cut-after")
        blocks = math.ceil((prompt_tokens + max_tokens) / s.block_size)
        if r.transport is not None:
            s.active_transports.add(r.transport)
        # Admission like the engine's: if the blocks are not there, count a preemption and wait.
        if s.running_blocks + blocks > s.usable_blocks and s.running > 0:
            s.preemptions += 1
            s.waiting += 1
            try:
                while s.running_blocks + blocks > s.usable_blocks and s.running > 0:
                    await asyncio.sleep(0.005)
            finally:
                s.waiting -= 1
        s.running += 1
        s.running_blocks += blocks
        s.peak_running_blocks = max(s.peak_running_blocks, s.running_blocks)
        try:
            if s.hold is not None:
                await s.hold.wait()
            if s.delay_s:
                await asyncio.sleep(s.delay_s)
            rid = f"cmpl-{s.requests_seen}"
            created = int(time.time())
            if body.get("stream"):
                opts = body.get("stream_options") or {}
                include_usage = opts.get("include_usage") is True
                continuous = include_usage and opts.get("continuous_usage_stats") is True
                s.streams_with_usage += int(continuous)
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(r)
                for i in range(n_tokens):
                    if cut_after is not None and i >= int(cut_after):
                        if r.transport is not None:
                            r.transport.abort()
                        return resp
                    if s.token_rate:
                        await asyncio.sleep(1.0 / s.token_rate)
                    if chat:
                        choice: dict[str, Any] = {"index": 0, "delta": {"content": " tok"}}
                        obj = "chat.completion.chunk"
                    else:
                        choice = {"index": 0, "text": " tok"}
                        obj = "text_completion"
                    choice["finish_reason"] = "length" if i == n_tokens - 1 else None
                    chunk: dict[str, Any] = {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": s.model,
                        "choices": [choice],
                    }
                    if continuous:  # like vLLM: the choice's count so far, on every chunk
                        chunk["usage"] = {
                            "prompt_tokens": prompt_tokens,
                            "total_tokens": prompt_tokens + i + 1,
                            "completion_tokens": i + 1,
                        }
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                if include_usage:
                    final = {
                        "id": rid,
                        "object": obj,
                        "created": created,
                        "model": s.model,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": prompt_tokens,
                            "total_tokens": prompt_tokens + n_tokens,
                            "completion_tokens": n_tokens,
                        },
                    }
                    await resp.write(b"data: " + json.dumps(final).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                s.completed += 1
                return resp
            if s.token_rate:
                await asyncio.sleep(n_tokens / s.token_rate)
            text = " tok" * n_tokens
            if chat:
                choices: list[dict[str, Any]] = [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": "length",
                    }
                ]
                obj = "chat.completion"
            else:
                choices = [{"index": 0, "text": text, "finish_reason": "length"}]
                obj = "text_completion"
            s.completed += 1
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": s.model,
                    "choices": choices,
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": n_tokens,
                        "total_tokens": prompt_tokens + n_tokens,
                    },
                }
            )
        finally:
            s.running -= 1
            s.running_blocks -= blocks
            if r.transport is not None:
                s.active_transports.discard(r.transport)

    async def _events(
        self, r: web.Request, prompt_tokens: int, n_tokens: int, events: Any
    ) -> web.StreamResponse:
        """Stream named SSE events (Responses / Messages style), holding a KV slot meanwhile."""
        s = self.state
        s.requests_seen += 1
        s.running += 1
        blocks = math.ceil((prompt_tokens + n_tokens) / s.block_size)
        s.running_blocks += blocks
        s.peak_running_blocks = max(s.peak_running_blocks, s.running_blocks)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(r)
            for i, (name, payload) in enumerate(events):
                await resp.write(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode())
                if i == 1 and s.stream_gate is not None:
                    await s.stream_gate.wait()
                elif s.token_rate:
                    await asyncio.sleep(1.0 / s.token_rate)
            await resp.write_eof()
            s.completed += 1
            return resp
        finally:
            s.running -= 1
            s.running_blocks -= blocks

    async def responses(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        text = body.get("input")
        prompt = count_prompt(text) if isinstance(text, str) else count_messages(text or [])
        n = int(body.get("max_output_tokens") or 16)
        if not body.get("stream"):
            self.state.requests_seen += 1
            self.state.completed += 1
            return web.json_response(
                {
                    "id": "resp-1",
                    "object": "response",
                    "status": "completed",
                    "output": [{"type": "message", "content": [{"text": " tok" * n}]}],
                    "usage": {"input_tokens": prompt, "output_tokens": n},
                }
            )
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.created", {"type": "response.created"})
        ]
        events += [
            ("response.output_text.delta", {"type": "response.output_text.delta", "delta": " tok"})
            for _ in range(n)
        ]
        events.append(("response.completed", {"type": "response.completed"}))
        return await self._events(r, prompt, n, events)

    async def messages(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        prompt = count_messages(body.get("messages") or [])
        n = int(body.get("max_tokens") or 16)
        if not body.get("stream"):
            self.state.requests_seen += 1
            self.state.completed += 1
            return web.json_response(
                {
                    "id": "msg-1",
                    "type": "message",
                    "content": [{"type": "text", "text": " tok" * n}],
                    "usage": {"input_tokens": prompt, "output_tokens": n},
                }
            )
        events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start"})]
        events += [
            (
                "content_block_delta",
                {"type": "content_block_delta", "delta": {"type": "text_delta", "text": " tok"}},
            )
            for _ in range(n)
        ]
        events.append(("message_stop", {"type": "message_stop"}))
        return await self._events(r, prompt, n, events)


async def start_fake(port: int = 0, **kwargs: Any) -> FakeVllm:
    """Start a fake server on 127.0.0.1 in this event loop."""
    fake = FakeVllm(FakeState(**kwargs))
    await fake.start(port)
    return fake


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--num-gpu-blocks", type=int, default=129)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--token-rate", type=float, default=0.0)
    a = ap.parse_args()
    state = FakeState(
        max_model_len=a.max_model_len,
        num_gpu_blocks=a.num_gpu_blocks,
        block_size=a.block_size,
        delay_s=a.delay,
        token_rate=a.token_rate,
    )
    web.run_app(FakeVllm(state).app, host="127.0.0.1", port=a.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
