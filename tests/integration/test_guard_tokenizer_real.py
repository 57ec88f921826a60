"""The guard's in-process prompt counts against real vLLM on CPU (the session's shared server).

For a completion, a chat with a system message, a multi-turn chat and a chat with tools (and
a tool call in its history), the count the guard makes with the model's own tokenizer and
chat template (``guard/tokenizer.py``, the model found from ``root`` in vLLM's
``/v1/models``) must equal the ``usage.prompt_tokens`` vLLM answers for the same request.
Then the same requests through the guard: each kind is checked against vLLM's ``/tokenize``
for its first requests and ends verified, none counted differently.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import pytest
from conftest import wait_vllm_idle
from vllm_server import VllmServer

from oomguard.guard import start_guard
from oomguard.guard.config import build_config
from oomguard.guard.openai_body import parse_generation
from oomguard.guard.tokenizer import ModelTokenizer, count_request, find_model_dir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
pytest.importorskip("jinja2")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "completion": ("/v1/completions", {"prompt": "kato rimen sol quadra 42, dorve nix!"}),
    "chat with a system message": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "You answer in one short line."},
                {"role": "user", "content": "Say hello in four words, please."},
            ]
        },
    ),
    "multi-turn chat": (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "What is kato?"},
                {"role": "assistant", "content": "A word of the tiny language."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "And rimen?"},
                        {"type": "text", "text": "And sol, in 3 words?"},
                    ],
                },
            ]
        },
    ),
    "chat with tools": (
        "/v1/chat/completions",
        {
            "tools": TOOLS,
            # "auto", the default with tools, needs a tool parser on the server
            "tool_choice": "none",
            "messages": [
                {"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {
                                "name": "get_weather",
                                "arguments": '{"city": "Oslo", "unit": "C"}',
                            },
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
                {"role": "user", "content": "And tomorrow?"},
            ],
        },
    ),
}


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def _model(server: VllmServer) -> dict[str, Any]:
    with urllib.request.urlopen(server.base_url + "/v1/models", timeout=30) as resp:
        return dict(json.loads(resp.read())["data"][0])


def test_in_process_counts_equal_vllm_prompt_tokens(shared_vllm: VllmServer) -> None:
    model = _model(shared_vllm)
    path = find_model_dir(model["root"])
    assert path is not None, f"the model of {model['root']} is not found on this machine"
    tok = ModelTokenizer.load(path)
    results = {}
    for name, (route, body) in CASES.items():
        full = {**body, "model": model["id"], "max_tokens": 1, "temperature": 0}
        usage = _post(shared_vllm.base_url + route, full)["usage"]
        req = parse_generation(full, chat=route.endswith("chat/completions"))
        results[name] = (count_request(tok, req, model.get("max_model_len")), usage)
    wait_vllm_idle(shared_vllm.base_url)
    for name, (counts, usage) in results.items():
        assert counts == [usage["prompt_tokens"]], (name, counts, usage)


async def test_the_guard_verifies_each_kind_against_vllm(shared_vllm: VllmServer) -> None:
    import aiohttp

    model = _model(shared_vllm)
    guard = await start_guard(
        build_config({"backends": [shared_vllm.base_url], "port": 0, "health_timeout_s": 5.0})
    )
    local = guard.state.local_tokenizers
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:

            async def send_all() -> None:
                for route, body in CASES.values():
                    full = {**body, "model": model["id"], "max_tokens": 1}
                    async with client.post(guard.url + route, json=full) as resp:
                        assert resp.status == 200, await resp.text()
                        assert resp.headers["x-oomguard-prompt-tokens"] == "exact"

            await send_all()  # counted by /tokenize while the tokenizer loads
            for _ in range(600):
                if local.get(model["root"]) is not None:
                    break
                await asyncio.sleep(0.1)
            for _ in range(local.verify_samples + 1):
                await send_all()
        status = local.status()[model["root"]]
    finally:
        await guard.stop()
        wait_vllm_idle(shared_vllm.base_url)
    assert status["in_process"], status
    assert status["differs"] == [], status
    assert status["verified"] == ["chat", "completion", "tools"], status
