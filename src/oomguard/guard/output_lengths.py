"""Learned output lengths: how many tokens each class of request really generates (pure).

Clients set ``max_tokens`` far above what they generate, and a reservation of ``max_tokens``
per request holds back admission for tokens that never come. The guard learns, from the
requests it completes, the output lengths of each *class* of request — model, route, API key
(where keys exist) and the prompt's length band — and the projection reserves a high quantile
of them instead: never more than ``max_tokens``, and ``max_tokens`` itself until a class has
``min_samples`` completions. A class without enough completions of its own borrows those of
its model, route and key across every prompt band.

A completion that stopped at its own ``max_tokens`` is a *censored* sample: the request would
have generated at least that many. For a new request with a limit of ``M`` it counts as ``M``
when it was stopped at ``M`` or later, and as unbounded (the reservation falls back to ``M``)
when it was stopped earlier: a sample never claims a length it did not show.

A request is planned with its class's lengths (a :class:`LengthPlan`) and charged as it
streams: a sequence that has generated ``g`` tokens is planned at the quantile of the lengths
*longer than* ``g`` (those it may still turn out to be), so one that outgrows its first
reservation is planned longer at once, up to ``max_tokens`` when it outgrew every length seen;
a preemption or KV usage above what
admission allows *tightens* the quantile at once (its tail is halved: 0.95, 0.975, 0.9875, …,
until every class reserves ``max_tokens``), and calm relaxes it one level at a time.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

# A class of requests: (model, route, API key or "", prompt band).
LengthClass = tuple[Hashable, ...]
# Plans kept for reuse (per class and max_tokens) before the cache starts over.
_PLANS_KEPT = 4096


@dataclass(frozen=True)
class OutputLengthSettings:
    """How output lengths are learned and reserved.

    ``quantile``: the share of a class's recent outputs the reservation covers (0 turns the
    learning off: every request reserves ``max_tokens``). ``min_samples``: completions a class
    needs before its quantile is used. ``window``: completions remembered per class.
    ``max_tightenings``: tightenings after which every class reserves ``max_tokens``.
    ``relax_after_s``: calm time after which one tightening is undone.
    """

    quantile: float = 0.95
    min_samples: int = 8
    window: int = 256
    max_tightenings: int = 4
    relax_after_s: float = 60.0


def prompt_band(prompt_tokens: int) -> int:
    """The prompt-length band (powers of two from 64 tokens: 0–63, 64–127, 128–255, …)."""
    return max(prompt_tokens, 0).bit_length() if prompt_tokens >= 64 else 0


def length_class(
    model: str | None, route: str, api_key: str | None, prompt_tokens: int
) -> LengthClass:
    """The class a request's output length is learned in."""
    return (model or "", route, api_key or "", prompt_band(prompt_tokens))


@dataclass(frozen=True)
class _Sample:
    generated: int
    # The limit it stopped at (None: it ended on its own, below its limit).
    stopped_at: int | None


