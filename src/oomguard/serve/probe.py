"""Probes a ready server with the worst requests its configuration admits.

vLLM profiles its activation peak with one batch of ``max_num_batched_tokens`` tokens; a
serving-time out-of-memory comes from a request or a burst that goes past what the profile
saw. Two probes make it show now instead of in production:

- ``longest``: one request of the longest prompt the configuration allows
  (``max_model_len − 1`` tokens) with ``max_tokens`` 1: the longest prefill;
- ``burst``: the planned concurrency of requests at once, each a prompt of the workload's P99
  less 16 tokens and 16 generated tokens, so they hold the KV pool together.

Prompts are sent as token ids (the completions API takes them), so their length is exact
whatever the tokenizer.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

BURST_DECODE_TOKENS = 16
_FIRST_ID = 100  # token ids used for prompts: ordinary tokens of any vocabulary of 300+


@dataclass(frozen=True)
class ProbeResult:
    """One probe: what was sent, how many requests succeeded, and the first error."""

    name: str
    requests: int
    prompt_tokens: int
    max_tokens: int
    ok: int
    elapsed_s: float
    error: str = ""

    @property
    def passed(self) -> bool:
        """Whether every request succeeded."""
        return self.ok == self.requests

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the ``probe`` event's payload)."""
        return {
            "probe": self.name,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "ok": self.ok,
            "passed": self.passed,
            "elapsed_s": round(self.elapsed_s, 3),
            "error": self.error,
        }


def served_model_name(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id the server lists at ``/v1/models``."""
    with urllib.request.urlopen(base_url + "/v1/models", timeout=timeout_s) as resp:
        data = json.loads(resp.read().decode())
    return str(data["data"][0]["id"])


def _prompt_ids(n_tokens: int, vocab_size: int, seed: int) -> list[int]:
    span = max(min(vocab_size - _FIRST_ID, 200), 1)
    return [_FIRST_ID + (seed * 7 + i) % span for i in range(n_tokens)]


def complete(
    base_url: str, model: str, prompt_ids: list[int], max_tokens: int, timeout_s: float
) -> tuple[bool, str]:
    """POST one completion; (succeeded, error text)."""
    body = {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            data = json.loads(resp.read().decode())
        return bool(data.get("choices")), ""
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        return False, f"HTTP {exc.code}: {detail}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return False, f"{type(exc).__name__}: {exc}"


def probe_longest(
    base_url: str, model: str, max_model_len: int, vocab_size: int, timeout_s: float = 600.0
) -> ProbeResult:
    """One request of ``max_model_len − 1`` prompt tokens and one generated token."""
    prompt = max(max_model_len - 1, 1)
    started = time.monotonic()
    ok, error = complete(base_url, model, _prompt_ids(prompt, vocab_size, 0), 1, timeout_s)
    return ProbeResult("longest", 1, prompt, 1, int(ok), time.monotonic() - started, error)


def probe_burst(
    base_url: str,
    model: str,
    concurrency: int,
    request_tokens: int,
    vocab_size: int,
    timeout_s: float = 600.0,
) -> ProbeResult:
    """``concurrency`` requests at once, each ``request_tokens`` long in all."""
    decode = min(BURST_DECODE_TOKENS, max(request_tokens - 1, 1))
    prompt = max(request_tokens - decode, 1)
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(concurrency, 64)) as pool:
        futures = [
            pool.submit(
                complete, base_url, model, _prompt_ids(prompt, vocab_size, i), decode, timeout_s
            )
            for i in range(concurrency)
        ]
        results = [f.result() for f in futures]
    errors = [e for ok, e in results if not ok]
    return ProbeResult(
        "burst",
        concurrency,
        prompt,
        decode,
        sum(1 for ok, _ in results if ok),
        time.monotonic() - started,
        errors[0] if errors else "",
    )
