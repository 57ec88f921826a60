"""Follow a log as it is written: feed lines one at a time, read what they showed at once.

:func:`~oomguard.logs.parser.parse_stream` reads a finished log. A launcher (``oomguard
serve``) needs the same reading while the engine is still writing: which phase it reached,
each number the moment its line appears, and a memory failure on the very line that reports
it, so the engine can be stopped before it spends more time. :class:`LogFollower` runs the
same catalogue through the same record joining (a record ends when the next line starts a new
one) and, so that no failure waits for the next line, also reads the record still open.

    follower = LogFollower()
    for line in lines:
        news = follower.feed(line)
        if news.failure is not None: ...
    parsed = follower.parsed()        # a ParsedLog of everything fed so far
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from oomguard.logs.lines import (
    Line,
    Record,
    clean,
    continues,
    join_continuation,
    split_physical,
    strip_decorations,
)
from oomguard.logs.parsed import LOGGED_MEMORY_SIGNATURES, Evidence, Observed, ParsedLog, Phase
from oomguard.logs.parser import LogBuilder

# logged memory signatures that report a state or a narrative rather than this start failing:
# a `free` listing with little RAM left, a story of memory growing
_NOT_A_FAILURE = frozenset({"host_ram_low", "memory_growth"})
FAILURE_SIGNATURES = tuple(s for s in LOGGED_MEMORY_SIGNATURES if s not in _NOT_A_FAILURE)


@dataclass(frozen=True)
class Failure:
    """A memory failure the log reported: the signature (or ``oom``) and its line."""

    signature: str
    evidence: Evidence


@dataclass
class LineNews:
    """What one fed line showed: values newly stated, phase markers, a failure."""

    fields: dict[str, Observed[Any]] = field(default_factory=dict)
    phases: list[tuple[Phase, Evidence]] = field(default_factory=list)
    failure: Failure | None = None

    @property
    def empty(self) -> bool:
        """Whether the line showed nothing new."""
        return not self.fields and not self.phases and self.failure is None


class _MarkingBuilder(LogBuilder):
    """The parser's builder, also noting every phase marker (the parser keeps only the first
    of each phase; a follower wants each as it comes)."""

    def __init__(self) -> None:
        super().__init__()
        self.markers: list[tuple[Phase, Evidence]] = []

    def phase(self, phase: Phase, ev: Evidence) -> None:
        """Record the phase as the parser does, and note the marker."""
        super().phase(phase, ev)
        self.markers.append((phase, ev))


def _failure_of(log: ParsedLog) -> Failure | None:
    """The first memory failure ``log`` shows (its earliest line), or None."""
    found: list[Failure] = [
        Failure(name, log.signatures[name]) for name in FAILURE_SIGNATURES if name in log.signatures
    ]
    if log.ooms:
        found.append(Failure("oom", log.ooms[0].evidence))
    return min(found, key=lambda f: f.evidence.line) if found else None


class LogFollower:
    """Read a log line by line as it is written (see the module's docstring).

    Not thread-safe: feed it from one thread (an engine's output reader) and read
    :meth:`parsed` from that thread or after feeding stopped.
    """

    def __init__(self) -> None:
        self._builder = _MarkingBuilder()
        self._open: Record | None = None
        self._prev_chars = 0
        self._number = 0
        self._failure: Failure | None = None

    @property
    def lines(self) -> int:
        """How many physical lines were fed."""
        return self._number

    @property
    def failure(self) -> Failure | None:
        """The first memory failure seen so far."""
        return self._failure

    def feed(self, chunk: str) -> LineNews:
        """Feed one line (or a chunk holding several); return what it showed."""
        news = LineNews()
        for raw in split_physical([chunk]):
            self._number += 1
            body, decorated, tag, level, source = strip_decorations(clean(raw))
            line = Line(self._number, body, decorated, tag, level, source)
            if self._open is not None and continues(self._open, line):
                self._open.text = join_continuation(self._open.text, line.body, self._prev_chars)
                self._open.lines += 1
            else:
                if self._open is not None:
                    self._close_record(news)
                self._open = Record(line.number, line.body, tag=tag, level=level, source=source)
            self._prev_chars = len(line.body)
            self._peek_open(news)
        return news

    def _close_record(self, news: LineNews) -> None:
        """Feed the finished open record to the builder and note what it added."""
        assert self._open is not None
        builder = self._builder
        before = dict(builder.log.fields)
        builder.markers = []
        builder.feed(self._open)
        self._open = None
        for name, obs in builder.log.fields.items():
            if before.get(name) is not obs:
                news.fields[name] = obs
        news.phases.extend(builder.markers)
        if self._failure is None:
            failure = _failure_of(builder.log)
            if failure is not None:
                self._failure = failure
                news.failure = failure

    def _peek_open(self, news: LineNews) -> None:
        """Read the record still open on its own, so a failure on the last line written is
        seen now rather than when the next line arrives."""
        if self._failure is not None or self._open is None or not self._open.text:
            return
        probe = LogBuilder()
        probe.feed(self._open)
        failure = _failure_of(probe.log)
        if failure is not None:
            self._failure = failure
            news.failure = failure

    def parsed(self) -> ParsedLog:
        """Everything fed so far as a finished :class:`ParsedLog` (the open record included);
        feeding may go on afterwards."""
        builder = copy.deepcopy(self._builder)
        if self._open is not None:
            builder.feed(copy.copy(self._open))
        return builder.finish(self._number)
