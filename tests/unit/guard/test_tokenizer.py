"""In-process prompt counts: the model's tokenizer and chat template (``guard/tokenizer.py``).

The model is the integration tier's generated one (``tests/integration/tinymodel.py``): a
byte-level BPE and a chat template that renders tools and tool calls. Expected texts are
written out from the template by hand; the test against real vLLM is in
``tests/integration/test_guard_tokenizer_real.py``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from oomguard.guard.openai_body import parse_generation
from oomguard.guard.tokenizer import (
    LocalTokenizers,
    ModelTokenizer,
    count_request,
    find_model_dir,
)

from .conftest import GuardFactory
from .fake_vllm import FakeVllm

pytest.importorskip("jinja2")
INTEGRATION = Path(__file__).resolve().parents[2] / "integration"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    sys.path.insert(0, str(INTEGRATION))
    from tinymodel import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama").path


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.load(model_dir)


def encode(tok: ModelTokenizer, text: str) -> int:
    return len(tok.encoder.encode(text, add_special_tokens=False))


def test_a_system_and_multi_turn_chat_renders_as_the_template_writes_it(
    tok: ModelTokenizer,
) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        },
    ]
    text = tok.render_chat(messages, {"messages": messages})
    assert text == (
        "<|bos|><|system|>Be terse.\n<|user|>hi\n<|assistant|>hello\n"
        "<|user|>one\ntwo\n<|assistant|>"
    )
    no_prompt = tok.render_chat(messages, {"add_generation_prompt": False})
    assert no_prompt is not None and not no_prompt.endswith("<|assistant|>")
    req = parse_generation({"messages": messages}, chat=True)
    # The template writes BOS itself: vLLM encodes a chat without adding special tokens.
    assert count_request(tok, req, None) == [encode(tok, text)]
    assert encode(tok, text) == len(tok.encoder.encode(text).ids)


def test_tools_are_passed_as_vllm_dumps_them_and_tool_call_arguments_as_objects(
    tok: ModelTokenizer,
) -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "rain"}]},
    ]
    text = tok.render_chat(messages, {"tools": TOOLS})
    dumped = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": None,
                "parameters": TOOLS[0]["function"]["parameters"],
            },
        }
    ]
    assert text == (
        "<|bos|><|system|>tools: " + json.dumps(dumped) + "\n"
        '<|user|>weather?\n<|assistant|> call get_weather {"city": "Oslo"}\n'
        "<|tool|>rain\n<|assistant|>"
    )


def test_a_completion_counts_the_special_tokens_the_tokenizer_config_asks_for(
    model_dir: Path, tmp_path: Path
) -> None:
    plain = ModelTokenizer.load(model_dir)
    req = parse_generation({"prompt": ["kato rimen sol", [5, 6, 7, 8]]})
    words = len(plain.encoder.encode("kato rimen sol").ids)
    assert count_request(plain, req, None) == [words, 4]
    with_bos = tmp_path / "with-bos"
    shutil.copytree(model_dir, with_bos)
    config = json.loads((with_bos / "tokenizer_config.json").read_text())
    (with_bos / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    bos = ModelTokenizer.load(with_bos)
    assert count_request(bos, req, None) == [words + 1, 4]
    no_special = parse_generation({"prompt": "kato rimen sol", "add_special_tokens": False})
    assert count_request(bos, no_special, None) == [words]


def test_a_prompt_too_long_for_the_context_is_not_encoded(tok: ModelTokenizer) -> None:
    limit = 16
    huge = "ka " * (limit * tok.max_chars_per_token)
    assert tok.count_text(huge, True, limit) == limit + 1
    assert tok.count_text("ka to", True, limit) == len(tok.encoder.encode("ka to").ids)


def test_what_cannot_be_rendered_here_goes_to_the_backend(tok: ModelTokenizer) -> None:
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert tok.render_chat(image, {}) is None
    text = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(text, {"chat_template": "{{ messages }}"}) is None
    assert tok.render_chat(text, {"continue_final_message": True}) is None


def test_a_template_that_refuses_the_chat_leaves_the_answer_to_the_backend(
    model_dir: Path, tmp_path: Path
) -> None:
    d = tmp_path / "strict"
    shutil.copytree(model_dir, d)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
        "{{ m.content | tojson }}{% endfor %}"
    )
    tok = ModelTokenizer.load(d)
    assert tok.render_chat([{"role": "user", "content": "é<b>"}], {}) == '"é<b>"'
    assert tok.render_chat([{"role": "system", "content": "x"}], {}) is None


def test_content_parts_developer_role_and_named_templates(model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "parts"
    shutil.copytree(model_dir, d)
    # A template that loops over message content gets the parts, not joined text.
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{% for p in m['content'] %}({{ p.text }}){% endfor %}"
        "{% endfor %}"
    )
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("tools:{{ tools | length }}")
    tok = ModelTokenizer.load(d)
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    assert tok.render_chat(messages, {}) == "[system](rules)[user](a)(b)"
    assert tok.render_chat(messages, {"tools": TOOLS}) == "tools:1"


def test_the_model_directory_is_found_locally_or_in_the_hub_cache(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    assert find_model_dir(str(model_dir)) == model_dir
    assert find_model_dir(str(tmp_path / "missing")) is None
    cache = tmp_path / "hub"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "abc123"
    shutil.copytree(model_dir, snapshot)
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert find_model_dir("acme/tiny") == snapshot
    assert find_model_dir("acme/other") is None


# -- in the gateway -------------------------------------------------------------------------
async def _post(client: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with client.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-oomguard-prompt-tokens"]


async def test_the_gateway_counts_in_process_once_the_backend_agreed(
    fake: FakeVllm,
    make_guard: GuardFactory,
    client: aiohttp.ClientSession,
    tok: ModelTokenizer,
    model_dir: Path,
) -> None:
    fake.state.root = str(model_dir)
    fake.state.tokenize_count = lambda body: count_request(
        tok, parse_generation(body, chat="messages" in body), None
    )[0]
    guard = await make_guard([fake.url])
    local: LocalTokenizers = guard.state.local_tokenizers
    url = guard.url + "/v1/chat/completions"
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    await _post(client, url, body)  # starts loading the tokenizer; counted by /tokenize
    for _ in range(200):
        if local.get(str(model_dir)) is not None:
            break
        await __import__("asyncio").sleep(0.02)
    before = fake.state.tokenize_calls
    for _ in range(local.verify_samples + 4):
        assert await _post(client, url, body) == "exact"
    assert fake.state.tokenize_calls - before == local.verify_samples
    status = local.status()[str(model_dir)]
    assert status["in_process"] and status["verified"] == ["chat"]


async def test_a_backend_that_counts_otherwise_keeps_its_tokenize(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession, model_dir: Path
) -> None:
    fake.state.root = str(model_dir)  # the fake's own word count differs from the tokenizer
    guard = await make_guard([fake.url])
    local: LocalTokenizers = guard.state.local_tokenizers
    url = guard.url + "/v1/completions"
    body = {"model": "fake-model", "prompt": "kato rimen sol ka", "max_tokens": 2}
    await _post(client, url, body)
    for _ in range(200):
        if local.get(str(model_dir)) is not None:
            break
        await __import__("asyncio").sleep(0.02)
    before = fake.state.tokenize_calls
    for _ in range(5):
        assert await _post(client, url, body) == "exact"
    assert fake.state.tokenize_calls - before == 5
    assert local.status()[str(model_dir)]["differs"] == ["completion"]


async def test_a_long_prompt_is_encoded_off_the_event_loop(
    fake: FakeVllm,
    make_guard: GuardFactory,
    client: aiohttp.ClientSession,
    tok: ModelTokenizer,
    model_dir: Path,
) -> None:
    fake.state.root = str(model_dir)
    fake.state.max_model_len = 100_000  # the text is encoded, not refused on its length
    fake.state.tokenize_count = lambda body: count_request(tok, parse_generation(body), None)[0]
    guard = await make_guard([fake.url])
    local: LocalTokenizers = guard.state.local_tokenizers
    url = guard.url + "/v1/completions"
    short = {"model": "fake-model", "prompt": "kato rimen", "max_tokens": 2}
    await _post(client, url, short)
    for _ in range(200):
        if local.get(str(model_dir)) is not None:
            break
        await __import__("asyncio").sleep(0.02)
    for _ in range(local.verify_samples):
        await _post(client, url, short)
    before = fake.state.tokenize_calls
    long_prompt = "kato rimen sol " * 3000  # 45,000 characters: past INLINE_CHARS
    body = {"model": "fake-model", "prompt": long_prompt, "max_tokens": 2}
    async with client.post(url, json=body) as r:
        answer = await r.json()
        assert r.status == 400, answer
    assert answer["error"]["code"] == "context_length_exceeded"
    tokens = count_request(tok, parse_generation(body), None)[0]
    assert str(tokens) in answer["error"]["message"].replace(",", "")
    assert fake.state.tokenize_calls == before


async def test_tokenize_is_asked_with_the_requests_add_special_tokens(
    fake: FakeVllm, make_guard: GuardFactory, client: aiohttp.ClientSession
) -> None:
    seen: list[dict[str, Any]] = []
    fake.state.tokenize_count = lambda body: seen.append(body) or 3
    guard = await make_guard([fake.url])
    body = {"model": "fake-model", "prompt": "a b", "max_tokens": 2, "add_special_tokens": False}
    await _post(client, guard.url + "/v1/completions", body)
    chat = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "add_special_tokens": True,
    }
    await _post(client, guard.url + "/v1/chat/completions", chat)
    assert [b.get("add_special_tokens") for b in seen] == [False, True]
