"""Raw log lines → clean message bodies → logical records.

A vLLM log arrives with decorations that say nothing about memory: ANSI colours, container
timestamps, ``docker compose`` service prefixes, process tags such as ``(EngineCore_DP0 pid=1)``
or ``(RayWorkerWrapper pid=1, ip=10.0.0.1)``, ``[rank0]:``, and the logger's own
``LEVEL MM-DD HH:MM:SS [file.py:123]`` header. Reporters also paste messages hard-wrapped at
a fixed width, and vLLM V0 printed one record over several lines. This module strips the
decorations and joins continuation lines into one logical record, holding at most a few
kilobytes at a time so that a log of any size streams through in bounded memory.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

MAX_LINE_CHARS = 16_384  # longer lines are cut (binary blobs, base64 dumps, one-line logs)
MAX_RECORD_LINES = 12
MAX_RECORD_CHARS = 8_192

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_STRAIGHT_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})

_PROCESS_TAG = re.compile(r"^\(?[A-Za-z_][\w.-]*(?: rank=\d+)? pid=\d+(?:, ip=[\w.:-]+)?\)\s*")
# logger header: "INFO 10-24 01:26:57 [core.py:710] ", "INFO 01-11 15:51:02 llm_engine.py:70] ",
# "INFO  [gpu_worker.py:642]  ", "INFO 04-29 gpu_executor.py:118] "
_LOGGER_HEADER = re.compile(
    r"^(?:DEBUG|INFO|WARNING|WARN|ERROR|CRITICAL)\s+"
    r"(?:\d{2}-\d{2}(?:\s+\d{2}:\d{2}:\d{2}(?:\.\d+)?)?\s+)?"
    r"(?:\[[\w./-]+(?::\d+)?\]\s*|[\w./-]+\.py:\d+\]\s*)?"
)
# One decoration at the start of a line; applied repeatedly until none matches.
_PREFIXES: tuple[re.Pattern[str], ...] = (
    # a launcher's own logger: FastChat's "2024-03-20 19:18:27 | ERROR | stderr | ", loguru's
    # "2024-03-20 19:18:27.123 | ERROR    | module:function:42 - " (only after a timestamp: a
    # Markdown table row starts with "|" too)
    re.compile(
        r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?\s*\|\s*"
        r"(?:TRACE|DEBUG|INFO|SUCCESS|WARNING|ERROR|CRITICAL)\s*\|\s*[\w.:<>-]+\s*(?:\||-)\s?"
    ),
    # ISO / RFC3339 timestamps added by docker, kubectl, journald exports
    re.compile(r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?\s*"),
    # docker compose service prefix: "vllm-1  | "
    re.compile(r"^[A-Za-z0-9][\w.-]*\s+\|\s?"),
    # process tags: (EngineCore_DP0 pid=1) (APIServer pid=1) (Worker_TP1 pid=1)
    # (VllmWorker rank=0 pid=1) (RayWorkerWrapper pid=1, ip=10.0.0.1); the opening paren is
    # sometimes lost when a reporter copies from the middle of a line.
    _PROCESS_TAG,
    re.compile(r"^\[rank\d+\]:\s?"),
    # logger header: "INFO 10-24 01:26:57 [core.py:710] ", "INFO 01-11 15:51:02 llm_engine.py:70] ",
    # "INFO  [gpu_worker.py:642]  ", "INFO 04-29 gpu_executor.py:118] "
    _LOGGER_HEADER,
    # python logging default format: "engine.py :190 2024-02-03 03:44:03,976 "
    re.compile(r"^[\w./-]+\.py\s*:\d+\s+\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:,\d+)?\s+"),
)
# The same decorations as one anchored alternation (first alternative wins, as in the list):
# one regex call per decoration removed instead of one per decoration tried.
_ANY_PREFIX = re.compile(
    "^(?:"
    + "|".join(
        f"(?P<d{i}>{prefix.pattern.removeprefix('^')})" for i, prefix in enumerate(_PREFIXES)
    )
    + ")"
)
_TAG_GROUP = f"d{_PREFIXES.index(_PROCESS_TAG)}"
_LEVEL_GROUP = f"d{_PREFIXES.index(_LOGGER_HEADER)}"
# the source file in a logger header: "[core.py:710]", "llm_engine.py:70]"
_SOURCE_FILE = re.compile(r"([\w.-]+\.py):\d+\]")
_RAY_REPEAT = re.compile(r"\s*\[repeated \d+x across cluster\]\s*$")

# A line without decorations still starts a new record when it looks like one of these.
_RECORD_START = re.compile(
    r"^(?:Traceback \(most recent call last\)|File \"|During handling|The above exception"
    r"|[A-Za-z_][\w.]*(?:Error|Exception|Warning|Interrupt|Exit)\b"
    r"|#|\$ |> |vllm |python|Process |\*\*|```|---|===|\|"
    # a `ps aux` row: USER PID %CPU %MEM VSZ RSS …
    r"|[\w.+-]+\s+\d+\s+\d+(?:\.\d+)?\s+\d+(?:\.\d+)?\s+\d+\s+\d+\s"
    # a row of nvidia-smi's CSV process query: "48213, python3, 30712 MiB"
    r"|\d+,\s*[^,]+,\s*\d+\s?MiB\s*$)"
)


@dataclass(frozen=True)
class Line:
    """One physical line after cleaning: its 1-based number, body, and whether it had a header."""

    number: int
    body: str
    decorated: bool
    tag: str = ""  # process tag such as "EngineCore_DP0" or "RayWorkerWrapper"
    level: str = ""  # the logger header's level ("INFO", "WARNING" …) when the line had one
    source: str = ""  # the logger header's source file ("core.py", "model_runner.py")


@dataclass
class Record:
    """A logical message: the first line's number and the joined bodies of its lines."""

    number: int
    text: str
    lines: int = 1
    tag: str = ""
    level: str = ""  # the first line's logger level ("" when it had no logger header)
    source: str = ""  # the first line's logger source file ("" when it had no logger header)


