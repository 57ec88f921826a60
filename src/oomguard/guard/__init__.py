"""guard: a memory-aware admission gateway in front of vLLM servers.

``create_app(config)`` builds the aiohttp application, ``run_guard(config)`` serves it, and
``start_guard(config)`` starts it on a running event loop (tests, embedding).

Nothing is imported here until used, so ``oomguard --help`` works without the guard extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oomguard.guard.app import GuardServer, create_app, run_guard, start_guard
    from oomguard.guard.config import GuardConfig, load_config

__all__ = ["GuardConfig", "GuardServer", "create_app", "load_config", "run_guard", "start_guard"]

_WHERE = {
    "GuardServer": "oomguard.guard.app",
    "create_app": "oomguard.guard.app",
    "run_guard": "oomguard.guard.app",
    "start_guard": "oomguard.guard.app",
    "GuardConfig": "oomguard.guard.config",
    "load_config": "oomguard.guard.config",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'oomguard.guard' has no attribute {name!r}")
