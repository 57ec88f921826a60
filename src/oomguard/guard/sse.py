"""Reading vLLM's OpenAI-style event streams (pure: bytes in, values out).

The gateway reads the stream of a request whose progress it tracks: it asks the backend for
``stream_options: {"include_usage": true, "continuous_usage_stats": true}`` (vLLM then puts the
choice's ``completion_tokens`` so far on every chunk; ``vllm/entrypoints/openai/completion/
serving.py`` and ``chat_completion/serving.py``), counts the tokens, and

* for a streamed request, relays the events with what the client did not ask for removed
  (:func:`strip_usage`, and the final usage-only chunk dropped);
* for a non-streamed request, assembles the ordinary response from the chunks
  (:class:`StreamAssembler`): text or message content, reasoning, tool calls merged by index,
  logprobs, finish and stop reasons, usage, one choice per index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_USAGE_KEY = b',"usage":{'


class SseSplitter:
    """Cuts a byte stream into complete ``data:`` events (the payload after ``data:``).

    Events are separated by a blank line; comment and other field lines are ignored. Bytes of
    an unfinished event are kept for the next :meth:`feed`.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events' payloads in ``chunk`` (and what was left from before)."""
        data = self._buf + chunk
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        parts = data.split(b"\n\n")
        self._buf = parts.pop()
        out: list[bytes] = []
        for raw in parts:
            payload = _payload(raw)
            if payload is not None:
                out.append(payload)
        return out

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated by a blank line."""
        return self._buf


def _payload(raw: bytes) -> bytes | None:
    lines = [ln[5:].lstrip(b" ") for ln in raw.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(lines)


def _usage_span(payload: bytes) -> tuple[int, int] | None:
    """Start and end of ``,"usage":{...}`` in a chunk serialized by vLLM, or None.

    Inside a JSON string a quote is escaped, so ``,"usage":{`` can only be the key of an
    object; the top-level one is the last such occurrence. The usage object holds numbers,
    nulls and flat objects of numbers, so matching braces finds its end.
    """
    start = payload.rfind(_USAGE_KEY)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_USAGE_KEY) - 1, len(payload)):
        c = payload[i]
        if c == 0x7B:  # {
            depth += 1
        elif c == 0x7D:  # }
            depth -= 1
            if depth == 0:
                return start, i + 1
        elif c == 0x22:  # a string inside usage: not vLLM's shape
            return None
    return None


def strip_usage(payload: bytes, event: dict[str, Any]) -> bytes:
    """``payload`` without its top-level ``usage`` (``event`` is the parsed payload)."""
    if "usage" not in event:
        return payload
    span = _usage_span(payload)
    if span is not None:
        stripped = payload[: span[0]] + payload[span[1] :]
        if stripped.endswith(b"}"):
            return stripped
    rest = {k: v for k, v in event.items() if k != "usage"}
    return json.dumps(rest, separators=(",", ":")).encode()


@dataclass(frozen=True)
class ChunkProgress:
    """What one chunk says about one choice: tokens so far, and whether it finished."""

    index: int
    completion_tokens: int | None
    prompt_tokens: int | None
    finished: bool


def chunk_progress(event: dict[str, Any]) -> list[ChunkProgress]:
    """Progress per choice in one parsed chunk (empty for a usage-only or error chunk).

    vLLM puts one choice on each chunk; its ``usage`` (with continuous usage stats) is that
    choice's count. A chunk with several choices gets no count from ``usage``.
    """
    choices = event.get("choices")
    if not isinstance(choices, list) or not choices:
        return []
    usage = event.get("usage")
    completion: int | None = None
    prompt: int | None = None
    if isinstance(usage, dict) and len(choices) == 1:
        c, p = usage.get("completion_tokens"), usage.get("prompt_tokens")
        completion = c if isinstance(c, int) and not isinstance(c, bool) else None
        prompt = p if isinstance(p, int) and not isinstance(p, bool) else None
    out: list[ChunkProgress] = []
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        idx = ch.get("index")
        if not isinstance(idx, int) or isinstance(idx, bool):
            continue
        out.append(ChunkProgress(idx, completion, prompt, ch.get("finish_reason") is not None))
    return out


def is_usage_only(event: dict[str, Any]) -> bool:
    """The final chunk vLLM sends for ``include_usage``: no choices, a usage."""
    return event.get("choices") == [] and isinstance(event.get("usage"), dict)


def client_usage_wishes(body: dict[str, Any]) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats) as the client asked in ``stream_options``."""
    opts = body.get("stream_options")
    if not isinstance(opts, dict):
        return False, False
    include = opts.get("include_usage") is True
    return include, include and opts.get("continuous_usage_stats") is True


def with_progress_stream(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` that streams with per-chunk usage (the client's options kept)."""
    opts = body.get("stream_options")
    merged = dict(opts) if isinstance(opts, dict) else {}
    merged["include_usage"] = True
    merged["continuous_usage_stats"] = True
    return {**body, "stream": True, "stream_options": merged}


def _concat(a: str | None, b: Any) -> str | None:
    if not isinstance(b, str):
        return a
    return b if a is None else a + b


@dataclass
class _Choice:
    index: int
    text: str | None = None
    role: str | None = None
    extra_text: dict[str, str] = field(default_factory=dict)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    other: dict[str, Any] = field(default_factory=dict)


# Delta fields that are text pieces to concatenate (vLLM's reasoning under either name).
_DELTA_TEXT = ("reasoning", "reasoning_content", "refusal")
_CHOICE_KEYS = {
    "index",
    "text",
    "delta",
    "logprobs",
    "finish_reason",
    "stop_reason",
    "token_ids",
    "prompt_token_ids",
}


class StreamAssembler:
    """Builds a non-streamed completion (or chat completion) from the chunks of its stream."""

    def __init__(self, *, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {}
        self.usage: dict[str, Any] | None = None
        self.system_fingerprint: Any = None
        self._choices: dict[int, _Choice] = {}
        self._top_extra: dict[str, Any] = {}

    def add(self, event: dict[str, Any]) -> None:
        """Merge one parsed chunk."""
        if not self.head:
            for k in ("id", "created", "model"):
                if k in event:
                    self.head[k] = event[k]
        usage = event.get("usage")
        if is_usage_only(event):
            self.usage = usage
        if event.get("system_fingerprint") is not None:
            self.system_fingerprint = event["system_fingerprint"]
        for k in ("prompt_token_ids", "prompt_text", "kv_transfer_params"):
            if event.get(k) is not None:
                self._top_extra[k] = event[k]
        for ch in event.get("choices") or []:
            if isinstance(ch, dict) and isinstance(ch.get("index"), int):
                self._merge_choice(ch)

    def _merge_choice(self, ch: dict[str, Any]) -> None:
        idx = ch["index"]
        c = self._choices.get(idx)
        if c is None:
            c = self._choices[idx] = _Choice(idx)
        if self.chat:
            delta = ch.get("delta")
            if isinstance(delta, dict):
                self._merge_delta(c, delta)
        else:
            c.text = _concat(c.text, ch.get("text"))
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            c.logprobs = _merge_logprobs(c.logprobs, lp)
        if ch.get("finish_reason") is not None:
            c.finish_reason = ch["finish_reason"]
            c.stop_reason = ch.get("stop_reason")
        ids = ch.get("token_ids")
        if isinstance(ids, list):
            c.token_ids = (c.token_ids or []) + ids
        pids = ch.get("prompt_token_ids")
        if isinstance(pids, list) and c.prompt_token_ids is None:
            c.prompt_token_ids = pids
        for k, v in ch.items():
            if k not in _CHOICE_KEYS and v is not None:
                c.other[k] = v

    def _merge_delta(self, c: _Choice, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("role"), str):
            c.role = delta["role"]
        if isinstance(delta.get("content"), str):
            c.text = _concat(c.text, delta["content"])
        for key in _DELTA_TEXT:
            if isinstance(delta.get(key), str):
                c.extra_text[key] = c.extra_text.get(key, "") + delta[key]
        for tc in delta.get("tool_calls") or []:
            if not isinstance(tc, dict):
                continue
            i = tc.get("index", len(c.tool_calls))
            if not isinstance(i, int):
                continue
            acc = c.tool_calls.setdefault(
                i, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            if tc.get("id"):
                acc["id"] = tc["id"]
            if tc.get("type"):
                acc["type"] = tc["type"]
            fn = tc.get("function")
            if isinstance(fn, dict):
                if isinstance(fn.get("name"), str):
                    acc["function"]["name"] += fn["name"]
                if isinstance(fn.get("arguments"), str):
                    acc["function"]["arguments"] += fn["arguments"]

    def result(self) -> dict[str, Any]:
        """The assembled response body (``usage`` from the final usage chunk)."""
        choices = [self._render(self._choices[i]) for i in sorted(self._choices)]
        body: dict[str, Any] = {
            "id": self.head.get("id"),
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.head.get("created"),
            "model": self.head.get("model"),
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": self.system_fingerprint,
            "usage": self.usage,
        }
        if self.chat and "prompt_token_ids" in self._top_extra:
            body["prompt_token_ids"] = self._top_extra["prompt_token_ids"]
        for k in ("prompt_text", "kv_transfer_params"):
            if k in self._top_extra:
                body[k] = self._top_extra[k]
        return body

    def _render(self, c: _Choice) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": c.role or "assistant", "content": c.text}
            message["refusal"] = c.extra_text.get("refusal")
            for key in ("reasoning", "reasoning_content"):
                if key in c.extra_text:
                    message[key] = c.extra_text[key]
            if c.tool_calls:
                message["tool_calls"] = [c.tool_calls[i] for i in sorted(c.tool_calls)]
            out: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
        else:
            out = {
                "index": c.index,
                "text": c.text or "",
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if c.prompt_token_ids is not None:
                out["prompt_token_ids"] = c.prompt_token_ids
        if c.token_ids is not None:
            out["token_ids"] = c.token_ids
        out.update(c.other)
        return out


def _merge_logprobs(acc: dict[str, Any] | None, lp: dict[str, Any]) -> dict[str, Any]:
    """Concatenate logprob lists (completions: text_offset, tokens, …; chat: content)."""
    if acc is None:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in lp.items()}
    for k, v in lp.items():
        if isinstance(v, list):
            prev = acc.get(k)
            acc[k] = (prev if isinstance(prev, list) else []) + v
        elif k not in acc or acc[k] is None:
            acc[k] = v
    return acc


def stream_error(event: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """(HTTP status, error body) when ``event`` is an error event, else None."""
    err = event.get("error")
    if err is None:
        return None
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    body = err if isinstance(err, dict) else {"message": str(err)}
    return status, {"error": body}
