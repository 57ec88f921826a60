"""Every plan test runs against an empty calibration store of its own."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _own_calibration_store(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMGUARD_HOME", str(tmp_path / "oomguard-home"))
