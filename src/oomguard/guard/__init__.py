"""guard: a memory-aware admission gateway in front of vLLM servers.

``create_app(config)`` builds the aiohttp application, ``run_guard(config)`` serves it, and
``start_guard(config)`` starts it on a running event loop (tests, embedding).
"""

from oomguard.guard.app import GuardServer, create_app, run_guard, start_guard
from oomguard.guard.config import GuardConfig, load_config

__all__ = ["GuardConfig", "GuardServer", "create_app", "load_config", "run_guard", "start_guard"]
