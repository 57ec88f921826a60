"""Prompts of an exact token length, distinct from their first token unless a prefix is shared.

Lengths are counted by the server's own tokenizer (vLLM's ``/tokenize`` and ``/detokenize``:
the count is what the completion will report, special tokens included) or by a local
``tokenizer.json`` (``--tokenizer``). Each prompt is pseudo-text drawn from a seeded
generator: different seeds differ in their first words, so no two prompts share a KV block
and prefix caching cannot shrink the load. With a shared prefix, every prompt starts with the
same text of that many tokens and differs after it.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from oomguard.bench.workload import RequestShape
from oomguard.errors import BadInput, OomguardError

_SYLLABLES = (
    "ka", "to", "ri", "men", "sol", "qua", "lin", "dor", "ve", "nix", "pa", "ul", "tra", "bo",
    "ez", "gal", "fi", "mon", "sa", "ter", "ox", "ya", "hel", "cu", "dra", "po", "ni", "vex",
)  # fmt: skip
_ATTEMPTS = 8


class TokenizerUnavailable(OomguardError):
    """The tokenizer stopped answering (the server went away) or refused the text."""

    exit_code = 1


class Tokenizer(Protocol):
    """Counts and cuts text the way the server will."""

    async def encode(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text``; ``special``: with the tokens the server adds (BOS)."""
        ...

    async def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        ...


class ServerTokenizer:
    """vLLM's ``/tokenize`` and ``/detokenize`` of the served model."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str) -> None:
        self.session, self.base_url, self.model = session, base_url.rstrip("/"), model
        self.timeout = aiohttp.ClientTimeout(total=30)

    async def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        try:
            r, data = await self._post_once(path, body)
        except aiohttp.ClientConnectionError:
            # the server closed an idle keep-alive connection as it was reused: the request
            # never reached it, and tokenizing is idempotent, so ask again on a fresh one
            try:
                r, data = await self._post_once(path, body)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
                raise self._unavailable(path, exc) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise self._unavailable(path, exc) from None
        if r.status != 200 or not isinstance(data, dict):
            raise TokenizerUnavailable(
                f"{self.base_url}{path} answered {r.status}: {str(data)[:200]}",
                "pass --tokenizer with the model's tokenizer.json",
            )
        return data

    async def _post_once(
        self, path: str, body: dict[str, object]
    ) -> tuple[aiohttp.ClientResponse, object]:
        async with self.session.post(self.base_url + path, json=body, timeout=self.timeout) as r:
            return r, await r.json(content_type=None)

    def _unavailable(self, path: str, exc: BaseException) -> TokenizerUnavailable:
        return TokenizerUnavailable(
            f"{self.base_url}{path} failed ({type(exc).__name__}: {exc})"[:300],
            "check that the server still runs, or pass --tokenizer",
        )

    async def encode(self, text: str, *, special: bool) -> list[int]:
        """Ids from ``/tokenize``."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": special}
        tokens = (await self._post("/tokenize", body)).get("tokens")
        return [int(t) for t in tokens] if isinstance(tokens, list) else []

    async def decode(self, ids: list[int]) -> str:
        """Text from ``/detokenize``."""
        text = (await self._post("/detokenize", {"model": self.model, "tokens": ids})).get("prompt")
        return str(text or "")


class LocalTokenizer:
    """A ``tokenizer.json`` read with the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self.tok = HfTokenizer.from_file(str(file))
        except Exception as exc:  # noqa: BLE001 - the library raises its own Exception type
            raise BadInput(
                f"cannot read tokenizer {file}: {exc}",
                "give a tokenizer.json or the model directory that holds one",
            ) from None

    async def encode(self, text: str, *, special: bool) -> list[int]:
        """Ids of ``text``."""
        return list(self.tok.encode(text, add_special_tokens=special).ids)

    async def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens left out)."""
        return str(self.tok.decode(ids, skip_special_tokens=True))


