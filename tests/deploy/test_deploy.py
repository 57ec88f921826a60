"""deploy/: the generated files are current, the alert rules pass promtool's checks and unit
tests, the dashboard loads in grafana-foundation-sdk's schema models, and the Kubernetes
manifests validate against the Kubernetes schemas (core kinds) and prometheus-operator's
(ServiceMonitor, PrometheusRule)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "oomguard-alerts.yaml"
RULE_TESTS = DEPLOY / "prometheus" / "oomguard-alerts.test.yaml"
DASHBOARD = DEPLOY / "grafana" / "oomguard-dashboard.json"
K8S = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.33"


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        problem = "promtool not found (scripts/setup-system.sh installs the prometheus package)"
        if os.environ.get("OOMGUARD_REQUIRE_ALL") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return path


def test_generated_files_match_their_generator() -> None:
    run = subprocess.run(
        [sys.executable, str(DEPLOY / "generate.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_generator_check_catches_a_hand_edit(tmp_path: Path) -> None:
    sys.path.insert(0, str(DEPLOY))
    import generate

    edited = tmp_path / "rules.yaml"
    edited.write_text(generate.rules_yaml().replace("0.85", "0.95"))
    assert edited.read_text() != generate.rules_yaml()


def test_promtool_check_rules() -> None:
    run = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_promtool_rule_unit_tests() -> None:
    run = subprocess.run(
        [_promtool(), "test", "rules", str(RULE_TESTS)],
        capture_output=True,
        text=True,
        cwd=RULE_TESTS.parent,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout


def test_every_alert_of_the_watcher_has_a_prometheus_rule_with_its_thresholds() -> None:
    from oomguard.watch import rules as R

    groups = yaml.safe_load(RULES.read_text())["groups"]
    by_name: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        for rule in group["rules"]:
            by_name.setdefault(rule["alert"], []).append(rule)
    for rule in R.RULES:
        assert rule.name in by_name, rule.name
        for prom in by_name[rule.name]:
            assert prom["labels"]["severity"] == rule.severity
            if rule.name != R.SERVER_DOWN.name and rule.name != R.PREEMPTIONS.name:
                assert f"{rule.threshold:.10g}".rstrip("0").rstrip(".") in prom["expr"], (
                    rule.name,
                    prom["expr"],
                )


def test_rule_unit_tests_cover_every_alert() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {
        case["alertname"]
        for t in tests
        for case in t.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    defined = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert defined - tested == set()


# -- Grafana -------------------------------------------------------------------------------


def _panels(data: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in data["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _assert_kept(original: Any, loaded: Any, where: str) -> None:
    """Every field and value of ``original`` is in ``loaded``."""
    if isinstance(original, dict):
        assert isinstance(loaded, dict), where
        for key, value in original.items():
            assert key in loaded, f"{where}.{key} is not in Grafana's schema"
            _assert_kept(value, loaded[key], f"{where}.{key}")
    elif isinstance(original, list):
        assert isinstance(loaded, list) and len(original) == len(loaded), where
        for i, (a, b) in enumerate(zip(original, loaded, strict=True)):
            _assert_kept(a, b, f"{where}[{i}]")
    else:
        assert original == loaded, where


def test_dashboard_loads_in_the_grafana_schema_models() -> None:
    """grafana-foundation-sdk's models are generated from Grafana's dashboard schema: the JSON
    must load into them and come back with every field it had (a field the schema does not
    know is dropped on the way, and fails the comparison; the models may add their defaults)."""
    import grafana_foundation_sdk.builders.stat  # noqa: F401 - registers the panel and query kinds
    import grafana_foundation_sdk.builders.statetimeline  # noqa: F401
    import grafana_foundation_sdk.builders.timeseries  # noqa: F401
    from grafana_foundation_sdk.cog import plugins
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    plugins.register_default_plugins()
    data = json.loads(DASHBOARD.read_text())
    loaded = Dashboard.from_json(data)
    again = json.loads(JSONEncoder(sort_keys=True).encode(loaded))
    _assert_kept(data, again, "dashboard")
    panels = _panels(data)
    assert {p["type"] for p in panels} <= {"row", "timeseries", "stat", "state-timeline"}
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["type"] == "prometheus" and t["expr"].strip(), p["title"]
        grid = p["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] + grid["w"] <= 24


def test_schema_check_catches_an_unknown_field() -> None:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    data = json.loads(DASHBOARD.read_text())
    data["panels"][1]["gridPoss"] = {"h": 8, "w": 12, "x": 0, "y": 0}
    again = json.loads(JSONEncoder(sort_keys=True).encode(Dashboard.from_json(data)))
    with pytest.raises(AssertionError, match="gridPoss"):
        _assert_kept(data, again, "dashboard")


def test_dashboard_draws_the_watermarks_and_the_plan() -> None:
    from oomguard.watch import rules as R

    panels = {p["title"]: p for p in _panels(json.loads(DASHBOARD.read_text()))}
    kv = panels["KV cache usage"]
    steps = [s["value"] for s in kv["fieldConfig"]["defaults"]["thresholds"]["steps"]]
    assert steps == [None, R.KV_HIGH.threshold, R.KV_CRITICAL.threshold]
    assert kv["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] == "dashed"
    exprs = " ".join(
        t["expr"] for t in panels["GPU memory of the engine against the plan"]["targets"]
    )
    assert "oomguard_watch_engine_gpu_memory_bytes" in exprs and 'part="requested"' in exprs
    for title in ("Preemptions per minute", "Guard: requests by outcome", "Guard: queue and shed"):
        assert title in panels


# -- Kubernetes ----------------------------------------------------------------------------


def _documents() -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs.extend((path, d) for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _strict_model(model: type, doc: dict[str, Any]) -> None:
    """Validate ``doc`` with a pydantic model and fail on any field the model does not know."""
    obj = model.model_validate(doc)
    back = obj.model_dump(by_alias=True, exclude_none=True, mode="json")

    def compare(a: Any, b: Any, where: str) -> None:
        if isinstance(a, dict):
            assert isinstance(b, dict), where
            for key, value in a.items():
                assert key in b, f"{where}.{key} is not a field of {model.__name__}"
                compare(value, b[key], f"{where}.{key}")
        elif isinstance(a, list):
            assert isinstance(b, list) and len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                compare(x, y, f"{where}[{i}]")

    compare(doc, back, doc["kind"])


def test_kubernetes_manifests_validate() -> None:
    import kubernetes_validate
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    kinds = set()
    for path, doc in _documents():
        kinds.add(doc["kind"])
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            _strict_model(getattr(monitoring, doc["kind"]), doc)
        else:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path.name} {doc['kind']} {doc['metadata']['name']}: {exc.message}")
    assert {"Deployment", "Service", "ServiceMonitor", "PrometheusRule", "ConfigMap"} <= kinds


def test_validation_catches_a_misspelt_field() -> None:
    import kubernetes_validate
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    deployment = next(d for _, d in _documents() if d["kind"] == "Deployment")
    bad = json.loads(json.dumps(deployment))
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    monitor = next(d for _, d in _documents() if d["kind"] == "ServiceMonitor")
    bad = json.loads(json.dumps(monitor))
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(AssertionError):
        _strict_model(monitoring.ServiceMonitor, bad)


def test_prometheusrule_carries_the_checked_rules(tmp_path: Path) -> None:
    rule = next(d for _, d in _documents() if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    extracted = tmp_path / "rules.yaml"
    extracted.write_text(yaml.safe_dump(rule["spec"]))
    run = subprocess.run(
        [_promtool(), "check", "rules", str(extracted)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_guard_and_watch_containers_run_real_commands() -> None:
    from oomguard.cli import FACES

    for _, doc in _documents():
        if doc["kind"] != "Deployment":
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if c["image"].startswith("oomguard"):
                assert c["args"][0] in FACES, c["args"]
