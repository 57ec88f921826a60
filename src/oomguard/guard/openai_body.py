"""OpenAI-style request checks and error bodies for the gateway (pure, no I/O).

Every client mistake becomes an :class:`ApiError` with a 4xx status and the body shape
OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

MAX_N = 128
PRIORITY_LIMIT = 1_000_000
# Tokens a chat template adds around each message (role markers, separators), and a flat
# guess for a non-text content part (an image or audio clip) when no tokenizer is reachable.
CHAT_TOKENS_PER_MESSAGE = 8
NON_TEXT_PART_TOKENS = 1024


class ApiError(Exception):
    """An HTTP error answered in OpenAI's error format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def payload(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        return json.dumps(self.payload()).encode()


def bad_request(message: str, param: str | None = None) -> ApiError:
    """A 400 for a malformed or invalid request."""
    return ApiError(400, message, param=param, code="invalid_value" if param else 400)


@dataclass
class GenerationRequest:
    """What the gateway needs from a completions / chat body; ``body`` is the parsed JSON."""

    chat: bool
    body: dict[str, Any]
    model: str | None
    stream: bool
    max_tokens: int | None
    num_sequences: int
    priority: int | None
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    if name not in body or body[name] is None:
        return None
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad_request(f"'{name}' must be an integer, got {json.dumps(v)[:40]}", name)
    if v < lo or v > hi:
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {v}", name)
    return int(v)


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v
    )


def parse_priority_header(raw: str | None) -> int | None:
    """The ``x-priority`` header as an int (lower is served earlier), or None if absent."""
    if raw is None:
        return None
    try:
        v = int(raw.strip())
    except ValueError:
        raise bad_request(
            f"header x-priority must be an integer, got {raw[:40]!r}", "x-priority"
        ) from None
    if abs(v) > PRIORITY_LIMIT:
        raise bad_request(
            f"header x-priority must be between -{PRIORITY_LIMIT} and {PRIORITY_LIMIT}",
            "x-priority",
        )
    return v


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object."""
    if not raw:
        raise bad_request("request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def parse_generation(
    body: dict[str, Any], *, chat: bool, max_tokens_limit: int
) -> GenerationRequest:
    """Check a completions (``chat=False``) or chat-completions body; raises ApiError(400)."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("'model' must be a non-empty string", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    max_tokens = _int_field(body, "max_tokens", 0, max_tokens_limit)
    if chat:
        mct = _int_field(body, "max_completion_tokens", 0, max_tokens_limit)
        if mct is not None:
            max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    n = _int_field(body, "n", 1, MAX_N) or 1
    best_of = None if chat else _int_field(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    priority = _int_field(body, "priority", -PRIORITY_LIMIT, PRIORITY_LIMIT)
    req = GenerationRequest(
        chat=chat,
        body=body,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        num_sequences=max(n, best_of or 1),
        priority=priority,
    )
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array of messages", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(
                    f"messages[{i}] must be an object with a string 'role'", "messages"
                )
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise bad_request(
                    f"messages[{i}].content must be a string or an array of parts", "messages"
                )
        req.messages = messages
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            req.prompts = [prompt]
        elif _is_token_list(prompt) and prompt:
            req.prompts = [prompt]
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(p, str) or (_is_token_list(p) and p) for p in prompt)
        ):
            req.prompts = list(prompt)
        else:
            raise bad_request(
                "'prompt' must be a string, an array of strings, or token ids", "prompt"
            )
    return req


def estimate_text_tokens(text: str, chars_per_token: float) -> int:
    """A deliberately generous token count for ``text`` when no tokenizer is reachable."""
    return math.ceil(len(text) / chars_per_token) + 1


def _message_text_chars(message: dict[str, Any]) -> tuple[int, int]:
    """(characters of text, number of non-text parts) in one chat message."""
    chars, other = 0, 0
    content = message.get("content")
    if isinstance(content, str):
        chars += len(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                chars += len(part["text"])
            else:
                other += 1
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        if key in message and message[key] is not None:
            chars += len(json.dumps(message[key]))
    return chars, other


def estimate_prompt_tokens(req: GenerationRequest, chars_per_token: float) -> list[int]:
    """Estimated prompt tokens of each prompt in the request (exact for token ids)."""
    if req.chat:
        total = 0
        for m in req.messages:
            chars, other = _message_text_chars(m)
            total += (
                math.ceil(chars / chars_per_token)
                + CHAT_TOKENS_PER_MESSAGE
                + other * NON_TEXT_PART_TOKENS
            )
        tools = req.body.get("tools")
        if tools:
            total += math.ceil(len(json.dumps(tools)) / chars_per_token)
        return [total + CHAT_TOKENS_PER_MESSAGE]
    return [
        len(p) if isinstance(p, list) else estimate_text_tokens(p, chars_per_token)
        for p in req.prompts
    ]


def prompt_chars(req: GenerationRequest) -> int | None:
    """Characters an exact prompt count can be compared with, or None when not comparable.

    Single text prompts and chat requests of text only (no tools, no non-text parts) qualify;
    for chat the per-message allowance of :func:`estimate_prompt_tokens` is the template.
    """
    if req.chat:
        if req.body.get("tools"):
            return None
        total = 0
        for m in req.messages:
            chars, other = _message_text_chars(m)
            if other:
                return None
            total += chars
        return total
    if len(req.prompts) == 1 and isinstance(req.prompts[0], str):
        return len(req.prompts[0])
    return None


@dataclass
class CharsPerTokenLearner:
    """The estimate's characters per token, learned from the backend's exact prompt counts.

    Until ``min_samples`` requests were compared, the configured value is used; then a low
    percentile of the recent ratios times ``safety`` (fewer characters per token means more
    tokens: the estimate stays on the generous side of what the traffic really shows).
    """

    configured: float
    window: int = 128
    min_samples: int = 8
    quantile: float = 0.1
    safety: float = 0.9
    _ratios: deque[float] = field(default_factory=deque)
    value: float = 0.0

    def __post_init__(self) -> None:
        self._ratios = deque(maxlen=self.window)
        self.value = self.configured

    @property
    def samples(self) -> int:
        """Ratios currently remembered."""
        return len(self._ratios)

    def observe(self, req: GenerationRequest, exact_prompt_tokens: int) -> None:
        """Compare one request's text with the backend's exact prompt token count."""
        chars = prompt_chars(req)
        if chars is None or chars <= 0:
            return
        tokens = exact_prompt_tokens
        if req.chat:
            tokens -= CHAT_TOKENS_PER_MESSAGE * (len(req.messages) + 1)
        if tokens <= 0:
            return
        self._ratios.append(chars / tokens)
        if len(self._ratios) >= self.min_samples:
            ordered = sorted(self._ratios)
            low = ordered[int(self.quantile * (len(ordered) - 1))]
            self.value = max(low * self.safety, 0.5)