@dataclass
class OutputLengths:
    """Recent output lengths per class and the quantile reserved for new requests."""

    settings: OutputLengthSettings = field(default_factory=OutputLengthSettings)
    tightenings: int = 0
    _samples: dict[LengthClass, deque[_Sample]] = field(default_factory=dict)
    _tightened_at_s: float | None = None
    # per window: (samples seen when it was built, the sorted lengths as the projected sum
    # reads them), rebuilt only after new completions
    _sorted: dict[LengthClass, tuple[int, np.ndarray]] = field(default_factory=dict)
    _seen: dict[LengthClass, int] = field(default_factory=dict)
    # the plan made last per class and limit, with the samples seen when it was made: a
    # queue retries its requests often, and a plan is rebuilt only after new completions
    _plans: dict[tuple[LengthClass, int], tuple[int, LengthPlan]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.settings.quantile > 0.0

    @property
    def quantile(self) -> float:
        """The quantile reserved now (1.0: ``max_tokens``)."""
        if self.tightenings >= self.settings.max_tightenings:
            return 1.0
        return 1.0 - (1.0 - self.settings.quantile) / (2**self.tightenings)

    def samples(self, cls: LengthClass) -> int:
        """Completions remembered for ``cls``."""
        return len(self._samples.get(cls, ()))

    def observe(self, cls: LengthClass, generated: int, max_new_tokens: int) -> None:
        """A sequence of class ``cls`` ended after ``generated`` tokens of ``max_new_tokens``."""
        if not self.enabled or generated < 0 or max_new_tokens <= 0:
            return
        stopped = max_new_tokens if generated >= max_new_tokens else None
        sample = _Sample(min(generated, max_new_tokens), stopped)
        for key in (cls, _coarse(cls)):
            window = self._samples.setdefault(key, deque(maxlen=self.settings.window))
            window.append(sample)
            self._seen[key] = self._seen.get(key, 0) + 1

    def plan(self, cls: LengthClass | None, max_new_tokens: int) -> LengthPlan | None:
        """How a new request of ``cls`` limited to ``max_new_tokens`` is planned (None: at its
        ``max_tokens``, when nothing is known or learning is off)."""
        if cls is None or not self.enabled or self.quantile >= 1.0:
            return None
        enough = self.settings.min_samples
        key: LengthClass = cls
        window = self._samples.get(key)
        if window is None or len(window) < enough:
            key = _coarse(cls)
            window = self._samples.get(key)
        if window is None or len(window) < enough:
            return None
        seen = self._seen.get(key, 0)
        cached = self._plans.get((key, max_new_tokens))
        if cached is not None and cached[0] == seen and cached[1].quantile == self.quantile:
            return cached[1]
        if len(self._plans) >= _PLANS_KEPT:
            self._plans.clear()
        values = tuple(sorted(_value(s, max_new_tokens) for s in window))
        lengths = self._lengths(key, window)
        made = LengthPlan(values, self.quantile, max_new_tokens, lengths)
        self._plans[(key, max_new_tokens)] = (seen, made)
        return made

    def _lengths(self, key: LengthClass, window: deque[_Sample]) -> np.ndarray:
        """The window's lengths, sorted, a censored one as unbounded (one array per window
        between completions: the requests planned from it share it)."""
        seen = self._seen.get(key, 0)
        cached = self._sorted.get(key)
        if cached is None or cached[0] != seen:
            lengths = np.sort(
                np.fromiter(
                    (math.inf if s.stopped_at is not None else s.generated for s in window),
                    float,
                    len(window),
                )
            )
            cached = (seen, lengths)
            self._sorted[key] = cached
        return cached[1]

    def reservation(self, cls: LengthClass | None, max_new_tokens: int) -> int:
        """Output tokens to reserve for a new request of ``cls`` limited to ``max_new_tokens``."""
        plan = self.plan(cls, max_new_tokens)
        return max_new_tokens if plan is None else plan.planned(0)

    def tighten(self, now_s: float) -> None:
        """A preemption, or KV usage above what admission allows: cover more of the tail."""
        if self.tightenings < self.settings.max_tightenings:
            self.tightenings += 1
        self._tightened_at_s = now_s

    def relax(self, now_s: float) -> None:
        """Undo one tightening after ``relax_after_s`` of calm since the last change."""
        if self.tightenings == 0:
            return
        if self._tightened_at_s is None:
            self._tightened_at_s = now_s
        elif now_s - self._tightened_at_s >= self.settings.relax_after_s:
            self.tightenings -= 1
            self._tightened_at_s = now_s


@dataclass(frozen=True)
class LengthPlan:
    """The output lengths a request's class showed (sorted; ``inf``: longer than this request
    may run), the quantile to plan at, and the request's own limit."""

    values: tuple[float, ...]
    quantile: float
    max_new_tokens: int
    # The class's lengths as the projected sum reads them (sorted; a censored one unbounded):
    # below this request's limit they say what ``values`` says.
    lengths: np.ndarray | None = field(default=None, compare=False, repr=False)
    # planned(generated), computed once per value of ``generated``
    _planned: dict[int, int] = field(default_factory=dict, compare=False, repr=False)

    def planned(self, generated: int) -> int:
        """Output tokens to plan a sequence for once it has generated ``generated`` (see
        :meth:`_plan_for`)."""
        out = self._planned.get(generated)
        if out is None:
            out = self._planned[generated] = self._plan_for(generated)
        return out

    def _plan_for(self, generated: int) -> int:
        """Output tokens to plan a sequence for once it has generated ``generated``: the
        quantile of the lengths longer than that (``max_new_tokens`` when none is)."""
        longer = self.values[bisect_right(self.values, generated) :]
        if not longer:
            return self.max_new_tokens
        k = min(max(math.ceil(self.quantile * len(longer)) - 1, 0), len(longer) - 1)
        v = longer[k]
        if math.isinf(v):
            return self.max_new_tokens
        return max(min(int(v), self.max_new_tokens), generated + 1, 1)


def _coarse(cls: LengthClass) -> LengthClass:
    """The class without its prompt band (model, route, key): every band's completions."""
    return (*cls[:-1], None)


def _value(sample: _Sample, max_new_tokens: int) -> float:
    """What ``sample`` says about a new request limited to ``max_new_tokens``."""
    if sample.stopped_at is None:
        return float(min(sample.generated, max_new_tokens))
    if sample.stopped_at >= max_new_tokens:
        return float(max_new_tokens)
    return math.inf
