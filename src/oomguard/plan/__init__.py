"""The plan face: recommendation search, fallbacks, sizing, command rendering, ``oomguard plan``.

``oomguard.plan`` is also callable: once this package is imported, ``from oomguard import
plan`` finds the package rather than the function, so the package forwards calls to
:func:`oomguard.api.plan`.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from oomguard.api import plan

        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
