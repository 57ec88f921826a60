"""The stage's pure parts: the client's KV tracker and the verdict."""

from __future__ import annotations

from oomguard.bench.client import RequestRecord
from oomguard.bench.stage import (
    KvTracker,
    Sample,
    StageResult,
    StageSpec,
    judge,
    wave_peak_blocks,
)


def rec(index: int, prompt: int, out: int, max_tokens: int) -> RequestRecord:
    r = RequestRecord(
        index=index, stage=1, slot=index, prompt_tokens=prompt, max_tokens=max_tokens, due_s=0.0
    )
    r.output_tokens = out
    return r


def test_tracker_counts_the_blocks_of_the_next_step() -> None:
    t = KvTracker(usable_blocks=15, block_size=128)
    a = rec(1, 100, 27, 156)
    t.update(a)
    assert t.total == 1  # 127 tokens after the next step
    a.output_tokens = 28
    t.update(a)
    assert t.total == 1  # 128: the first block is full
    a.output_tokens = 29
    t.update(a)
    assert t.total == 2  # the 129th token needs a second block
    a.output_tokens = 156
    t.update(a)
    assert t.total == 2  # the last token is never stored: 255 tokens
    t.mark_finishing(a)
    assert t.needed == 0 and t.peak == 2
    t.remove(a)
    assert t.total == 0 and t.needed == 0


def test_tracker_sees_demand_beyond_the_pool() -> None:
    t = KvTracker(usable_blocks=15, block_size=128)
    for i in range(8):
        t.update(rec(i, 100, 30, 156))
    assert t.needed == 16 and t.usage(t.needed) > 1.0


def stage(samples: list[Sample], **kw: object) -> StageResult:
    spec = StageSpec(index=1, concurrency=4, request_indices=(1, 2, 3), kv_limit=0.9)
    res = StageResult(spec=spec, start_s=0.0, end_s=1.0, samples=samples)
    for k, v in kw.items():
        setattr(res, k, v)
    judge(res)
    return res


def sample(kv: float, pre: float) -> Sample:
    return Sample(
        t_s=0.1, stage=1, concurrency=4, in_flight=4, read_s=0.01, kv_usage=kv, preemptions=pre
    )


def test_verdicts() -> None:
    assert stage([sample(0.5, 0), sample(0.8, 0)]).safe is True
    bad = stage([sample(0.5, 0), sample(0.8, 2)])
    assert bad.safe is False and bad.reasons == ["2 preemption(s)"]
    high = stage([sample(0.93, 0)])
    assert high.safe is False and "0.930 (> 0.9)" in high.reasons[0]
    between = stage([sample(0.5, 0)], kv_peak_client=0.95)
    assert between.safe is False and "between two samples" in between.reasons[0]
    cut = stage([sample(0.5, 0)], stop_reason="budget")
    assert cut.safe is None
    r = RequestRecord(index=1, stage=1, slot=0, prompt_tokens=1, max_tokens=1, due_s=0.0)
    r.error = "HTTP 500: boom"
    failed = stage([sample(0.5, 0)], records=[r])
    assert failed.safe is False and "HTTP 500: boom" in failed.reasons[0]


def test_a_lagging_client_is_named() -> None:
    from oomguard.bench.runner import client_warnings

    calm = stage([sample(0.5, 0)], loop_lags_s=[0.001] * 100, client_cpu_fraction=0.2)
    busy = stage([sample(0.5, 0)], loop_lags_s=[0.001] * 90 + [0.2] * 10, client_cpu_fraction=0.97)
    assert client_warnings([calm]) == []
    warned = client_warnings([busy])
    assert len(warned) == 2 and "up to 200 ms" in warned[0] and "97% of a core" in warned[1]


def test_a_server_cap_needs_requests_seen_waiting() -> None:
    from oomguard.bench.runner import _server_cap

    def at(running: float, waiting: float) -> Sample:
        return Sample(
            t_s=0.1,
            stage=1,
            concurrency=4,
            in_flight=4,
            read_s=0.01,
            kv_usage=0.5,
            preemptions=0,
            running=running,
            waiting=waiting,
        )

    missed = stage([at(2, 0), at(3, 0)])  # samples that missed the moment all 4 ran
    capped = stage([at(3, 1), at(3, 1)])  # the server ran 3 and queued the 4th
    assert _server_cap([missed]) is None
    assert _server_cap([capped]) == 3


def test_a_wave_sent_together_peaks_before_its_first_end() -> None:
    # 100 + 156 tokens: 255 stored at the end, two blocks of 128 each; 8 need 16
    assert wave_peak_blocks([rec(i, 100, 0, 156) for i in range(8)], 128) == 16
    # a short request ends first: the peak is either all at its end or the long ones later
    short, long_ = rec(0, 100, 0, 20), rec(1, 300, 0, 300)
    assert wave_peak_blocks([short, long_], 128) == max(1 + 3, 5)


def test_a_clean_stage_whose_wave_cannot_fit_ran_spread_out() -> None:
    """Eight requests that need 16 of 15 blocks together, a stage that saw no preemption, no
    KV above the watermark and no queue: they did not run together, so concurrency 8 was not
    tested (inconclusive, and the bench runs it again)."""
    clean = [sample(0.27, 0)]
    spread = stage(clean, wave_need=16 / 15)
    assert spread.safe is None and "need 1.07 of the pool together" in spread.staggered
    assert stage(clean, wave_need=13 / 15).safe is True  # it fits (limit 0.9): safe
    queued = Sample(t_s=0.1, stage=1, concurrency=4, in_flight=4, read_s=0.0, waiting=1.0)
    assert stage([*clean, queued], wave_need=16 / 15).safe is True  # the server capped it
    assert stage([sample(0.27, 1)], wave_need=16 / 15).safe is False  # it preempted
