"""Catalogued quantized checkpoints in the search, and calibration from a real log end to end.

The log in data/ is a real vLLM 0.19.0 start-up of Llama-3.1-8B-Instruct on one H100 80GB HBM3
(TP 1, --gpu-memory-utilization 0.95, --max-model-len 8192), published with the llm-d planner's
accuracy results:
https://github.com/llm-d-incubation/llm-d-planner/blob/d3121e059da88662db39a926a3ead964be97359b/accuracy/results/v0.19.0/logs/meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--8192.log
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomguard.cli import main
from oomguard.facts.resolve import resolve_model
from oomguard.memory.engine import predict
from oomguard.plan.recommend import NO_INT4_REPO
from oomguard.plan.service import plan

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
AWQ_70B = "hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4"
AWQ_8B = "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4"
LOG = Path(__file__).parent / "data" / "llama-3.1-8b-h100-tp1-vllm-0.19.0.log"
# what that log states
LOG_KV_GIB = 58.11
LOG_KV_TOKENS = 476_016
LOG_ACTIVATION_GIB = 1.89
LOG_WEIGHTS_GIB = 14.99


# -- quantized checkpoints --------------------------------------------------------------------


def test_int4_alternative_is_the_catalogued_repo_priced_with_its_own_spec() -> None:
    result = plan(LLAMA_70B, "RTX 4090", p99_tokens=8192, concurrency=16, allow_hub=False)
    int4 = [a for a in result.alternatives if a.candidate and a.candidate.weights_key == "int4"]
    assert int4, [a.title for a in result.alternatives]
    own_spec = resolve_model(AWQ_70B, allow_hub=False)
    for alt in int4:
        assert alt.candidate.model_ref == AWQ_70B
        assert alt.candidate.model == own_spec
        if alt.numbers.get("problem") is None:
            assert alt.command.startswith(f"vllm serve {AWQ_70B} ")
    # no invented repo names anywhere
    assert not any(f"{LLAMA_70B}-AWQ" in a.command for a in result.alternatives)
    # its weights are the repo's own, not the base model re-labelled
    c = int4[0].candidate
    base = predict(resolve_model(LLAMA_70B, allow_hub=False), c.gpu, c.settings)
    assert c.prediction.weights.value_bytes < 0.35 * base.weights.value_bytes


def test_recommendation_switches_to_the_catalogued_int4_repo_when_fp8_is_unavailable() -> None:
    # T4 (compute 7.5) has no fp8; bf16 weights (14.99 GiB) exceed its 14.74 GiB
    result = plan(LLAMA_8B, "T4", p99_tokens=4096, concurrency=8, allow_hub=False)
    assert result.fits
    assert result.plan.model_ref == AWQ_8B
    assert result.plan.model == resolve_model(AWQ_8B, allow_hub=False)
    assert result.command.startswith(f"vllm serve {AWQ_8B} ")
    reason = next(r for r in result.recommendation.reasons if r.flag == "model")
    assert reason.value == AWQ_8B and "int4 AWQ checkpoint" in reason.reason


def test_model_without_a_catalogued_int4_repo_says_so_and_keeps_online_fp8() -> None:
    result = plan("Qwen/Qwen3-32B", "H100", p99_tokens=16384, concurrency=32, allow_hub=False)
    assert not result.fits
    own = [a for a in result.alternatives if a.kind == "quantize_yourself"]
    assert len(own) == 1 and NO_INT4_REPO in own[0].title
    assert "Qwen/Qwen3-32B-AWQ" not in result.to_json()
    # online fp8 needs no repo and is still offered
    assert any(
        a.candidate is not None and a.candidate.settings.quantization == "fp8"
        for a in result.alternatives
    )


# -- calibration end to end -------------------------------------------------------------------

PLAN_ARGS = [LLAMA_8B, "--gpu", "H100", "--vllm-version", "0.19",
             "--gpu-memory-utilization", "0.95", "--max-model-len", "8192",
             "--offline"]  # fmt: skip


def _plan_json(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    code = main(["plan", *PLAN_ARGS, *extra, "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    return json.loads(out)


@pytest.mark.parametrize("gpu_name", ["NVIDIA H100 80GB HBM3", "h100"])
def test_calibrate_then_plan_uses_the_log_figures(capsys, gpu_name) -> None:
    before = _plan_json(capsys)
    assert before["calibration"]["used"] is False
    assert before["estimates"]["activation"]["estimated"] is True

    code = main(["calibrate", str(LOG), "--gpu", gpu_name, "--vllm-version", "0.19.0"])
    capsys.readouterr()
    assert code == 0

    after = _plan_json(capsys)
    cal = after["calibration"]
    assert cal["used"] is True and str(LOG) in cal["source"]
    assert {"weights", "activation", "non_torch"} <= set(cal["terms"])
    assert cal["key"].endswith("|0.19|llama-3.1-8b|tp1")
    for term in cal["terms"]:
        assert after["estimates"][term]["estimated"] is False
        assert after["estimates"][term]["basis"].startswith("measured")
    # the measured terms replaced the estimates...
    assert after["memory"]["activation_gib"] == LOG_ACTIVATION_GIB
    assert after["memory"]["weights_gib"] == LOG_WEIGHTS_GIB
    assert before["memory"]["activation_gib"] != LOG_ACTIVATION_GIB
    # ...and the KV prediction moved to the log's own figure (its GiB are rounded to 0.01)
    assert abs(after["memory"]["kv_cache_gib"] - LOG_KV_GIB) <= 0.015
    assert abs(after["kv_cache_tokens"] - LOG_KV_TOKENS) <= 0.001 * LOG_KV_TOKENS
    assert abs(after["memory"]["kv_cache_gib"] - LOG_KV_GIB) < abs(
        before["memory"]["kv_cache_gib"] - LOG_KV_GIB
    )

    # the human output says so
    code = main(["plan", *PLAN_ARGS])
    out, _ = capsys.readouterr()
    assert code == 0 and "Calibrated:" in out and str(LOG) in out.replace("\n", "")
    assert "measured" in out

    # --no-calibration goes back to the estimates
    again = _plan_json(capsys, "--no-calibration")
    assert again["calibration"]["used"] is False
    assert again["memory"] == before["memory"]


def test_calibration_does_not_apply_to_another_configuration(capsys) -> None:
    assert main(["calibrate", str(LOG), "--gpu", "H100", "--vllm-version", "0.19.0"]) == 0
    capsys.readouterr()
    # another TP, another version, another GPU: no matching observation
    data = _plan_json(capsys, "-tp", "2")
    assert data["calibration"]["used"] is False
    # online fp8 changes the weights, activations and graphs the log measured; only the
    # non-torch growth (cuBLAS/NCCL workspaces) still applies
    data = _plan_json(capsys, "--quantization", "fp8")
    assert data["calibration"]["terms"] == ["non_torch"]
    for args in (
        [LLAMA_8B, "--gpu", "H100", "--vllm-version", "0.20", "--offline", "--json"],
        [LLAMA_8B, "--gpu", "A100 80GB", "--vllm-version", "0.19", "--offline", "--json"],
    ):
        main(["plan", *args])
        data = json.loads(capsys.readouterr()[0])
        assert data["calibration"]["used"] is False, args


def test_unreadable_store_is_a_note_not_a_failure(tmp_path, monkeypatch, capsys) -> None:
    home = tmp_path / "broken"
    home.mkdir()
    (home / "calibration.json").write_text("{not json")
    monkeypatch.setenv("OOMGUARD_HOME", str(home))
    data = _plan_json(capsys)
    assert data["calibration"]["used"] is False
    assert any("calibration store not used" in note for note in data["notes"])


def test_weights_are_counted_with_the_band_such_counts_missed_by() -> None:
    from oomguard.memory.bands import SHIPPED_BANDS

    plain = plan(LLAMA_8B, "H100", allow_hub=False).to_dict()["estimates"]["weights"]
    assert plain["estimated"] is True and plain["low_gib"] < plain["value_gib"] < plain["high_gib"]
    half = SHIPPED_BANDS.weights["dense"].half_width
    assert plain["basis"].startswith(f"counted ±{half * 100:.1f} %: 8.03 B params × bf16")
    awq = plan(AWQ_8B, "H100", allow_hub=False).to_dict()["estimates"]["weights"]
    assert awq["estimated"] is True and awq["low_gib"] < awq["value_gib"] < awq["high_gib"]
    assert "awq" in awq["basis"]
