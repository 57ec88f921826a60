"""OpenAI-style request checks and error bodies for the gateway (pure, no I/O).

Every client mistake becomes an :class:`ApiError` with a 4xx status and the body shape
OpenAI clients parse: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

MAX_N = 128
# The generation routes the gateway admits, by path.
RouteKind = Literal["completions", "chat", "chat_batch", "responses", "messages"]
ROUTES: dict[str, RouteKind] = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "/v1/chat/completions/batch": "chat_batch",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
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
    """What the gateway needs from a generation body; ``body`` is the parsed JSON.

    ``chat`` is True for the routes whose input is a conversation: ``messages`` is the (first)
    conversation in chat-completions form, ``conversations`` all of them (several for the
    batch route; Responses and Messages inputs converted to chat messages).
    """

    chat: bool
    body: dict[str, Any]
    model: str | None
    stream: bool
    max_tokens: int | None
    num_sequences: int
    priority: int | None
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    kind: RouteKind = "completions"
    conversations: list[list[dict[str, Any]]] = field(default_factory=list)
    # Parts of the input that cannot be tokenized from text (images, audio, tool items).
    non_text_parts: int = 0

    @property
    def inputs(self) -> int:
        """Prompts or conversations in the request (each runs ``n`` sequences)."""
        return len(self.conversations) if self.chat else len(self.prompts)


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


@dataclass(frozen=True)
class InputLimits:
    """Bounds on one request's size, checked before any other work is done for it."""

    max_tokens: int = 1_000_000
    max_prompts: int = 256
    max_n: int = MAX_N


def parse_generation(
    body: dict[str, Any],
    *,
    chat: bool = False,
    max_tokens_limit: int | None = None,
    kind: RouteKind | None = None,
    limits: InputLimits | None = None,
) -> GenerationRequest:
    """Check a generation body of route ``kind`` (default: completions, or chat when
    ``chat``); raises ApiError(400) naming the field and the limit."""
    kind = kind or ("chat" if chat else "completions")
    lim = limits or InputLimits()
    if max_tokens_limit is not None:
        lim = InputLimits(max_tokens_limit, lim.max_prompts, lim.max_n)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad_request("'model' must be a non-empty string", "model")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    if stream and kind == "chat_batch":
        raise bad_request("the batch route does not stream; send 'stream': false", "stream")
    req = GenerationRequest(
        chat=kind != "completions",
        body=body,
        model=model,
        stream=stream,
        max_tokens=_max_tokens(body, kind, lim.max_tokens),
        num_sequences=1,
        priority=_int_field(body, "priority", -PRIORITY_LIMIT, PRIORITY_LIMIT),
        kind=kind,
    )
    if kind in ("completions", "chat"):
        n = _int_field(body, "n", 1, lim.max_n) or 1
        best_of = None if kind == "chat" else _int_field(body, "best_of", 1, lim.max_n)
        if best_of is not None and best_of < n:
            raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
        req.num_sequences = max(n, best_of or 1)
    if kind == "completions":
        req.prompts = _prompts(body.get("prompt"), lim.max_prompts)
    elif kind == "chat":
        req.conversations = [_checked_messages(body.get("messages"), "messages")]
    elif kind == "chat_batch":
        req.conversations = _batch_conversations(body.get("messages"), lim.max_prompts)
    elif kind == "responses":
        req.conversations = [_responses_conversation(body, req)]
    else:
        req.conversations = [_anthropic_conversation(body, req)]
    if req.chat:
        req.messages = req.conversations[0]
    return req


def _max_tokens(body: dict[str, Any], kind: RouteKind, limit: int) -> int | None:
    if kind == "responses":
        return _int_field(body, "max_output_tokens", 0, limit)
    max_tokens = _int_field(body, "max_tokens", 1 if kind == "messages" else 0, limit)
    if kind == "messages" and max_tokens is None:
        raise bad_request("'max_tokens' is required by the Messages API", "max_tokens")
    if kind in ("chat", "chat_batch"):
        mct = _int_field(body, "max_completion_tokens", 0, limit)
        if mct is not None:
            max_tokens = mct if max_tokens is None else min(max_tokens, mct)
    return max_tokens