def clean(raw: str) -> str:
    """Remove ANSI escapes and control characters; keep tabs; cut very long lines."""
    if len(raw) > MAX_LINE_CHARS:
        raw = raw[:MAX_LINE_CHARS]
    if "\x1b" in raw:
        raw = _ANSI.sub("", raw)
    raw = raw.replace("\ufffd", "")
    if "\u2018" in raw or "\u2019" in raw or "\u201c" in raw or "\u201d" in raw:
        # a forum or a word processor made the quotes curly: vLLM's messages use straight ones
        raw = raw.translate(_STRAIGHT_QUOTES)
    return _CONTROL.sub("", raw).rstrip()


def strip_decorations(text: str) -> tuple[str, bool, str, str, str]:
    """Return the message body of a cleaned line, whether a decoration was removed, the
    process tag (``EngineCore_DP0``, ``Worker_TP1`` …) if the line carried one, the logger
    header's level (``INFO``, ``WARNING`` …) and its source file (``core.py``); the last two
    are empty without a logger header."""
    decorated = False
    tag = ""
    level = ""
    source = ""
    for _ in range(8):
        stripped = text.lstrip() if decorated else text
        m = _ANY_PREFIX.match(stripped)
        if m is None or m.end() == 0:
            break
        if m.lastgroup == _TAG_GROUP and not tag:
            tag = m.group(0).lstrip("(").split(" ", 1)[0]
        elif m.lastgroup == _LEVEL_GROUP and not level:
            level = m.group(0).split(None, 1)[0]
            found = _SOURCE_FILE.search(m.group(0))
            source = found.group(1) if found else ""
        text = stripped[m.end() :]
        decorated = True
    if "[repeated" in text:
        text = _RAY_REPEAT.sub("", text)
    return text, decorated, tag, level, source


def split_physical(chunks: Iterable[str]) -> Iterator[str]:
    """Yield physical lines from strings that may hold several lines (``\\n`` or ``\\r``)."""
    for chunk in chunks:
        if "\n" not in chunk and "\r" not in chunk:
            yield chunk
            continue
        start = 0
        length = len(chunk)
        while start < length:
            nl = chunk.find("\n", start)
            end = length if nl < 0 else nl
            piece = chunk[start:end]
            if "\r" in piece:
                # progress bars rewrite the line with \r: each segment is its own line
                yield from (p for p in piece.split("\r") if p)
            else:
                yield piece
            if nl < 0:
                break
            start = nl + 1


