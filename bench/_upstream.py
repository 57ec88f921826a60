"""A minimal, fast OpenAI-style upstream for the overhead benchmark (asyncio protocol, no
framework).

HTTP/1.1 with keep-alive on 127.0.0.1. Answers at once (no model): ``POST /v1/completions`` and
``/v1/chat/completions`` with a fixed completion (SSE when ``"stream": true``; with
``continuous_usage_stats`` each chunk carries the token count so far, as vLLM does),
``POST /tokenize`` (a whitespace word count; with ``--tokenizer FILE`` a real count by that
``tokenizer.json``; with ``--model-dir DIR`` the count vLLM makes, chat template included, and
``root`` in ``/v1/models`` naming DIR, so the guard finds the tokenizer), ``GET /v1/models``,
``/health`` and a
``/metrics`` page in vLLM's names with a large KV pool, so the gateway never queues. The point
is that the upstream costs as little as possible, so what the benchmark measures is the proxy.

Run: ``python bench/_upstream.py --port 18000 [--tokenizer PATH/tokenizer.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

MODEL = "bench-model"

_COMPLETION = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [{"index": 0, "text": " ok ok ok ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12},
    }
).encode()
_CHAT = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok ok ok ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12},
    }
).encode()
_MODELS = json.dumps(
    {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 8192}]}
).encode()
_METRICS = (
    "# TYPE vllm:num_requests_running gauge\n"
    f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:num_requests_waiting gauge\n"
    f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:num_preemptions_total counter\n"
    f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}} 0.0\n'
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000001"} 1.0\n'
).encode()
_SSE = (
    b'data: {"id":"cmpl-bench","object":"text_completion","model":"bench-model",'
    b'"choices":[{"index":0,"text":" ok","finish_reason":null}]}\n\n'
) * 4 + b"data: [DONE]\n\n"


def _response(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + ctype
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: keep-alive\r\n\r\n"
        + body
    )


_R_COMPLETION = _response(b"200 OK", _COMPLETION)
_R_CHAT = _response(b"200 OK", _CHAT)
_R_MODELS = _response(b"200 OK", _MODELS)
_R_METRICS = _response(b"200 OK", _METRICS, b"text/plain; version=0.0.4")
_R_HEALTH = _response(b"200 OK", b"")
_R_STREAM = _response(b"200 OK", _SSE, b"text/event-stream")
_R_404 = _response(b"404 Not Found", b'{"error":{"message":"not found","code":404}}')


def _usage_sse(chat: bool) -> bytes:
    """Four chunks, each with the choice's token count so far, then the usage-only chunk."""
    out = []
    for i in range(1, 5):
        choice = (
            {"index": 0, "delta": {"content": " ok"}, "finish_reason": "length" if i == 4 else None}
            if chat
            else {"index": 0, "text": " ok", "finish_reason": "length" if i == 4 else None}
        )
        usage = {"prompt_tokens": 8, "completion_tokens": i, "total_tokens": 8 + i}
        event = {"id": "cmpl-bench", "model": MODEL, "choices": [choice], "usage": usage}
        out.append(b"data: " + json.dumps(event).encode() + b"\n\n")
    final = {"id": "cmpl-bench", "model": MODEL, "choices": [], "usage": usage}
    out.append(b"data: " + json.dumps(final).encode() + b"\n\ndata: [DONE]\n\n")
    return b"".join(out)


_R_USAGE_STREAM = _response(b"200 OK", _usage_sse(False), b"text/event-stream")
_R_USAGE_STREAM_CHAT = _response(b"200 OK", _usage_sse(True), b"text/event-stream")
_TOKENIZER: object | None = None
_MODEL_TOKENIZER: object | None = None


def _count_tokens(body: bytes) -> int:
    try:
        req = json.loads(body)
    except ValueError:
        return 1
    if _MODEL_TOKENIZER is not None:
        from oomguard.guard.openai_body import parse_generation
        from oomguard.guard.tokenizer import count_request

        parsed = parse_generation(req, chat="messages" in req)
        counts = count_request(_MODEL_TOKENIZER, parsed, None)  # type: ignore[arg-type]
        return counts[0] if counts else 1
    if "messages" in req:
        text = " ".join(str(m.get("content", "")) for m in req["messages"] if isinstance(m, dict))
    else:
        text = str(req.get("prompt", ""))
    if _TOKENIZER is not None:
        return len(_TOKENIZER.encode(text).ids)  # type: ignore[attr-defined]
    return len(text.split()) + 1


class _Http(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end]
            length = 0
            lower = head.lower()
            i = lower.find(b"content-length:")
            if i >= 0:
                j = lower.find(b"\r\n", i)
                length = int(lower[i + 15 : j if j > 0 else None].strip())
            total = head_end + 4 + length
            if len(self.buf) < total:
                return
            body = self.buf[head_end + 4 : total]
            self.buf = self.buf[total:]
            line = head[: head.find(b"\r\n")] if b"\r\n" in head else head
            parts = line.split(b" ")
            method, path = parts[0], parts[1] if len(parts) > 1 else b"/"
            assert self.transport is not None
            self.transport.write(self._answer(method, path, body))

    def _answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        stream = b'"stream": true' in body or b'"stream":true' in body
        usage = b"continuous_usage_stats" in body
        if path == b"/v1/completions":
            if stream:
                return _R_USAGE_STREAM if usage else _R_STREAM
            return _R_COMPLETION
        if path == b"/v1/chat/completions":
            return _R_USAGE_STREAM_CHAT if stream else _R_CHAT
        if path == b"/tokenize":
            count = _count_tokens(body)
            return _response(b"200 OK", b'{"count":%d,"tokens":[],"max_model_len":8192}' % count)
        if path == b"/v1/models":
            return _R_MODELS
        if path == b"/metrics":
            return _R_METRICS
        if path == b"/health":
            return _R_HEALTH
        return _R_404


async def serve(port: int) -> None:
    """Serve until cancelled."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, "127.0.0.1", port, reuse_address=True, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, default=18000)
    ap.add_argument("--tokenizer", help="a tokenizer.json: /tokenize counts with it")
    ap.add_argument(
        "--model-dir",
        help="a model directory: /v1/models names it as root (where vLLM loaded the model "
        "from) and /tokenize counts as vLLM does, chat template included",
    )
    args = ap.parse_args()
    if args.model_dir:
        from oomguard.guard.tokenizer import ModelTokenizer

        global _MODEL_TOKENIZER, _R_MODELS
        _MODEL_TOKENIZER = ModelTokenizer.load(Path(args.model_dir))
        models = json.loads(_MODELS)
        models["data"][0]["root"] = args.model_dir
        _R_MODELS = _response(b"200 OK", json.dumps(models).encode())
    if args.tokenizer:
        from tokenizers import Tokenizer

        global _TOKENIZER
        _TOKENIZER = Tokenizer.from_file(args.tokenizer)
    try:
        asyncio.run(serve(args.port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
