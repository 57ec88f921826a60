"""Leak detection on the recorded traces: when the growing process is flagged, and whether the
flat hour of real vLLM raises anything, with the watcher's default settings.

Traces (tests/unit/watch/data/, recorded by bench/record_leak_traces.py on this project's
shared 2-core machine): ``trace_grow_50mib_per_min.jsonl`` (15 min of a real process keeping
50 MiB/min more) and ``trace_flat_vllm_1h.jsonl`` (an hour of real vLLM's host memory under
random bursts of traffic). Each is replayed through the detector and the alert's minimum
duration exactly as ``oomguard watch`` runs them.

Run: ``.venv/bin/python bench/watch_leak.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "unit" / "watch" / "data"
MIB, GIB = 2**20, 2**30


def main() -> int:
    from oomguard.watch import rules as R
    from oomguard.watch.alerts import AlertTracker, Observation
    from oomguard.watch.leak import replay

    print(
        f"settings: window {R.LEAK_WINDOW_S:g} s, rate >= {R.MEMORY_LEAK.threshold * 60 / MIB:g} "
        f"MiB/min, settle {R.LEAK_SETTLE_S:g} s, for {R.MEMORY_LEAK.for_s:g} s"
    )
    for name in (
        "trace_grow_50mib_per_min.jsonl",
        "trace_flat_vllm_1h.jsonl",
        "trace_flat_vllm_warmed_1h.jsonl",
    ):
        path = DATA / name
        if not path.exists():
            print(f"{name}: missing")
            continue
        lines = path.read_text().splitlines()
        header = json.loads(lines[0])
        samples = [tuple(json.loads(line)) for line in lines[1:]]
        tracker = AlertTracker()
        events = []
        verdicts = replay(samples, available_bytes=8 * GIB)  # type: ignore[arg-type]
        for t, v in verdicts:
            if v.ready:
                obs = Observation(
                    R.MEMORY_LEAK,
                    name,
                    v.slope_bytes_per_s,
                    v.suspected,
                    v.slope_bytes_per_s >= R.MEMORY_LEAK.clear,
                    "",
                )
                events.extend(tracker.update(t, [obs]))
        values = [s[1] for s in samples]
        slopes = [v.slope_bytes_per_s * 60 / MIB for _, v in verdicts if v.ready]
        print(
            f"{name}: {header['source']}; {len(samples)} samples over {samples[-1][0] / 60:.1f} "
            f"min, memory {min(values) / MIB:.0f}-{max(values) / MIB:.0f} MiB"
        )
        print(f"  robust slope over the run: {min(slopes):+.1f} to {max(slopes):+.1f} MiB/min")
        for e in events:
            print(f"  {e.state} at {e.at_s / 60:.1f} min (slope {e.value * 60 / MIB:.1f} MiB/min)")
        if not events:
            print("  no leak alert")
    return 0


if __name__ == "__main__":
    sys.exit(main())
