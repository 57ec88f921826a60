"""oomguard: keep vLLM deployments out of out-of-memory failures."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "plan"]


def __getattr__(name: str) -> Any:
    # Lazy: `import oomguard` stays fast; the planner loads on first use.
    if name == "plan":
        from oomguard.api import plan

        return plan
    raise AttributeError(f"module 'oomguard' has no attribute {name!r}")