def _prompts(prompt: Any, max_prompts: int) -> list[str | list[int]]:
    if isinstance(prompt, str) or (_is_token_list(prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if len(prompt) > max_prompts:
            raise ApiError(
                400,
                f"'prompt' holds {len(prompt)} prompts; this gateway takes at most {max_prompts} "
                "per request: split the list over several requests",
                param="prompt",
                code="too_many_prompts",
            )
        if all(isinstance(p, str) or (_is_token_list(p) and p) for p in prompt):
            return list(prompt)
    raise bad_request("'prompt' must be a string, an array of strings, or token ids", "prompt")


def _checked_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request(f"'{where}' must be a non-empty array of messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"{where}[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(
                f"{where}[{i}].content must be a string or an array of parts", "messages"
            )
    return messages


def _batch_conversations(value: Any, max_prompts: int) -> list[list[dict[str, Any]]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty array of conversations", "messages")
    if len(value) > max_prompts:
        raise ApiError(
            400,
            f"'messages' holds {len(value)} conversations; this gateway takes at most "
            f"{max_prompts} per request: split them over several requests",
            param="messages",
            code="too_many_prompts",
        )
    return [_checked_messages(c, f"messages[{i}]") for i, c in enumerate(value)]


def _text_of_parts(content: Any, req: GenerationRequest) -> str:
    """Text of a content value (string or parts); counts parts that carry no text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return "" if content is None else json.dumps(content)
    texts = []
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") in ("tool_use", "tool_result"):
            texts.append(json.dumps(part))
        else:
            req.non_text_parts += 1
    return "\n".join(texts)


def _responses_conversation(body: dict[str, Any], req: GenerationRequest) -> list[dict[str, Any]]:
    """The Responses API input as chat messages (instructions as the system message)."""
    if body.get("background"):
        raise bad_request(
            "'background': true runs the response after the HTTP exchange ends, where the "
            "gateway cannot hold its KV reservation; send it without 'background'",
            "background",
        )
    out: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        out.append({"role": "system", "content": body["instructions"]})
    value = body.get("input")
    if isinstance(value, str):
        out.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise bad_request(f"input[{i}] must be an object", "input")
            role = item.get("role") if isinstance(item.get("role"), str) else "user"
            content = item.get("content") if "content" in item else json.dumps(item)
            out.append({"role": role, "content": _text_of_parts(content, req)})
    else:
        raise bad_request("'input' must be a string or a non-empty array of items", "input")
    return out


def _anthropic_conversation(body: dict[str, Any], req: GenerationRequest) -> list[dict[str, Any]]:
    """The Messages API body as chat messages (the system prompt first)."""
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text_of_parts(system, req)})
    for m in _checked_messages(body.get("messages"), "messages"):
        out.append({"role": m["role"], "content": _text_of_parts(m.get("content"), req)})
    return out


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


def _conversation_estimate(
    messages: list[dict[str, Any]], extra_parts: int, tools: Any, chars_per_token: float
) -> int:
    total = 0
    for m in messages:
        chars, other = _message_text_chars(m)
        total += (
            math.ceil(chars / chars_per_token)
            + CHAT_TOKENS_PER_MESSAGE
            + other * NON_TEXT_PART_TOKENS
        )
    if tools:
        total += math.ceil(len(json.dumps(tools)) / chars_per_token)
    return total + CHAT_TOKENS_PER_MESSAGE + extra_parts * NON_TEXT_PART_TOKENS


def estimate_prompt_tokens(req: GenerationRequest, chars_per_token: float) -> list[int]:
    """Estimated prompt tokens of each prompt in the request (exact for token ids)."""
    if req.chat:
        tools = req.body.get("tools")
        return [
            _conversation_estimate(c, req.non_text_parts, tools, chars_per_token)
            for c in req.conversations
        ]
    return [
        len(p) if isinstance(p, list) else estimate_text_tokens(p, chars_per_token)
        for p in req.prompts
    ]


def prompt_tokens_lower_bound(req: GenerationRequest) -> int:
    """Fewest prompt tokens the longest input can have (token ids count exactly; text at least
    one). Cheap: used to refuse what can never fit before anything is tokenized."""
    if req.chat:
        return 1
    return max((len(p) if isinstance(p, list) else 1) for p in req.prompts)


def prompt_chars(req: GenerationRequest) -> int | None:
    """Characters an exact prompt count can be compared with, or None when not comparable.

    Single text prompts and chat requests of text only (no tools, no non-text parts) qualify;
    for chat the per-message allowance of :func:`estimate_prompt_tokens` is the template.
    """
    if req.kind != "chat" and req.kind != "completions":
        return None
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
