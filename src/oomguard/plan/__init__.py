"""The plan face: recommendation search, fallbacks, sizing, command rendering, ``oomguard plan``.

:func:`plan` is the Python API (``from oomguard import plan``); it loads the planner
(:mod:`oomguard.plan.service`) on its first call, so importing the package stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomguard.plan.result import PlanResult

__all__ = ["plan"]


def plan(*args: Any, **kwargs: Any) -> PlanResult:
    """Plan one vLLM deployment; the arguments are :func:`oomguard.plan.service.plan`'s."""
    from oomguard.plan.service import plan as run

    return run(*args, **kwargs)
