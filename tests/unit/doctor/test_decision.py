"""The decision as a whole: sure answers, the calibrated ranking, abstention and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.cli import main
from oomguard.doctor.diagnose import ABSTAIN_BELOW, diagnose, sure_confidence
from oomguard.doctor.mechanisms import Verdict
from oomguard.doctor.model import load_model
from oomguard.doctor.situation import Context
from oomguard.logs import parse_stream

CORPUS = Path(__file__).resolve().parents[3] / "bench" / "data" / "oom-cases-corpus.jsonl"
ROWS = [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]

KV_FIT = (
    "ERROR 01-02 03:04:05 [core.py:343] ValueError: To serve at least one request with the "
    "model's max seq len (131072), (16.0 GiB KV cache is needed, which is larger than the "
    "available KV cache memory (3.59 GiB). Based on the available memory, the estimated maximum "
    "model length is 29344. Try increasing `gpu_memory_utilization` or decreasing "
    "`max_model_len` when initializing the engine."
)
BARE_OOM = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."


def test_a_mechanism_answer_is_sure_with_its_numbers_and_measured_confidence() -> None:
    d = diagnose(parse_stream([KV_FIT]))
    top = d.top
    assert top is not None and top.sure and top.mechanism == "kv_fit_check"
    assert top.numbers["kv_capacity_tokens"] == 29344
    assert not d.abstained and d.sure and d.needs == []
    table = load_model().meta["mechanisms"]["kv_fit_check:kv_too_small_for_max_len"]
    assert table[1] >= 20  # the check is measured on the corpus, not asserted
    assert abs(top.confidence - table[0] / table[1]) < 0.05


def test_sure_confidence_of_an_unseen_check_leans_on_all_checks() -> None:
    model = load_model()
    pooled = model.meta["mechanisms_pooled"]
    unseen = Verdict("never_fired", "other", "", "")
    assert sure_confidence(unseen, model) == pytest.approx((pooled[0] + 1) / (pooled[1] + 2))


def test_probabilities_are_a_distribution_and_rank_the_findings() -> None:
    d = diagnose(parse_stream([BARE_OOM]))
    assert sum(d.probabilities.values()) == pytest.approx(1.0)
    confidences = [f.confidence for f in d.findings]
    assert confidences == sorted(confidences, reverse=True)
    assert not d.top.sure  # type: ignore[union-attr]


def test_a_log_without_the_deciding_numbers_abstains_and_says_what_would_settle_it() -> None:
    d = diagnose(parse_stream(["The server crashed with out of memory, any idea?", BARE_OOM]))
    assert d.oom_found and d.abstained
    assert d.top is not None and d.top.confidence < ABSTAIN_BELOW
    assert len(d.findings) >= 2  # the candidates it cannot tell apart
    wanted = " ".join(n.what for n in d.needs)
    assert "nvidia" in " ".join(n.how for n in d.needs) or "GPU" in wanted
    assert any("Memory profiling" in n.what or "KV cache" in n.what for n in d.needs)


def test_needs_skip_what_the_log_already_has() -> None:
    lines = [
        "INFO [gpu_worker.py:100] Available KV cache memory: 0.50 GiB",
        "INFO [api_server.py:100] non-default args: {'max_model_len': 8192}",
        BARE_OOM,
    ]
    d = diagnose(parse_stream(lines))
    assert all("start-up memory lines" not in n.what for n in d.needs)
    assert all(n.what != "the command line" for n in d.needs)


def test_no_failure_is_not_diagnosed() -> None:
    d = diagnose(
        parse_stream(
            ["INFO Available KV cache memory: 58.11 GiB", "INFO GPU KV cache size: 476,016 tokens"]
        )
    )
    assert not d.oom_found and d.findings == [] and not d.abstained


def test_every_corpus_case_gets_a_complete_answer() -> None:
    for row in ROWS:
        d = diagnose(parse_stream(row["log"].splitlines()), Context(model=row.get("model")))
        if not d.oom_found:
            continue
        top = d.top
        assert top is not None and 0 < top.confidence < 1, row["id"]
        if top.sure:
            assert top.evidence and top.mechanism, row["id"]
        assert json.dumps(d.to_dict(), default=str)


def test_flag_changes_give_serve_the_first_flag_fix() -> None:
    top = diagnose(parse_stream([KV_FIT])).top
    assert top is not None
    changes = top.flag_changes()
    assert list(changes) == ["--max-model-len"]
    assert int(str(changes["--max-model-len"])) <= 0.9 * 29344


# --- CLI -----------------------------------------------------------------------------------------


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sure = tmp_path / "kv.log"
    sure.write_text(KV_FIT + "\n")
    assert main(["doctor", str(sure), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sure"] and not data["abstained"]
    assert data["findings"][0]["fixes"][0]["flag"] == "--max-model-len"

    vague = tmp_path / "vague.log"
    vague.write_text("vllm died with out of memory\n" + BARE_OOM + "\n")
    assert main(["doctor", str(vague)]) == 4
    out = capsys.readouterr().out
    assert "does not say which cause" in out and "What would settle it" in out

    healthy = tmp_path / "ok.log"
    healthy.write_text("INFO Available KV cache memory: 58.11 GiB\n")
    assert main(["doctor", str(healthy)]) == 3
    assert main(["doctor", str(tmp_path / "missing.log")]) == 2
    assert main(["doctor", str(tmp_path)]) == 2
    assert main(["doctor"]) == 2
