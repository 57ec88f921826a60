"""bench: prove a configuration under peak load and find the highest safe concurrency.

>>> from oomguard.bench import BenchSettings, FixedWorkload, run_bench
>>> result = run_bench(BenchSettings("http://127.0.0.1:8000", FixedWorkload(2048, 512)))
>>> result.max_safe_concurrency, result.recommendation.max_num_seqs

Nothing heavy is imported here: the modules load when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomguard.bench.runner import BenchResult, BenchSettings, run_bench
    from oomguard.bench.workload import DistributionWorkload, FixedWorkload, ReplayWorkload

__all__ = [
    "BenchResult",
    "BenchSettings",
    "DistributionWorkload",
    "FixedWorkload",
    "ReplayWorkload",
    "run_bench",
]

_WHERE = {
    "BenchResult": "oomguard.bench.runner",
    "BenchSettings": "oomguard.bench.runner",
    "run_bench": "oomguard.bench.runner",
    "DistributionWorkload": "oomguard.bench.workload",
    "FixedWorkload": "oomguard.bench.workload",
    "ReplayWorkload": "oomguard.bench.workload",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
