"""Webhook delivery (Alertmanager JSON, both directions) to a real loopback receiver, and the
watcher's own /metrics."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from oomguard.watch import rules as R
from oomguard.watch.alerts import AlertTracker, observe
from oomguard.watch.evaluate import Evaluator
from oomguard.watch.exporter import make_registry, metric_names
from oomguard.watch.runner import Outputs, Watch
from oomguard.watch.sampling import Target
from oomguard.watch.sinks import WebhookSink, webhook_payload

from .loopback import http_server, vllm_page


def _events():  # type: ignore[no-untyped-def]
    tracker = AlertTracker(min_duration_s=0)
    fired = tracker.update(1000.0, [observe(R.KV_CRITICAL, "http://v:8000", 0.95, "KV 95 %")])
    resolved = tracker.update(1010.0, [observe(R.KV_CRITICAL, "http://v:8000", 0.5, "KV 50 %")])
    return fired[0], resolved[0]


async def _deliver(url: str) -> WebhookSink:
    sink = WebhookSink(url)
    sink.start()
    for e in _events():
        sink.submit(e)
    await sink.drain(timeout_s=20)
    await sink.close()
    return sink


def test_webhook_receiver_gets_alertmanagers_payload_and_a_failed_post_is_retried() -> None:
    with http_server(post_statuses=[503]) as (url, received):
        sink = asyncio.run(_deliver(url + "/hook"))
    assert sink.delivered == 2 and sink.failed == 0
    assert [r["status"] for r in received] == [503, 200, 200]
    firing, resolved = received[1]["body"], received[2]["body"]
    assert (
        firing["version"] == "4"
        and firing["status"] == "firing"
        and resolved["status"] == "resolved"
    )
    alert = firing["alerts"][0]
    assert alert["labels"]["alertname"] == "OomguardKvCacheCritical"
    assert (
        alert["labels"]["severity"] == "critical" and alert["labels"]["server"] == "http://v:8000"
    )
    assert alert["endsAt"] == "0001-01-01T00:00:00Z"
    assert resolved["alerts"][0]["endsAt"] > resolved["alerts"][0]["startsAt"]
    assert alert["fingerprint"] == resolved["alerts"][0]["fingerprint"]


def test_an_alertmanager_url_gets_postable_alerts() -> None:
    with http_server() as (url, received):
        asyncio.run(_deliver(url + "/api/v2/alerts"))
    firing, resolved = (r["body"] for r in received)
    assert isinstance(firing, list) and set(firing[0]) == {
        "labels",
        "annotations",
        "startsAt",
        "generatorURL",
    }
    assert "endsAt" in resolved[0] and resolved[0]["labels"] == firing[0]["labels"]


def test_a_receiver_that_refuses_is_reported_not_retried_forever(capsys) -> None:  # type: ignore[no-untyped-def]
    with http_server(post_statuses=[400, 400]) as (url, received):
        sink = asyncio.run(_deliver(url))
    assert sink.failed == 2 and len(received) == 2
    assert "not delivered (HTTP 400" in capsys.readouterr().err


def test_payload_matches_one_event() -> None:
    fired, _ = _events()
    body = webhook_payload(fired)
    assert body["commonLabels"] == body["alerts"][0]["labels"]
    assert body["groupLabels"] == {"alertname": "OomguardKvCacheCritical"}


async def _one_round(url: str) -> Watch:
    target = Target.for_url(url)
    watch = Watch([target], Evaluator({target.name: None}), AlertTracker(), Outputs())
    async with aiohttp.ClientSession() as session:
        await watch.round(session)
        await watch.round(session)
    return watch


def test_the_exporter_writes_its_declared_names_and_what_it_saw() -> None:
    with http_server(vllm_page) as (url, _):
        watch = asyncio.run(_one_round(url))
    text = generate_latest(make_registry(watch)).decode()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert names <= set(metric_names())
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["oomguard_watch_up"].value == 1.0
    assert samples["oomguard_watch_kv_cache_tokens"].value == 2048
    assert samples["oomguard_watch_up"].labels == {"server": url}
