"""A process that grows its resident memory on purpose, at a steady rate, with realistic noise.

``python grow_memory.py --rate-mib-per-min 50 [--duration-s N] [--start-mib 200]`` allocates
and touches memory in chunks of irregular size at irregular times (like an engine that keeps a
little of every batch), and meanwhile allocates and frees short-lived buffers (like the work of
each request), so its resident size rises by the rate on average with the jitter of a real
process. ``--rate-mib-per-min 0`` holds a flat size with the same transient noise. It prints
``ready`` once its starting memory is resident. Used by the watch leak tests and by
``bench/record_leak_traces.py``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

MIB = 2**20


def _touched(n_bytes: int) -> bytearray:
    """``n_bytes`` that are resident (every page written)."""
    buf = bytearray(n_bytes)
    for i in range(0, n_bytes, 4096):
        buf[i] = 1
    return buf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate-mib-per-min", type=float, required=True)
    parser.add_argument("--duration-s", type=float, default=3600.0)
    parser.add_argument("--start-mib", type=float, default=64.0)
    parser.add_argument(
        "--transient-mib", type=float, default=24.0, help="largest short-lived buffer"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kept = [_touched(int(args.start_mib * MIB))]
    print("ready", flush=True)
    started = time.monotonic()
    owed_bytes = 0.0
    last = started
    while (now := time.monotonic()) - started < args.duration_s:
        owed_bytes += (now - last) * args.rate_mib_per_min * MIB / 60.0
        last = now
        # keep memory in irregular chunks: half to twice the average chunk of 2 MiB
        chunk = int(rng.uniform(0.5, 2.0) * 2 * MIB)
        if owed_bytes >= chunk:
            kept.append(_touched(chunk))
            owed_bytes -= chunk
        if rng.random() < 0.3:  # a short-lived working buffer, freed at once
            scratch = _touched(int(rng.uniform(0.0, args.transient_mib) * MIB))
            time.sleep(rng.uniform(0.0, 0.3))
            del scratch
        time.sleep(rng.uniform(0.05, 0.4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
