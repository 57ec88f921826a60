"""Prompts of an exact token length, distinct, with an optional shared prefix (a real
byte-level BPE tokenizer trained here, read as a tokenizer.json)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import aiohttp.web
import pytest

from oomguard.bench.prompts import (
    LocalTokenizer,
    PromptMaker,
    ServerTokenizer,
    TokenizerUnavailable,
    pseudo_text,
)
from oomguard.bench.workload import RequestShape


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        special_tokens=["<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([pseudo_text(f"corpus{i}", 60) for i in range(400)], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_exact_lengths_counted_with_the_bos(tokenizer_json: Path) -> None:
    tok = LocalTokenizer(tokenizer_json)
    maker = PromptMaker(tok, run_seed="t")

    async def build() -> list[tuple[str, int]]:
        built = await maker.build_many(
            [(i, RequestShape(n, 8)) for i, n in enumerate((5, 64, 257, 1000))]
        )
        return [(b.text, len(await tok.encode(b.text, special=True))) for b in built.values()]

    assert asyncio.run(maker.special_tokens()) == 1
    got = asyncio.run(build())
    assert [n for _, n in got] == [5, 64, 257, 1000]
    assert len({text.split()[0] for text, _ in got}) == 4  # distinct from the first word


def test_shared_prefix_is_the_same_text_then_distinct(tokenizer_json: Path) -> None:
    tok = LocalTokenizer(tokenizer_json)
    maker = PromptMaker(tok, shared_prefix_tokens=40, run_seed="s")
    built = asyncio.run(maker.build_many([(i, RequestShape(120, 8)) for i in range(3)]))
    texts = [b.text for b in built.values()]
    prefix = asyncio.run(maker._prefix_text())
    assert all(t.startswith(prefix) for t in texts)
    assert len(asyncio.run(tok.encode(prefix, special=False))) == 40
    assert len({t[len(prefix) :] for t in texts}) == 3
    assert all(len(asyncio.run(tok.encode(t, special=True))) == 120 for t in texts)


async def _tokenize_server(drops: int) -> tuple[aiohttp.web.AppRunner, str, list[int]]:
    """A /tokenize that cuts the connection of its first ``drops`` requests mid-way, as a
    server closing an idle keep-alive connection does to a request written into it."""
    from aiohttp import web

    seen = [0]

    async def tokenize(request: web.Request) -> web.Response:
        seen[0] += 1
        if seen[0] <= drops:
            assert request.transport is not None
            request.transport.close()
        body = await request.json()
        return web.json_response({"tokens": list(range(len(body["prompt"].split())))})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}", seen


async def test_server_tokenizer_asks_again_after_a_cut_connection() -> None:
    runner, url, seen = await _tokenize_server(drops=1)
    try:
        async with aiohttp.ClientSession() as session:
            ids = await ServerTokenizer(session, url, "m").encode("a b c", special=True)
    finally:
        await runner.cleanup()
    assert ids == [0, 1, 2]
    assert seen[0] == 2


async def test_server_tokenizer_gives_up_after_a_second_cut() -> None:
    runner, url, seen = await _tokenize_server(drops=2)
    try:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(TokenizerUnavailable, match="tokenize failed"):
                await ServerTokenizer(session, url, "m").encode("a b", special=True)
    finally:
        await runner.cleanup()
    assert seen[0] == 2
