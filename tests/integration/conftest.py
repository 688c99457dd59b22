"""One real deployment per test session: registry on a SQLite file, gateway, follower, tritonserver.

Skipped with a reason where the tritonserver binary is not installed (the `serve` extra).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from control.app.registry import Registry
from control.contracts.config import Settings
from control.ops.clients import request_ticket
from control.ops.serve import Deployment, Ports
from control.ops.triton_server import TritonUnavailable, find_triton
from control.tools.kit import KitManifest
from projections.follower import open_registry
from tests.required import unavailable

ACTOR = "test-operator"
# (tenant, alias, kit adapter or None for the base alone)
ROUTES = (
    ("acme", "acme-alpha", "alpha"),
    ("acme", "acme-beta", "beta"),
    ("globex", "globex-gamma", "gamma"),
    ("acme", "base", None),
    ("globex", "base", None),
)


@dataclass
class Stack:
    settings: Settings
    registry: Registry
    deployment: Deployment
    kit_dir: Path
    kit: KitManifest
    api_keys: dict[str, str]
    digests: dict[str, str]  # kit adapter name -> registered digest
    tickets: dict[tuple[str, str], str] = field(default_factory=dict)

    @property
    def http(self) -> str:
        assert self.deployment.triton is not None
        return self.deployment.triton.http_url

    @property
    def grpc(self) -> str:
        assert self.deployment.triton is not None
        return self.deployment.triton.grpc_url

    def ticket(self, tenant: str, alias: str) -> str:
        status, body = request_ticket(self.deployment.gateway_url, self.api_keys[tenant], alias)
        assert status == 200, body
        return str(body["ticket"])


def require_servers(root: Path, *, haproxy: bool = False) -> None:
    """Skip (fail in CI) unless the real tritonserver, and with ``haproxy`` the balancer, are
    installed."""
    from control.ops.front_door import find_haproxy  # only the balanced clusters need it

    try:
        find_triton(root)
    except TritonUnavailable as e:
        unavailable("the real tritonserver", str(e))
    if haproxy and find_haproxy() is None:
        unavailable("haproxy", "apt-get install haproxy")


def post_json(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
    """POST ``body`` as JSON; (status, the answer parsed as JSON, or its text: a stream)."""
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def hosts_of(db_url: str, request_ids: list[str]) -> dict[str, str]:
    """The host that wrote each request's ledger row (the one that answered it)."""
    import sqlalchemy as sa

    from control.contracts.db import make_engine
    from control.contracts.ledger import request_ledger as t

    with make_engine(db_url).connect() as conn:
        rows = conn.execute(sa.select(t.c.request_id, t.c.host)
                            .where(t.c.request_id.in_(request_ids))).all()
    return {r.request_id: r.host for r in rows}


def sqlite_home(tmp_path_factory: pytest.TempPathFactory, name: str) -> Settings:
    """A fresh home with a SQLite database; skips where tritonserver is not installed."""
    home = tmp_path_factory.mktemp(name)
    try:
        find_triton(home)
    except TritonUnavailable as e:
        unavailable("the real tritonserver", str(e))
    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}")
    settings.ensure_dirs()
    return settings


def provision(
    settings: Settings, kit_dir: Path
) -> tuple[Registry, KitManifest, dict[str, str], dict[str, str]]:
    """Register the kit's base, tenants acme and globex, and release and grant ``ROUTES``.

    Returns (registry, kit, API keys by tenant, digests by kit adapter name).
    """
    kit = KitManifest.load(kit_dir)
    reg = open_registry(settings)
    reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path, name="tiny-llama",
                      actor=ACTOR, alias="base")
    keys = {t: reg.create_tenant(t, actor=ACTOR) for t in ("acme", "globex")}
    digests: dict[str, str] = {}
    for tenant, alias, name in ROUTES:
        if name is not None:
            digest = reg.register_adapter(kit_dir / kit.adapters[name].path, tenant=tenant,
                                          alias=alias, actor=ACTOR)
            reg.advance(digest, external=True, evaluation={"suite": "smoke", "passed": True},
                        actor=ACTOR)
            digests[name] = digest
        reg.grant(tenant, alias, actor=ACTOR)
    return reg, kit, keys, digests


@contextlib.contextmanager
def started_stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory, name: str,
                  **deployment: Any) -> Iterator[Stack]:
    """A fresh home named ``name``, the kit provisioned, a deployment on free ports started
    (``deployment``: further ``Deployment`` fields, a test's own model repository say)."""
    settings = sqlite_home(tmp_path_factory, name)
    reg, kit, keys, digests = provision(settings, kit_dir)
    dep = Deployment(settings, Ports.free(),
                     actor=ACTOR, **deployment)
    dep.start()
    try:
        yield Stack(settings, reg, dep, kit_dir, kit, keys, digests)
    finally:
        dep.stop()


@pytest.fixture(scope="session")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with started_stack(kit_dir, tmp_path_factory, "home") as s:
        yield s
