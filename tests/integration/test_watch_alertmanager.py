"""``oomguard watch --webhook`` against a real Alertmanager (Debian's prometheus-alertmanager):
the alerts it posts are accepted by Alertmanager's API, routed to a webhook receiver, and
what Alertmanager sends there has the same shape as what the watcher sends to a webhook
itself."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import require_program
from vllm_server import free_port

from oomguard.engine import start_group, stop_group

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "unit" / "watch"))

from loopback import http_server  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CONFIG = """
route:
  receiver: hook
  group_by: [alertname]
  group_wait: 0s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {url}
        send_resolved: true
"""


def test_alerts_reach_a_real_alertmanager_and_come_out_unchanged(
    tmp_path: Path, oomguard_exe: list[str]
) -> None:
    alertmanager = require_program("prometheus-alertmanager", "prometheus-alertmanager")
    with http_server() as (receiver_url, received):
        (tmp_path / "am.yml").write_text(CONFIG.format(url=receiver_url + "/am"))
        port = free_port()
        am = start_group(
            [
                alertmanager,
                f"--config.file={tmp_path / 'am.yml'}",
                f"--storage.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(tmp_path / "am.log").open("wb"),
        )
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(base + "/-/ready", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            dead = f"http://127.0.0.1:{free_port()}"
            run = subprocess.run(
                [
                    *oomguard_exe,
                    "watch",
                    dead,
                    "--webhook",
                    base + "/api/v2/alerts",
                    "--webhook",
                    receiver_url + "/direct",
                    "--interval",
                    "0.3",
                    "--min-duration",
                    "0.3",
                    "--duration",
                    "3",
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert "not delivered" not in run.stderr, run.stderr
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(r["path"] == "/am" for r in received):
                time.sleep(0.2)
        finally:
            stop_group(am.pid, grace_s=10, leader=am)
    from_am = [r["body"] for r in received if r["path"] == "/am"]
    direct = [r["body"] for r in received if r["path"] == "/direct"]
    assert from_am, f"Alertmanager sent nothing: {(tmp_path / 'am.log').read_text()[-2000:]}"
    alert = from_am[0]["alerts"][0]
    assert from_am[0]["status"] == "firing"
    assert (
        alert["labels"]["alertname"] == "OomguardServerDown" and alert["labels"]["server"] == dead
    )
    assert alert["annotations"]["description"].startswith(f"{dead} does not answer")
    ours = direct[0]
    assert set(ours) == set(from_am[0]), "webhook payload keys differ from Alertmanager's"
    assert set(ours["alerts"][0]) == set(alert), "alert keys differ from Alertmanager's"
    assert ours["alerts"][0]["labels"] == alert["labels"]
    assert json.loads(run.stdout.splitlines()[0])["alert"] == "OomguardServerDown"
