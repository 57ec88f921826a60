"""No module imports another module's private (``_name``) names, and no package imports
another package's private modules: what is shared is public."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        base = base[: -(node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private_imports() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _source_module(node, module, path.name == "__init__.py")
            if not source.startswith("oomguard") or source == module:
                continue
            private = [
                a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
            ]
            package = module if path.name == "__init__.py" else module.rpartition(".")[0]
            source_package = source.rpartition(".")[0]
            private_module = any(p.startswith("_") for p in source.split(".")[1:])
            if private_module and source_package != package:
                private.append(f"(module {source})")
            found += [f"{path.relative_to(SRC)}:{node.lineno} {source}.{name}" for name in private]
    return found


def test_the_scan_sees_the_sources() -> None:
    assert (SRC / "oomguard" / "plan" / "service.py").is_file()


def test_no_private_name_is_imported_from_another_module() -> None:
    assert _private_imports() == []
