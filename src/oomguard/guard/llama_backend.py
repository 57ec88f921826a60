"""The guard in front of llama-server: capacity from ``/props``, occupancy from ``/slots``.

llama-server exposes less than vLLM. Its ``/metrics`` (only with ``--metrics``) has no KV-cache
usage and no preemption counter, and it never preempts: every slot's KV cells are allocated at
load, so a running request cannot run the server out of memory. What can go wrong is a request
longer than a slot's context (llama-server cuts or refuses it) and more requests than slots
(it defers them in a queue of its own that no one bounds). The guard therefore admits by slots:

- capacity: ``total_slots`` slots of ``default_generation_settings.n_ctx`` tokens each (``/props``),
  as ``total_slots`` blocks of one slot's context (one request, one slot);
- with one KV pool shared by all slots (``--kv-unified``, llama-server's layout when ``-np`` is
  not given) a slot's context is the whole pool, so the pool of ``n_ctx`` tokens is split into
  ``total_slots`` blocks of ``n_ctx / total_slots`` tokens, and a request reserves as many as
  its prompt and ``max_tokens`` fill. ``/props`` does not say which layout runs: unless the
  backend's config says ``kv_unified: false`` (``oomguard serve`` writes it), the shared pool,
  the smaller reading, is assumed;
- the longest request is a slot's context (``max_model_len``): a longer one gets 400 naming it;
- occupancy: the slots ``/slots`` shows processing (also other clients' requests);
- the watermarks are 1.0 and progress tracking is off for this backend: the memory is
  allocated already, there is no usage to keep a margin under, nothing to project;
- ``/health`` answers 503 while the model loads: the backend is not routed to until it is 200;
- prompts are counted by llama-server's own ``/tokenize`` (``/apply-template`` first for chats).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from oomguard.guard.config import BackendConfig
from oomguard.vllm_metrics import VllmSnapshot

log = logging.getLogger("oomguard.guard")
LLAMA_CPP = "llama.cpp"
# what the guard cannot see on llama-server, and what it does instead (``/status``, the log)
BLIND_SPOTS = (
    "no KV-cache usage metric: occupancy is the busy slots of /slots",
    "no preemption counter (llama-server never preempts: its KV cells are allocated at load)",
    "admits by slots: one request per slot, prompt + max_tokens within a slot's context",
)


class LlamaPollError(ValueError):
    """llama-server answered a poll with something other than 200 (503 while it loads)."""


@dataclass(frozen=True)
class SlotLayout:
    """What ``/props`` says (and the config adds): slots, the context of each, the pool."""

    slots: int
    n_ctx_per_slot: int
    kv_unified: bool | None  # None: not known (assumed shared)

    @property
    def shared_pool(self) -> bool:
        """Whether the slots share one pool (assumed when unknown: the smaller capacity)."""
        return self.kv_unified is not False

    @property
    def block_tokens(self) -> int:
        """Tokens of one admission block: a slot's context, or its share of a shared pool."""
        return (
            max(1, self.n_ctx_per_slot // self.slots) if self.shared_pool else self.n_ctx_per_slot
        )

    @property
    def capacity_tokens(self) -> int:
        """Tokens all requests may hold at once."""
        return self.block_tokens * self.slots

    def basis(self) -> str:
        """How the capacity was read, in words."""
        if self.kv_unified is None:
            return (
                f"/props: {self.slots} slots × {self.n_ctx_per_slot} tokens; one shared KV pool "
                "assumed (set kv_unified: false for this backend if each slot has its own)"
            )
        layout = "one shared KV pool" if self.kv_unified else "a KV pool per slot"
        return f"/props: {self.slots} slots × {self.n_ctx_per_slot} tokens, {layout} (config)"


class SlotServer(Protocol):
    """What this module reads and sets of a guard backend (:class:`.backends.Backend`)."""

    url: str
    config: BackendConfig
    engine: str | None
    healthy: bool
    llama_layout: SlotLayout | None
    models: dict[str, dict[str, Any]]

    def admit_by_slots(self, layout: SlotLayout) -> bool: ...


def is_llama(backend: SlotServer) -> bool:
    """Whether ``backend`` was found to be llama-server."""
    return backend.engine == LLAMA_CPP


async def poll(session: aiohttp.ClientSession, backend: SlotServer) -> VllmSnapshot | None:
    """One poll of a llama-server backend: health, capacity, busy slots as usage.

    None when the backend is not llama-server (so the vLLM poll runs); raises
    :class:`LlamaPollError` while it loads (``/health`` 503) or answers badly.
    """
    if backend.config.engine == "vllm" or backend.engine == "vllm":
        return None
    if backend.engine is None and backend.config.engine == "auto":
        # vLLM has no /props; llama-server answers 503 there while the model loads
        props = await _props(session, backend)
        if props is None:
            backend.engine = "vllm"  # not llama-server: the vLLM poll from now on
            return None
        _adopt(backend, props)
    async with session.get(backend.url + "/health") as resp:
        if resp.status == 503:
            raise LlamaPollError("/health answered 503: the model is loading")
        if resp.status != 200:
            raise LlamaPollError(f"/health answered {resp.status}")
    if not backend.healthy or backend.llama_layout is None:  # (re)started: its slots may differ
        props = await _props(session, backend)
        if props is None:
            raise LlamaPollError("/props did not answer as llama-server's does")
        _adopt(backend, props)
    layout = backend.llama_layout
    assert layout is not None
    busy = await _busy_slots(session, backend)
    return VllmSnapshot(
        kv_cache_usage=None
        if busy is None
        else busy * layout.block_tokens / layout.capacity_tokens,
        requests_running=busy,
        num_gpu_blocks=layout.slots + 1,
        block_size=layout.block_tokens,
    )


async def _props(session: aiohttp.ClientSession, backend: SlotServer) -> dict[str, Any] | None:
    async with session.get(backend.url + "/props") as resp:
        if resp.status == 503:
            raise LlamaPollError("/props answered 503: the model is loading")
        if resp.status != 200:
            return None
        try:
            payload = await resp.json(content_type=None)
        except ValueError:
            return None
    if not isinstance(payload, dict) or "total_slots" not in payload:
        return None
    return payload


def _adopt(backend: SlotServer, props: dict[str, Any]) -> None:
    """Take ``/props``: the slot layout, admission by slots (watermarks 1.0, no tracking)."""
    settings = props.get("default_generation_settings")
    slots = props.get("total_slots")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    if not isinstance(slots, int) or slots < 1 or not isinstance(n_ctx, int) or n_ctx < 1:
        raise LlamaPollError("/props lacks total_slots or default_generation_settings.n_ctx")
    layout = SlotLayout(slots, n_ctx, backend.config.kv_unified)
    if not backend.admit_by_slots(layout):
        return
    log.info(
        "backend %s is llama-server: %s; it exposes no KV-usage metric and no preemption counter, "
        "so the guard admits by slots (one request per slot, within a slot's context)",
        backend.url,
        layout.basis(),
    )


async def _busy_slots(session: aiohttp.ClientSession, backend: SlotServer) -> int | None:
    """Slots processing a request now (None when ``/slots`` is off: ``--no-slots``)."""
    async with session.get(backend.url + "/slots") as resp:
        if resp.status != 200:
            return None
        slots = await resp.json(content_type=None)
    if not isinstance(slots, list):
        return None
    return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))


