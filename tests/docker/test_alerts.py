"""The alert rules name only series loraplane exports: the rollout controller's liveness on the
gateway's /metrics, the backend's ledger and provenance gauges on Triton's metrics port."""

from __future__ import annotations

import re

import yaml
from aiohttp.test_utils import TestClient, TestServer

from control.gateway.observability import GatewayMetrics
from control.ops.rollout_controller import liveness_metrics
from tests import REPO

RULES = REPO / "docker" / "prometheus-alerts.yaml"
BACKEND_SOURCE = (REPO / "backend" / "triton" / "metrics.py").read_text()


def _series(expr: str) -> set[str]:
    return set(re.findall(r"\b(loraplane_[a-z_]+)\b", expr))


def test_every_series_an_alert_reads_is_exported() -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} >= {"LoraplaneRolloutControllerDown",
                                          "LoraplaneCanaryUnjudged"}
    gateway = set(liveness_metrics())
    for rule in rules:
        for name in _series(rule["expr"]):
            assert name in gateway or f'"{name}"' in BACKEND_SOURCE, (rule["alert"], name)


async def _scrape() -> str:
    from aiohttp import web

    metrics = GatewayMetrics()
    metrics.add_gauges(liveness_metrics)
    app = web.Application()

    async def handler(_r: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition())

    app.router.add_get("/metrics", handler)
    async with TestClient(TestServer(app)) as client:
        return await (await client.get("/metrics")).text()


def test_the_gateway_exports_the_controllers_liveness() -> None:
    import asyncio

    text = asyncio.run(_scrape())
    for name in liveness_metrics():
        assert re.search(rf"^{name} -?[0-9.e+]+$", text, re.M), name