def iter_lines(chunks: Iterable[str]) -> Iterator[Line]:
    """Number and clean physical lines."""
    for number, raw in enumerate(split_physical(chunks), start=1):
        body, decorated, tag, level, source = strip_decorations(clean(raw))
        yield Line(
            number=number, body=body, decorated=decorated, tag=tag, level=level, source=source
        )


def continues(prev: Record, line: Line) -> bool:
    """Whether an undecorated line is the rest of the previous record (wrapped by a reporter
    or a multi-line V0 record) rather than a new message."""
    if line.decorated or not line.body.strip():
        return False
    if prev.lines >= MAX_RECORD_LINES or len(prev.text) >= MAX_RECORD_CHARS:
        return False
    body = line.body
    stripped = body.lstrip()
    if _RECORD_START.match(stripped):
        return False
    if stripped.startswith("^") or prev.text.lstrip().startswith('File "'):
        return body[:1] not in (" ", "\t") and not stripped.startswith("^")
    first = stripped[:1]
    # a wrapped message continues in lower case, with a number, or indented; a capitalised
    # undecorated line ("Killed", "Process SpawnProcess-1:") is a message of its own
    return first.islower() or first.isdigit() or body[:1] in (" ", "\t")


# whole words that vLLM's memory messages wrap at: a line ending or starting with one of these
# was wrapped between two words ("on startup is" + "less than desired"), not inside one
_WHOLE_WORDS = frozenset(
    "a an the is are was were be been of to in on at by for with than and or not no as from"
    " that this it its less more can cannot when which try memory free gpu desired startup"
    " cache blocks available needed larger smaller increasing decreasing model tokens stored"
    " utilization engine initializing seconds secs".split()
)


# a hard wrap cuts a line at the terminal's or the page's width: a shorter line ended where
# its writer ended it, never inside a word
_MIN_WRAPPED_CHARS = 50


def join_continuation(prev: str, body: str, prev_line_chars: int) -> str:
    # a hard wrap inside a word ("KV cach" + "e is needed") joins without a space
    if (
        prev_line_chars >= _MIN_WRAPPED_CHARS
        and body[:1] not in (" ", "\t")
        and prev[-1:].isalnum()
        and body[:1].isalnum()
    ):
        last = prev.rsplit(None, 1)[-1].lower() if prev.strip() else ""
        first = body.split(None, 1)[0].lower()
        if body[:1].islower() and last not in _WHOLE_WORDS and first not in _WHOLE_WORDS:
            return prev + body
    return prev + " " + body.strip()


def iter_records(chunks: Iterable[str]) -> Iterator[Record]:
    """Yield logical records: a line plus the continuation lines that belong to it."""
    current: Record | None = None
    prev_chars = 0  # the length of the last physical line read
    for line in iter_lines(chunks):
        if current is not None and continues(current, line):
            current.text = join_continuation(current.text, line.body, prev_chars)
            current.lines += 1
            prev_chars = len(line.body)
            continue
        prev_chars = len(line.body)
        if current is not None:
            yield current
        current = Record(
            number=line.number,
            text=line.body,
            tag=line.tag,
            level=line.level,
            source=line.source,
        )
    if current is not None:
        yield current


def read_binary_lines(stream: BinaryIO, chunk_bytes: int = 1 << 16) -> Iterator[str]:
    """Decode a binary stream line by line without ever holding more than one line.

    Lines longer than ``MAX_LINE_CHARS`` are cut and the rest skipped up to the next newline,
    so a multi-gigabyte file without newlines is still read in bounded memory. Invalid UTF-8
    becomes U+FFFD and is then dropped by :func:`clean`.
    """
    while True:
        piece = stream.readline(chunk_bytes)
        if not piece:
            return
        if not piece.endswith(b"\n") and len(piece) >= chunk_bytes:
            head = piece
            # skip the remainder of an over-long line
            while True:
                rest = stream.readline(chunk_bytes)
                if not rest or rest.endswith(b"\n"):
                    break
            yield head[:MAX_LINE_CHARS].decode("utf-8", errors="replace")
            continue
        yield piece.decode("utf-8", errors="replace").rstrip("\n")