def pseudo_text(seed: str, words: int) -> str:
    """Deterministic pseudo-text: syllable words, digits and punctuation."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(words):
        out.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
        if i % 11 == 10:
            out.append(str(rng.randint(0, 9999)) + rng.choice(".,;!?"))
    return " ".join(out)


@dataclass(frozen=True)
class BuiltPrompt:
    """A prompt and its length as the server counts it."""

    text: str
    tokens: int


class PromptMaker:
    """Builds the prompt of each request shape (exact length, distinct, optional shared prefix)."""

    def __init__(
        self, tokenizer: Tokenizer, *, shared_prefix_tokens: int = 0, run_seed: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        self.shared_prefix_tokens = shared_prefix_tokens
        self.run_seed = run_seed
        self._special: int | None = None
        self._prefix: str | None = None

    async def special_tokens(self) -> int:
        """Tokens the server adds to every prompt (a BOS, typically)."""
        if self._special is None:
            text = pseudo_text("probe", 8)
            with_special = await self.tokenizer.encode(text, special=True)
            plain = await self.tokenizer.encode(text, special=False)
            self._special = max(0, len(with_special) - len(plain))
        return self._special

    async def _prefix_text(self) -> str:
        if self._prefix is None:
            self._prefix = ""
            if self.shared_prefix_tokens:
                self._prefix = await self._exact(
                    f"{self.run_seed}prefix", self.shared_prefix_tokens, "", with_special=False
                )
        return self._prefix

    async def build(self, shape: RequestShape, index: int) -> BuiltPrompt:
        """The prompt of request ``index``: ``shape.prompt_text`` counted, or generated text of
        exactly ``shape.prompt_tokens`` tokens."""
        if shape.prompt_text is not None:
            count = len(await self.tokenizer.encode(shape.prompt_text, special=True))
            return BuiltPrompt(shape.prompt_text, count)
        prefix = await self._prefix_text()
        text = await self._exact(f"{self.run_seed}{index}", shape.prompt_tokens, prefix)
        return BuiltPrompt(text, shape.prompt_tokens)

    async def build_many(
        self, shapes: list[tuple[int, RequestShape]], parallel: int = 8
    ) -> dict[int, BuiltPrompt]:
        """Prompts for (index, shape) pairs, ``parallel`` at a time."""
        gate = asyncio.Semaphore(parallel)

        async def one(index: int, shape: RequestShape) -> tuple[int, BuiltPrompt]:
            async with gate:
                return index, await self.build(shape, index)

        pairs = await asyncio.gather(*(one(i, s) for i, s in shapes))
        return dict(pairs)

    async def _exact(
        self, seed: str, tokens: int, prefix: str, *, with_special: bool = True
    ) -> str:
        """Text of exactly ``tokens`` tokens (special tokens counted when ``with_special``)."""
        special = await self.special_tokens() if with_special else 0
        content = tokens - special
        if content < 1:
            raise BadInput(
                f"a prompt of {tokens} tokens leaves no room for text after the "
                f"{special} special token(s) the server adds",
                "ask for a longer --prompt-tokens",
            )
        joiner = "\n" if prefix else ""
        body = pseudo_text(seed, max(8, content // 2 + 8))
        ids = await self.tokenizer.encode(prefix + joiner + body, special=False)
        while len(ids) < content + _ATTEMPTS:
            body += " " + pseudo_text(seed + "+", content)
            ids = await self.tokenizer.encode(prefix + joiner + body, special=False)
        for cut in _cuts(content):
            text = await self.tokenizer.decode(ids[:cut])
            if prefix and not text.startswith(prefix):
                continue
            if len(await self.tokenizer.encode(text, special=with_special)) == tokens:
                return text
        raise BadInput(
            f"could not build a prompt of exactly {tokens} tokens with this tokenizer",
            "try a slightly different --prompt-tokens",
        )


def _cuts(content: int) -> list[int]:
    """Cut points to try: the exact count, then the nearest ones (a round trip can merge
    or split a token at the cut)."""
    out = [content]
    for k in range(1, _ATTEMPTS):
        out += [content + k, content - k]
    return [c for c in out if c >= 1]
