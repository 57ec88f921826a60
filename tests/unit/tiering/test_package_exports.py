"""The tiering package names its public objects and imports each one's module on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import oomguard.tiering as tiering


@pytest.mark.parametrize("name", tiering.__all__)
def test_each_exported_name_is_its_modules_object(name: str) -> None:
    obj = getattr(tiering, name)
    assert obj is getattr(importlib.import_module(obj.__module__), name)
    assert obj.__module__.startswith("oomguard.tiering.")


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_thing"):
        tiering.no_such_thing  # noqa: B018 - the attribute access is the test


def test_importing_the_package_loads_none_of_its_modules() -> None:
    probe = (
        "import sys, oomguard.tiering; "
        "print(sorted(m for m in sys.modules if m.startswith('oomguard.tiering.')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
