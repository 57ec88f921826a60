"""Reading a JSON or YAML document a user points at, with one-line errors for each failure.

Every file oomguard reads as a document (a workload, the calibration store, the guard's
config, a plan file, a row of a replay log) fails the same two ways: the file cannot be read
(:class:`~oomguard.errors.BadInput` naming the file and the reason) or its text does not
parse (:class:`~oomguard.errors.MalformedConfig` naming where and the first line of the
parser's complaint). What the document must then hold is the caller's to check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from oomguard.errors import BadInput, MalformedConfig


def read_document(path: Path, what: str, hint: str) -> str:
    """The text of ``path`` (UTF-8); ``what`` names it in the error ("workload", ...)."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise BadInput(f"cannot read {what} {path}: {exc.strerror or exc}", hint) from None
    except UnicodeDecodeError:
        raise BadInput(f"{what} {path} is not UTF-8 text", hint) from None


def parse_document(text: str, where: str, hint: str, *, yaml: bool = False) -> Any:
    """``text`` parsed as JSON, or as YAML (which reads JSON too) when ``yaml``; ``where``
    names the text in the error ("workload w.yaml", "log.jsonl line 3")."""
    if not yaml:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise MalformedConfig(
                f"{where} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
                hint,
            ) from None
    import yaml as pyyaml

    try:
        return pyyaml.safe_load(text)
    except pyyaml.YAMLError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise MalformedConfig(f"{where} is not valid YAML: {reason}", hint) from None


def load_document(
    path: Path, what: str, *, read_hint: str, parse_hint: str, yaml: bool = False
) -> Any:
    """:func:`read_document` then :func:`parse_document`: the parsed content of ``path``."""
    text = read_document(path, what, read_hint)
    return parse_document(text, f"{what} {path}", parse_hint, yaml=yaml)