def note_models(backend: SlotServer) -> None:
    """Give each model ``/v1/models`` lists the longest request a slot holds."""
    layout = backend.llama_layout
    if layout is None:
        return
    for entry in backend.models.values():
        entry["max_model_len"] = layout.n_ctx_per_slot


def status_fields(backend: SlotServer) -> dict[str, Any]:
    """What ``/status`` adds for a llama-server backend: the layout and what cannot be seen."""
    layout = backend.llama_layout
    if layout is None:
        return {"engine": backend.engine}
    return {
        "engine": LLAMA_CPP,
        "capacity_source": "props",
        "capacity_basis": layout.basis(),
        "slots": layout.slots,
        "n_ctx_per_slot": layout.n_ctx_per_slot,
        "kv_unified": layout.kv_unified,
        "cannot_see": list(BLIND_SPOTS),
    }


async def count_tokens(
    session: aiohttp.ClientSession,
    backend: SlotServer,
    payload: dict[str, Any],
    timeout: aiohttp.ClientTimeout,
) -> int | None:
    """Prompt tokens by llama-server's ``/tokenize`` (a chat rendered by ``/apply-template``
    first); None when it cannot say."""
    text = payload.get("prompt")
    if "messages" in payload:
        async with session.post(
            backend.url + "/apply-template", json={"messages": payload["messages"]}, timeout=timeout
        ) as resp:
            if resp.status != 200:
                return None
            rendered = await resp.json(content_type=None)
        text = rendered.get("prompt") if isinstance(rendered, dict) else None
    if not isinstance(text, str):
        return None
    async with session.post(
        backend.url + "/tokenize", json={"content": text, "add_special": True}, timeout=timeout
    ) as resp:
        if resp.status != 200:
            return None
        answer = await resp.json(content_type=None)
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    return len(tokens) if isinstance(tokens, list) else None


def blocks_for(layout: SlotLayout, tokens: int) -> int:
    """Admission blocks a request of ``tokens`` takes (documentation and tests)."""
    return max(1, math.ceil(tokens / layout.block_tokens))
