"""`oomguard bench` against real vLLM on CPU (the session's shared tiny server: a pool of 16
blocks of 128 tokens, one of them vLLM's null block, so 15 usable).

The load is 100 prompt tokens + 156 generated: a request stores 255 tokens at its end, two
blocks, so 7 requests fit in 14 of the 15 blocks (KV 0.933, under the 0.95 high watermark) and
an 8th preempts. The test sweeps every concurrency from 1 to 10 itself (its own client, one
synchronized wave each, preemptions read from vLLM's counter) and compares.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from burst import BurstResult, GuardProcess, make_prompts, run_burst
from conftest import SHARED_POOL_BLOCKS, require_program, wait_vllm_idle
from openai_stub import OpenAIStub
from tinymodel import TinyModel
from vllm_bench import vllm_bench_serve
from vllm_server import (
    ServeConfig,
    VllmServer,
    fetch_metrics,
    free_port,
    metric_value,
    running_vllm,
)

from oomguard.errors import EXIT_ENVIRONMENT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PROMPT_TOKENS, MAX_TOKENS = 100, 156
USABLE_BLOCKS = SHARED_POOL_BLOCKS - 1
BLOCKS_PER_REQUEST = 2
SWEEP = range(1, 11)


def oomguard(
    exe: list[str], *args: str, env: dict[str, str] | None = None, timeout_s: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run the CLI; the JSON (with --json) on stdout, progress and errors on stderr."""
    return subprocess.run(
        [*exe, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )


def bench_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.stdout.strip(), f"no JSON; rc={proc.returncode}\n{proc.stderr[-3000:]}"
    return dict(json.loads(proc.stdout))


@dataclass
class SearchRun:
    data: dict[str, Any]
    report: Path
    home: Path
    returncode: int
    stderr: str


@pytest.fixture(scope="module")
def search_run(
    shared_vllm: VllmServer, oomguard_exe: list[str], tmp_path_factory: pytest.TempPathFactory
) -> SearchRun:
    """One search from concurrency 1 (so it grows and bisects), with the report and the
    calibration store in temporary directories."""
    home = tmp_path_factory.mktemp("oomguard-home")
    report = tmp_path_factory.mktemp("bench-report")
    wait_vllm_idle(shared_vllm.base_url)
    proc = oomguard(
        oomguard_exe,
        "bench",
        shared_vllm.base_url,
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--start-concurrency",
        "1",
        "--json",
        "--report",
        str(report),
        "--gpu",
        "cpu",
        "--budget-s",
        "300",
        env={"OOMGUARD_HOME": str(home)},
    )
    wait_vllm_idle(shared_vllm.base_url)
    print(proc.stderr)
    return SearchRun(bench_json(proc), report, home, proc.returncode, proc.stderr)


@pytest.fixture(scope="module")
def sweep(shared_vllm: VllmServer, tiny_model: TinyModel) -> dict[int, BurstResult]:
    """The test's own exhaustive sweep: c distinct requests at once for every c in SWEEP."""
    url, model = shared_vllm.base_url, str(tiny_model.path)
    out: dict[int, BurstResult] = {}
    for c in SWEEP:
        for attempt in range(3):
            wait_vllm_idle(url)
            prompts = make_prompts(tiny_model.path, c, PROMPT_TOKENS, 700_000 + 100 * c + attempt)
            out[c] = run_burst(f"c={c}", url, url, model, prompts, MAX_TOKENS)
            # More than the pool's blocks at once must preempt; a wave that did not is one a
            # loaded machine delivered staggered (the early requests ended before the last
            # ones grew), so it did not test the pool: send it again.
            if out[c].preemptions > 0 or c * BLOCKS_PER_REQUEST <= USABLE_BLOCKS:
                break
            print(
                f"c={c}: no preemption, first tokens spread over "
                f"{_ttft_spread_s(out[c]):.2f} s; sent again"
            )
    wait_vllm_idle(url)
    print({c: (b.succeeded, b.preemptions) for c, b in out.items()})
    return out


def _ttft_spread_s(burst: BurstResult) -> float:
    ttfts = [r.ttft_s for r in burst.results if r.ttft_s is not None]
    return max(ttfts) - min(ttfts) if ttfts else 0.0


def test_search_matches_the_exhaustive_sweep(
    search_run: SearchRun, sweep: dict[int, BurstResult]
) -> None:
    safe = [
        c
        for c in SWEEP
        if sweep[c].preemptions == 0
        and sweep[c].succeeded == c
        and c * BLOCKS_PER_REQUEST / USABLE_BLOCKS <= 0.95
    ]
    sweep_limit = max(c for c in SWEEP if all(x in safe for x in range(1, c + 1)))
    assert sweep[sweep_limit + 1].preemptions > 0, "the sweep must cross the boundary"
    data = search_run.data
    print(
        f"bench: {data['max_safe_concurrency']}  sweep: {sweep_limit}  "
        f"stages: {[(s['concurrency'], s['safe']) for s in data['stages']]}"
    )
    assert search_run.returncode == 0
    assert abs(data["max_safe_concurrency"] - sweep_limit) <= 1
    assert data["exact"] is True
    tested = [s["concurrency"] for s in data["stages"]]
    assert tested[:3] == [1, 2, 4], "from 1 the search grows geometrically"
    assert data["first_guess"] == 7  # 0.95 x 15 blocks / 2 blocks per request
    assert data["conditions"]["metrics_source"] == "vllm"


def test_recommendation_and_calibration(search_run: SearchRun, tiny_model: TinyModel) -> None:
    data = search_run.data
    safe = data["max_safe_concurrency"]
    rec = data["recommended"]
    assert rec["max_num_seqs"] == safe
    high, low = rec["high_watermark"], rec["low_watermark"]
    # the guard prices a peak request at 2 blocks: high admits `safe` of them and not one more
    assert safe * BLOCKS_PER_REQUEST <= high * USABLE_BLOCKS < (safe + 1) * BLOCKS_PER_REQUEST
    assert 0 < low < high
    assert f"--max-num-seqs {safe}" in rec["vllm_command"]
    assert rec["guard_config"]["backends"][0]["num_gpu_blocks"] == SHARED_POOL_BLOCKS
    # bytes per token from the pool the server states, equal to the model's own figure
    assert data["measured"]["kv_bytes_per_token"] == tiny_model.kv_bytes_per_token
    stored = json.loads((search_run.home / "calibration.json").read_text())["entries"]
    (row,) = [r for rows in stored.values() for r in rows]
    assert row["max_safe_concurrency"] == safe and row["kv_tokens"] == 2048
    assert row["bench_sequence_tokens"] == PROMPT_TOKENS + MAX_TOKENS
    assert data["calibration"]["stored"] is True


def test_an_unsafe_stage_stops_within_a_second(search_run: SearchRun) -> None:
    unsafe = [s for s in search_run.data["stages"] if s["safe"] is False]
    assert unsafe, "the search must have met an unsafe concurrency"
    for s in unsafe:
        print(
            f"concurrency {s['concurrency']}: stopped by {s['stop_reason']} ({s['stop_detail']}); "
            f"{s['stop_latency_s']} s after the sign, at most {s['stop_bound_s']} s after the "
            f"last clean sample; server quiet {s['server_quiet_s']} s; preemptions "
            f"{s['preemptions']}; loop lag max {s['loop_lag_s']['max']} s; errors "
            f"{s['error_examples']}"
        )
        assert s["stop_reason"] in ("preemption", "kv_full")
        assert s["requests"]["sent"] < s["requests"]["planned"], "the stage did not run on"
        # the stop runs on the client's event loop: a loaded machine that stalls the loop
        # (measured through the stage) delays it by as much, which is not the bench's doing
        lag = s["loop_lag_s"]["max"] or 0.0
        assert s["stop_latency_s"] is not None and s["stop_latency_s"] < 1.0 + lag, lag


def test_relaunch_with_the_recommended_cap_holds_twice_the_concurrency(
    search_run: SearchRun,
    sweep: dict[int, BurstResult],
    tiny_model: TinyModel,
    vllm_venv_path: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    seqs = search_run.data["recommended"]["max_num_seqs"]
    assert sweep[seqs + 1].preemptions > 0, "without the cap one more request preempts"
    config = ServeConfig(
        model_dir=tiny_model.path,
        kv_cache_memory_bytes=SHARED_POOL_BLOCKS * tiny_model.kv_bytes_per_block,
        max_model_len=1024,
        max_num_seqs=seqs,
    )
    with running_vllm(config, tmp_path / "vllm.log", venv=vllm_venv_path) as server:
        before = metric_value(fetch_metrics(server.base_url), "vllm:num_preemptions_total")
        proc = oomguard(
            oomguard_exe,
            "bench",
            server.base_url,
            "--prompt-tokens",
            str(PROMPT_TOKENS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--concurrency",
            str(2 * seqs),
            "--requests",
            str(6 * seqs),
            "--json",
            "--no-record",
        )
        after = metric_value(fetch_metrics(server.base_url), "vllm:num_preemptions_total")
    data = bench_json(proc)
    (stage,) = data["stages"]
    print(
        f"--max-num-seqs {seqs}, concurrency {2 * seqs}: {stage['requests']}, running peak "
        f"{stage['running_peak']}, waiting peak {stage['waiting_peak']}, preemptions "
        f"{after - before}, errors {stage['error_examples']}"
    )
    assert after - before == 0
    assert proc.returncode == 0 and stage["safe"] is True
    assert stage["requests"]["ok"] == 6 * seqs
    assert stage["running_peak"] <= seqs and stage["waiting_peak"] > 0


def test_the_report_opens_in_chromium_without_errors(search_run: SearchRun, tmp_path: Path) -> None:
    chromium = require_program("chromium", "chromium")
    page = search_run.report / "report.html"
    text = page.read_text()
    assert text.count("<svg") == 4
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//|url\(\s*["']?https?:""", text)
    for name in ("kv_timeline", "queue_timeline", "throughput", "latency"):
        assert (search_run.report / f"{name}.png").stat().st_size > 5000
    shot = tmp_path / "report.png"
    console = _chromium_console(chromium, page, shot, tmp_path / "profile")
    assert console == [], console
    _assert_not_blank(shot)
    # the check itself can fail: a page with a script error is caught
    broken = tmp_path / "broken.html"
    broken.write_text("<html><body><script>missingFunction();</script></body></html>")
    assert any(
        "missingFunction" in line
        for line in _chromium_console(chromium, broken, tmp_path / "b.png", tmp_path / "profile2")
    )


def _chromium_console(chromium: str, page: Path, shot: Path, profile: Path) -> list[str]:
    proc = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1200,2600",
            f"--screenshot={shot}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]


def _assert_not_blank(png: Path) -> None:
    import matplotlib.image as mpimg

    pixels = mpimg.imread(png)
    assert pixels.shape[0] >= 2000 and pixels.shape[1] >= 1000
    dark = (pixels[..., :3].mean(axis=2) < 0.6).mean()
    assert dark > 0.01, f"the screenshot is nearly blank ({dark:.3%} dark pixels)"


def test_vllm_bench_serve_counts_the_same(
    shared_vllm: VllmServer,
    tiny_model: TinyModel,
    vllm_venv_path: Path,
    oomguard_exe: list[str],
    tmp_path: Path,
) -> None:
    url, model, n, c = shared_vllm.base_url, str(tiny_model.path), 28, 4
    wait_vllm_idle(url)
    before = _counters(url)
    theirs = vllm_bench_serve(
        vllm_venv_path,
        url,
        model,
        input_len=PROMPT_TOKENS,
        output_len=MAX_TOKENS,
        num_prompts=n,
        max_concurrency=c,
        out_dir=tmp_path,
    )
    wait_vllm_idle(url)
    between = _counters(url)
    proc = oomguard(
        oomguard_exe,
        "bench",
        url,
        "--prompt-tokens",
        str(PROMPT_TOKENS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--concurrency",
        str(c),
        "--requests",
        str(n),
        "--json",
        "--no-record",
    )
    wait_vllm_idle(url)
    after = _counters(url)
    (ours,) = bench_json(proc)["stages"]
    server_theirs = {k: between[k] - before[k] for k in before}
    server_ours = {k: after[k] - between[k] for k in before}
    counts = {
        "requests": (ours["requests"]["ok"], theirs["completed"]),
        "prompt tokens": (ours["prompt_tokens"], theirs["total_input_tokens"]),
        "output tokens": (ours["output_tokens"], theirs["total_output_tokens"]),
    }
    print(
        f"counts (oomguard, vllm bench serve): {counts}; server saw {server_ours} / {server_theirs}"
    )
    for name, (a, b) in counts.items():
        assert abs(a - b) <= 0.01 * max(a, b), name
    # what the server counted: around bench's stage (bench reads it) and around each run
    # (read here; bench's also holds its one-token warm-up request)
    stage_counted = ours["server_counters"]
    assert stage_counted["requests_succeeded_total"] == ours["requests"]["ok"] == n
    assert stage_counted["generation_tokens_total"] == ours["output_tokens"] == n * MAX_TOKENS
    assert stage_counted["prompt_tokens_total"] == ours["prompt_tokens"] == n * PROMPT_TOKENS
    assert server_ours == {
        "requests": n + 1,
        "prompt": (n + 1) * PROMPT_TOKENS,
        "generation": n * MAX_TOKENS + 1,
    }
    assert server_theirs["requests"] == theirs["completed"] == n
    assert server_theirs["generation"] == theirs["total_output_tokens"]
    assert (
        abs(server_theirs["prompt"] - theirs["total_input_tokens"])
        <= 0.01 * theirs["total_input_tokens"]
    )
    for what, key in (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl")):
        print(
            f"{what} median ms: oomguard {ours[key + '_s']['p50'] * 1000:.1f}, "
            f"vllm bench serve {theirs[f'median_{key}_ms']:.1f}"
        )


def _counters(url: str) -> dict[str, float]:
    text = fetch_metrics(url)
    return {
        "requests": metric_value(text, "vllm:request_success_total"),
        "prompt": metric_value(text, "vllm:prompt_tokens_total"),
        "generation": metric_value(text, "vllm:generation_tokens_total"),
    }


def test_through_the_guard(
    shared_vllm: VllmServer, oomguard_exe: list[str], tmp_path: Path
) -> None:
    wait_vllm_idle(shared_vllm.base_url)
    with GuardProcess([shared_vllm.base_url], tmp_path / "guard.log") as guard:
        proc = oomguard(
            oomguard_exe,
            "bench",
            guard.url,
            "--prompt-tokens",
            str(PROMPT_TOKENS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--max-concurrency",
            "10",
            "--json",
            "--no-record",
            "--budget-s",
            "240",
        )
    wait_vllm_idle(shared_vllm.base_url)
    data = bench_json(proc)
    print(proc.stderr[-2000:])
    assert proc.returncode == 0
    assert data["conditions"]["metrics_source"] == "guard"
    assert any("gateway" in n for n in data["notes"])
    assert all(s["preemptions"] == 0 for s in data["stages"]), "the guard admits by KV"
    # vLLM alone holds 7 peak requests; the gateway queues what it cannot hold (a stage can
    # still be judged unsafe when the gateway lets KV usage touch the whole pool)
    assert data["max_safe_concurrency"] >= 7
    assert any(s["gateway_queue_peak"] for s in data["stages"]), "the guard queued requests"
    assert data["recommended"]["max_num_seqs"] == 7, "from the pool: not measured alone"


def test_a_server_that_is_not_vllm_runs_on_client_figures(
    oomguard_exe: list[str], tiny_model: TinyModel
) -> None:
    with OpenAIStub(tiny_model.path / "tokenizer.json") as stub:
        proc = oomguard(
            oomguard_exe,
            "bench",
            stub.url,
            "--prompt-tokens",
            "40",
            "--max-tokens",
            "20",
            "--tokenizer",
            str(tiny_model.path),
            "--max-concurrency",
            "8",
            "--json",
            "--no-record",
            "--budget-s",
            "120",
        )
        served = stub.completions
    data = bench_json(proc)
    assert proc.returncode == 0 and data["conditions"]["metrics_source"] == "none"
    assert any("client figures only" in n for n in data["notes"])
    assert all(s["preemptions"] is None and s["kv_peak"] is None for s in data["stages"])
    assert sum(s["requests"]["ok"] for s in data["stages"]) + 1 == served  # +1: the warm-up
    assert data["recommended"]["high_watermark"] is None


def test_nothing_safe_exits_1(shared_vllm: VllmServer, oomguard_exe: list[str]) -> None:
    """One request of 900 tokens holds 8 of the 15 blocks (0.53 of the pool): above a 0.3
    high watermark even alone."""
    wait_vllm_idle(shared_vllm.base_url)
    proc = oomguard(
        oomguard_exe,
        "bench",
        shared_vllm.base_url,
        "--prompt-tokens",
        "600",
        "--max-tokens",
        "300",
        "--high-watermark",
        "0.3",
        "--json",
        "--no-record",
    )
    wait_vllm_idle(shared_vllm.base_url)
    data = bench_json(proc)
    assert proc.returncode == 1
    assert data["max_safe_concurrency"] is None and data["recommended"]["max_num_seqs"] is None
    (stage,) = data["stages"]
    assert stage["concurrency"] == 1 and stage["safe"] is False
    assert any("KV" in r and "> 0.3" in r for r in stage["reasons"]) and stage["preemptions"] == 0


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_an_unreachable_url_is_one_line(oomguard_exe: list[str]) -> None:
    proc = oomguard(
        oomguard_exe,
        "bench",
        f"http://127.0.0.1:{free_port()}",
        "--prompt-tokens",
        "10",
        "--max-tokens",
        "10",
    )
    assert proc.returncode == EXIT_ENVIRONMENT
    assert "cannot reach" in _one_error_line(proc)


def test_a_prompt_longer_than_max_model_len_is_one_line(
    shared_vllm: VllmServer, oomguard_exe: list[str]
) -> None:
    proc = oomguard(
        oomguard_exe,
        "bench",
        shared_vllm.base_url,
        "--prompt-tokens",
        "1000",
        "--max-tokens",
        "100",
        "--no-record",
    )
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "max_model_len of 1,024" in line and "1,100 tokens" in line


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--prompt-tokens", "0", "--max-tokens", "5"], "--prompt-tokens 0"),
        (["--max-tokens", "5"], "no load given"),
        (
            ["--prompt-tokens", "5", "--max-tokens", "5", "--high-watermark", "1.5"],
            "--high-watermark",
        ),
    ],
)
def test_bad_flags_are_one_line(oomguard_exe: list[str], args: list[str], words: str) -> None:
    proc = oomguard(oomguard_exe, "bench", "http://127.0.0.1:9", *args)
    assert proc.returncode == 2
    assert words in _one_error_line(proc)
