"""A burst larger than llama-server's slots, sent directly and through `oomguard guard`, in one run.

The real llama-server (the cached build of ``scripts/setup-llama-server.sh``) serves a tiny
generated GGUF (``tests/integration/tiny_gguf.py``, Q8_0) with ``--slots`` slots of
``--ctx-per-slot`` tokens each (a KV pool per slot) and ``--metrics``. ``--requests`` requests
of a short prompt and ``--max-tokens`` arrive at once, first directly, then through the guard
(configured with the pool layout, as ``oomguard serve`` configures it). A sampler reads
llama-server's ``/slots`` and ``/metrics`` every 20 ms during each burst. Printed for both:
successes, the most slots busy at once, the most requests llama-server deferred into its own
queue (``llamacpp:requests_deferred``), wall time and completion tokens per second.

llama-server never preempts and has no KV-usage metric: what the guard changes is where the
excess waits (its bounded queue, with 429/503 and ``Retry-After`` past it) instead of
llama-server's unbounded one, and that no request longer than a slot reaches the server.
Run: ``.venv/bin/python bench/guard_llama_burst.py [--rounds N] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from burst import GuardProcess  # noqa: E402
from test_guard_llama import HTTP_THREADS, PROMPT, SlotWatch, _burst  # noqa: E402
from tiny_gguf import SHAPES, write_tiny_gguf  # noqa: E402

from oomguard.tiering.server import find_llama_server, running_llama_server  # noqa: E402
from oomguard.tiering.settings import LlamaCppSettings  # noqa: E402


def one_burst(
    label: str, url: str, llama_url: str, requests: int, max_tokens: int
) -> dict[str, object]:
    """Send the burst to ``url`` while sampling llama-server at ``llama_url``."""
    started = time.monotonic()
    with SlotWatch(llama_url) as watch:
        answers = asyncio.run(_burst(url, requests, max_tokens=max_tokens))
    wall_s = time.monotonic() - started
    ok = [a for status, a, _ in answers if status == 200]
    tokens = sum(int(a["usage"]["completion_tokens"]) for a in ok)  # type: ignore[index,call-overload]
    return {
        "label": label,
        "requests": requests,
        "succeeded": len(ok),
        "max_busy_slots": watch.max_busy,
        "samples": watch.samples,
        "max_deferred": watch.max_deferred,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
    }


def main() -> int:
    """Run the bursts and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx-per-slot", type=int, default=512)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    binary = find_llama_server()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gguf = write_tiny_gguf(root / "tiny-q8_0.gguf", SHAPES["q8_0"])
        settings = LlamaCppSettings(ctx_size=args.slots * args.ctx_per_slot, parallel=args.slots)
        with running_llama_server(gguf, settings, binary=binary, extra=HTTP_THREADS) as server:
            config = root / "guard.yaml"
            config.write_text(
                yaml.safe_dump({"backends": [{"url": server.url, "kv_unified": False}]})
            )
            for _ in range(args.rounds):
                rows.append(
                    one_burst("direct", server.url, server.url, args.requests, args.max_tokens)
                )
                with GuardProcess([], root / "guard.log", ["--config", str(config)]) as guard:
                    rows.append(
                        one_burst(
                            "through guard", guard.url, server.url, args.requests, args.max_tokens
                        )
                    )
    conditions = {
        "llama_server": str(binary),
        "slots": args.slots,
        "ctx_per_slot": args.ctx_per_slot,
        "prompt_chars": len(PROMPT),
        "max_tokens": args.max_tokens,
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    if args.json:
        print(json.dumps({"conditions": conditions, "bursts": rows}))
        return 0
    print("conditions:", json.dumps(conditions))
    print(
        f"{'burst':<14} {'ok':>7} {'busy max':>9} {'deferred max':>13} {'wall s':>7} {'tok/s':>7}"
    )
    for r in rows:
        print(
            f"{r['label']:<14} {r['succeeded']!s:>3}/{r['requests']!s:<3} "
            f"{r['max_busy_slots']!s:>9} {r['max_deferred']!s:>13} {r['wall_s']!s:>7} "
            f"{r['tokens_per_s']!s:>7}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
