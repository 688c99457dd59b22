"""A rollout probe runs where the release's owner may run (issue 25): its ticket binds the
owner's pool and regions, and only that pool's hosts are probed, so a dedicated adapter is never
loaded on a shared host, not even by the control plane; a pool with no host listed is reported,
not probed elsewhere."""

from __future__ import annotations

from typing import Any

import pytest
import tritonclient.http

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from control.contracts.tickets import TicketSigner
from control.domain import TenantPolicy
from control.ops import rollout_controller
from control.ops.clients import Generation
from control.ops.rollout_controller import TritonProbe
from projections.routing import RoutingView
from tests.fixtures_control import Artifacts, OnSQLite, WithRegistry, ticket_claims

HOSTS = ["127.0.0.1:8000", "127.0.0.1:8010", "gold=127.0.0.1:8100"]
EVAL = {"suite": "smoke", "accuracy": 0.9, "passed": True}


class ProbePlacementContract(WithRegistry):
    @pytest.fixture
    def release(self, registry: Registry, artifacts: Artifacts) -> Any:
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        registry.create_tenant("acme", actor="op")
        digest = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                           alias="chat", actor="op")
        registry.advance(digest, evaluation=EVAL, external=True, actor="op")
        release = RoutingView(registry.follower.engine).adapter(digest)
        assert release is not None and release.release_digest is not None
        return registry.release_manifest(release.release_digest)

    def _probe(self, settings: Settings, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[TritonProbe, list[tuple[str, str]]]:
        """A probe over HOSTS whose calls are recorded (host, ticket) instead of sent."""
        engine = make_engine(settings.db_url)
        probe = TritonProbe(settings, HOSTS, RoutingView(engine), Ledger(engine))
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        monkeypatch.setattr(probe, "_signer", lambda: signer)
        sent: list[tuple[str, str]] = []

        class Client:
            def __init__(self, url: str, **_kw: object) -> None:
                self.url = url

            def close(self) -> None:
                pass

        def infer(client: Client, _protocol: str, _text: str, ticket: str,
                  **_kw: object) -> Generation:
            sent.append((client.url, ticket))
            return Generation("ok", f"r{len(sent)}", "")

        monkeypatch.setattr(tritonclient.http, "InferenceServerClient", Client)
        monkeypatch.setattr(rollout_controller, "infer_with", infer)
        return probe, sent

    def test_a_dedicated_owners_release_is_probed_on_its_pool_only(
            self, registry: Registry, settings: Settings, release: Any,
            monkeypatch: pytest.MonkeyPatch) -> None:
        registry.set_policy("acme", TenantPolicy(isolation="dedicated:gold", regions=["eu"]),
                            actor="op")
        probe, sent = self._probe(settings, monkeypatch)
        report = probe.probe("acme", release, 3)
        assert report.hosts == ["127.0.0.1:8100"] and report.requests == 3
        assert {host for host, _ in sent} == {"127.0.0.1:8100"}
        claims = ticket_claims(sent[0][1], settings.keys_dir)
        assert (claims["pool"], claims["regions"]) == ("gold", ["eu"])

    def test_a_shared_owners_release_is_probed_on_the_shared_hosts(
            self, settings: Settings, release: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        probe, sent = self._probe(settings, monkeypatch)
        report = probe.probe("acme", release, 2)
        assert report.hosts == ["127.0.0.1:8000", "127.0.0.1:8010"] and report.requests == 4
        assert {host for host, _ in sent} == {"127.0.0.1:8000", "127.0.0.1:8010"}
        assert ticket_claims(sent[0][1], settings.keys_dir)["pool"] == "shared"

    def test_a_pool_without_a_listed_host_is_reported_not_probed_elsewhere(
            self, registry: Registry, settings: Settings, release: Any,
            monkeypatch: pytest.MonkeyPatch) -> None:
        registry.set_policy("acme", TenantPolicy(isolation="dedicated:silver"), actor="op")
        probe, sent = self._probe(settings, monkeypatch)
        report = probe.probe("acme", release, 3)
        assert sent == [] and report.requests == 0
        assert report.errors == ["no Triton host of pool silver is listed to probe "
                                 "(LORAPLANE_TRITON_URLS)"]


class TestProbePlacementSQLite(OnSQLite, ProbePlacementContract):
    pass
