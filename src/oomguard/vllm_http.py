"""How oomguard's HTTP clients hold connections to vLLM's OpenAI server.

vLLM serves through uvicorn, which closes a keep-alive connection after 5 s idle
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, default 5, ``vllm/envs.py``). A client that keeps idle
connections longer sometimes writes a request into a connection the server is closing at that
moment, and the request fails before it reached the server. Every client of oomguard that talks
to vLLM therefore drops idle connections sooner than the server does.
"""

from __future__ import annotations

from typing import Any

import aiohttp

KEEPALIVE_S = 4.0  # below uvicorn's 5 s in vLLM's server


def connector(**kwargs: Any) -> aiohttp.TCPConnector:
    """A connection pool whose idle connections close before vLLM's server closes them."""
    return aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, **kwargs)
