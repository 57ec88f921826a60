"""oomguard: keep vLLM deployments out of out-of-memory failures."""

from __future__ import annotations

# ``oomguard.plan`` names the function; its modules stay importable as ``oomguard.plan.<name>``.
# The package loads the planner on the first call, so `import oomguard` stays fast.
from oomguard.plan import plan

__version__ = "0.1.0"

__all__ = ["__version__", "plan"]
