"""What a deployment must serve: one :class:`Workload` for plan, the doctor's lint and bench.

The flags that state it (``--p99-tokens``, ``--concurrency``, ``--shared-prefix``,
``--headroom-gib``, ``--margin``) are declared once in :mod:`oomguard.cli_options` and parsed
here, so every face reads ``16k`` and ``0.3`` the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from oomguard.errors import BadInput
from oomguard.memory.kv import KV_MARGIN
from oomguard.units import GIB, gib_rounded

# spare KV capacity a sized configuration keeps over the workload (one definition: memory.kv)
DEFAULT_MARGIN = KV_MARGIN


@dataclass(frozen=True)
class Workload:
    """What the deployment must serve.

    ``p99_tokens`` is the 99th-percentile prompt+output length, ``concurrency`` the peak number
    of sequences in flight (0: not stated), ``shared_prefix_tokens`` the prefix all requests
    share (stored once with prefix caching), ``margin`` the spare KV capacity demanded
    (0.1 = 10 %), and ``headroom_bytes`` GPU memory kept free for co-tenants.
    """

    p99_tokens: int = 0  # 0: not stated
    concurrency: int = 0  # 0: not stated
    shared_prefix_tokens: int = 0
    margin: float = DEFAULT_MARGIN
    headroom_bytes: int = 0
    stated: bool = True  # False when oomguard assumed it (one request at full context)

    def to_dict(self) -> dict[str, Any]:
        return {
            "p99_tokens": self.p99_tokens,
            "concurrency": self.concurrency,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "margin": self.margin,
            "headroom_gib": gib_rounded(self.headroom_bytes),
            "stated": self.stated,
        }


def token_count(value: int | str | None, flag: str) -> int | None:
    """A positive token count as vLLM writes one (``8192``, ``8k``, ``16K``); None stays None."""
    from oomguard.vllm_args import parse_human_int

    if value is None:
        return None
    number = parse_human_int(str(value), flag=flag)
    if number <= 0:
        raise BadInput(
            f"{flag} {value}: a length must be positive", f"pass a token count to {flag}"
        )
    return number


def shared_prefix_tokens(value: float | int | str | None, p99_tokens: int | None) -> int:
    """A shared prefix as tokens: a fraction (0 < x < 1) of the P99, or a token count (``2k``).

    A fraction needs the P99; a count must not exceed it when it is known.
    """
    from oomguard.vllm_args import parse_human_int

    if value is None:
        return 0
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return shared_prefix_tokens(parse_human_int(text, flag="--shared-prefix"), p99_tokens)
        value = int(number) if number >= 1 and number == int(number) else number
    if isinstance(value, float) and 0 <= value < 1:
        if p99_tokens is None:
            raise BadInput(
                f"--shared-prefix {value} is a fraction of the P99, which is not given",
                "pass --p99-tokens too, or the prefix in tokens",
            )
        return int(value * p99_tokens)
    if value < 0 or (isinstance(value, float) and value != int(value)):
        raise BadInput(
            f"--shared-prefix {value} is neither a fraction below 1 nor a token count",
            "pass e.g. 0.3 (30 % of the P99) or 2048 (tokens)",
        )
    tokens = int(value)
    if p99_tokens is not None and tokens > p99_tokens:
        raise BadInput(
            f"--shared-prefix {tokens} tokens is longer than --p99-tokens {p99_tokens}",
            "the shared prefix is part of every request; pass at most the P99",
        )
    return tokens


def stated_workload(
    p99_tokens: int | str | None = None,
    concurrency: int | None = None,
    shared_prefix: float | int | str | None = None,
    headroom_gib: float = 0.0,
    margin: float = DEFAULT_MARGIN,
) -> Workload:
    """The workload as the user stated it on the command line; numbers not given stay 0."""
    p99 = token_count(p99_tokens, "--p99-tokens")
    if concurrency is not None and concurrency <= 0:
        raise BadInput(
            f"--concurrency {concurrency} must be at least 1",
            "pass the peak number of concurrent requests",
        )
    if headroom_gib < 0:
        raise BadInput(f"--headroom-gib {headroom_gib} is negative", "pass 0 or more GiB")
    if margin < 0:
        raise BadInput(
            f"--margin {margin} is negative", "pass a fraction such as 0.1 (10 % spare KV)"
        )
    return Workload(
        p99_tokens=p99 or 0,
        concurrency=concurrency or 0,
        shared_prefix_tokens=shared_prefix_tokens(shared_prefix, p99),
        margin=margin,
        headroom_bytes=int(headroom_gib * GIB),
        stated=p99 is not None or concurrency is not None,
    )
