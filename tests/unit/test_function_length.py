"""No function in src/ runs over 80 lines: long procedures are split into named steps.

Data tables are module-level constants, not functions, so they are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
LIMIT = 80


def _long_functions() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > LIMIT:
                    found.append(f"{path.relative_to(SRC)} {node.name}")
    return found


def test_the_scan_sees_the_sources() -> None:
    assert (SRC / "oomguard" / "memory" / "engine.py").is_file()


def test_no_function_over_80_lines() -> None:
    assert _long_functions() == []
