"""Fallback on revocation: each alias's policy (``stable``, ``base``, ``none``), applied to every
alias routed to the revoked adapter in the revocation's own transaction and recorded as an
event; tickets then resolve by the outcome. One contract suite on SQLite and PostgreSQL
(``control.domain.fallback``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from typer.testing import CliRunner

from control.app.audit import audit_log
from control.app.registry import Registry
from control.cli.main import app
from control.contracts.config import Settings
from control.contracts.tickets import TicketSigner
from control.domain import DomainError, FallbackPolicy, IllegalTransition
from control.gateway import ticket_office
from control.gateway.server import FORBIDDEN, make_app
from control.gateway.ticket_office import TicketOffice
from projections.route_cache import CachedRoutingView
from projections.routing import RoutingView
from tests.fixtures_control import (
    Artifacts,
    OnPostgres,
    OnSQLite,
    WithRegistry,
    ticket_claims,
)

EVAL = {"suite": "smoke", "accuracy": 0.9, "passed": True}


def cli(settings: Settings, *args: str) -> tuple[int, dict[str, Any]]:
    res = CliRunner().invoke(app, ["--json", "--home", str(settings.home), "--actor", "ops",
                                   *args], env={"LORAPLANE_DB_URL": settings.db_url})
    lines = [line for line in res.stdout.splitlines() if line.startswith(("{", "["))]
    assert lines, res.stdout + repr(res.exception)
    return res.exit_code, json.loads(lines[-1])


class FallbackContract(WithRegistry):
    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts) -> dict[str, str]:
        """acme's ``chat``: alpha, then beta stable (alpha in the history); acme's ``second``
        pointed at beta's release as well; globex's ``g-chat`` on gamma."""
        base = registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny",
                                      actor="op", alias="tiny-base")
        keys = {t: registry.create_tenant(t, actor="op") for t in ("acme", "globex")}
        out: dict[str, str] = {"base": base}
        for tenant, alias, name in (("acme", "chat", "alpha"), ("acme", "chat", "beta"),
                                    ("globex", "g-chat", "gamma")):
            digest = registry.register_adapter(artifacts.adapters[name], tenant=tenant,
                                               alias=alias, actor="op")
            if name == "beta":  # not the alias's first release: stable by a break-glass
                registry.advance(digest, evaluation=EVAL, external=True, to="canary",
                                 actor="op")
                registry.break_glass(digest, to="stable", reason="fixture: beta replaces "
                                     "alpha", actor="op")
            else:
                registry.advance(digest, evaluation=EVAL, external=True, actor="op")
            release = registry.adapter(digest).release
            assert release is not None
            out[name], out["r_" + name] = digest, release
        registry.register_adapter(artifacts.adapters["by-name"], tenant="acme", alias="second",
                                  actor="op")
        registry.point_alias("second", out["r_beta"], actor="op")
        for tenant, alias in (("acme", "chat"), ("acme", "second"), ("globex", "g-chat")):
            registry.grant(tenant, alias, actor="op")
        assert registry.alias("chat").history == [out["r_alpha"]]
        return keys | out

    @pytest.fixture
    def office(self, registry: Registry, settings: Settings) -> TicketOffice:
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        return TicketOffice(settings, CachedRoutingView(registry.follower.engine, refresh_s=0),
                            signer)

    def _tickets(self, office: TicketOffice, api_key: str,
                 aliases: tuple[str, ...]) -> dict[str, tuple[int, dict[str, Any]]]:
        """What the gateway answers ``api_key`` for each alias, as (status, body)."""
        async def main() -> dict[str, tuple[int, dict[str, Any]]]:
            out = {}
            async with TestClient(TestServer(make_app(office))) as client:
                for alias in aliases:
                    r = await client.post("/v1/tickets", json={"alias": alias},
                                          headers={"Authorization": f"Bearer {api_key}"})
                    out[alias] = (r.status, await r.json())
            return out

        return asyncio.run(main())

    def test_the_default_policy_none_refuses(
            self, registry: Registry, world: dict[str, str], view: RoutingView,
            office: TicketOffice) -> None:
        assert registry.alias("chat").fallback == FallbackPolicy.NONE
        registry.revoke(world["beta"], "leaked", actor="sec")
        for alias in ("chat", "second"):
            a = registry.alias(alias)
            assert (a.stable, a.canary) == (None, None)
            assert a.last_fallback is not None and a.last_fallback["policy"] == "none"
        answers = self._tickets(office, world["acme"], ("chat", "second"))
        assert answers == {"chat": (403, FORBIDDEN), "second": (403, FORBIDDEN)}
        # The operator is told why; the tenant never is.
        assert "fallback policy (none)" in ticket_office.why_not(view, "acme", "chat")

    def test_stable_falls_back_to_the_most_recent_servable_release(
            self, registry: Registry, world: dict[str, str], view: RoutingView,
            office: TicketOffice) -> None:
        registry.set_fallback("chat", "stable", actor="op")
        registry.revoke(world["beta"], "leaked", actor="sec")
        a = registry.alias("chat")
        assert (a.stable, a.history) == (world["r_alpha"], [])
        row = view.alias_row("chat")
        assert row is not None and (row.stable_release, row.fallback) == (
            world["r_alpha"], "stable")
        status, body = self._tickets(office, world["acme"], ("chat",))["chat"]
        claims = ticket_claims(body["ticket"], office.settings.keys_dir)
        assert status == 200 and (claims["release"], claims["adapter"]) == (
            world["r_alpha"], world["alpha"])
        # ``second`` has no history to fall back on: nothing servable, refused.
        assert registry.alias("second").stable is None
        assert self._tickets(office, world["acme"], ("second",))["second"] == (403, FORBIDDEN)

    def test_stable_skips_history_that_is_no_longer_servable(
            self, registry: Registry, world: dict[str, str], view: RoutingView) -> None:
        registry.set_fallback("chat", "stable", actor="op")
        registry.promote(world["alpha"], to="deprecated", actor="op")
        registry.revoke(world["beta"], "leaked", actor="sec")
        a = registry.alias("chat")
        assert (a.stable, a.history) == (None, [world["r_alpha"]])
        assert view.resolve("acme", "chat") is None

    def test_base_falls_back_to_the_base_alone(
            self, registry: Registry, world: dict[str, str], view: RoutingView,
            office: TicketOffice) -> None:
        registry.set_fallback("chat", "base", actor="op")
        registry.revoke(world["beta"], "leaked", actor="sec")
        release = registry.release_manifest(registry.alias("chat").stable or "")
        assert (release.adapter_digest, release.base_digest, release.tenant) == (
            None, world["base"], None)
        status, body = self._tickets(office, world["acme"], ("chat",))["chat"]
        claims = ticket_claims(body["ticket"], office.settings.keys_dir)
        assert status == 200 and claims["adapter"] is None
        assert claims["release"] == release.digest
        route = view.resolve("acme", "chat")
        assert route is not None and route.adapter_digest is None

    def test_a_revoked_canary_is_cleared_and_its_sessions_go_to_the_stable_release(
            self, registry: Registry, world: dict[str, str], view: RoutingView) -> None:
        registry.rollback("chat", actor="op")  # stable alpha
        registry.set_canary("chat", world["r_beta"], 100, actor="op")
        registry.revoke(world["beta"], "leaked", actor="sec")
        a = registry.alias("chat")
        assert (a.stable, a.canary, a.canary_percent) == (world["r_alpha"], None, 0)
        assert a.last_fallback is not None and a.last_fallback["canary_cleared"]
        routes = {view.resolve("acme", "chat", f"s{i}") for i in range(20)}
        assert {r.release for r in routes if r is not None} == {world["r_alpha"]}

    def test_another_tenants_alias_is_untouched(
            self, registry: Registry, world: dict[str, str], view: RoutingView,
            office: TicketOffice) -> None:
        before = view.alias_row("g-chat")
        registry.set_fallback("g-chat", "base", actor="op")
        registry.revoke(world["beta"], "leaked", actor="sec")
        assert view.alias_row("g-chat") == before.__class__(**{**before.__dict__,
                                                               "fallback": "base"})
        assert registry.alias("g-chat").last_fallback is None
        status, body = self._tickets(office, world["globex"], ("g-chat",))["g-chat"]
        assert status == 200 and ticket_claims(body["ticket"], office.settings.keys_dir)[
            "adapter"] == world["gamma"]
        fell = [e for e in audit_log(registry) if e.event_type == "AliasFellBack"]
        assert sorted(e.summary["alias"] for e in fell) == ["chat", "second"]

    def test_the_fallback_is_recorded_in_the_revocations_transaction(
            self, registry: Registry, world: dict[str, str],
            monkeypatch: pytest.MonkeyPatch) -> None:
        registry.set_fallback("chat", "base", actor="op")
        saves: list[list[str]] = []
        real_save = registry.save

        def save(*events: Any, **kwargs: Any) -> Any:
            saves.append([type(e).__name__ for e in events])
            return real_save(*events, **kwargs)

        monkeypatch.setattr(registry, "save", save)
        registry.revoke(world["beta"], "leaked", actor="sec")
        assert saves == [["AdapterRevoked", "AliasFellBack", "AliasFellBack"]]
        entries = audit_log(registry)[-3:]
        assert [e.event_type for e in entries] == ["AdapterRevoked", "AliasFellBack",
                                                   "AliasFellBack"]
        assert [e.position for e in entries] == list(range(entries[0].position,
                                                           entries[0].position + 3))
        chat = next(e for e in entries if e.summary.get("alias") == "chat")
        assert chat.actor == "sec"
        assert chat.summary == {
            "alias": "chat", "adapter_digest": world["beta"], "revoked_release": world["r_beta"],
            "policy": "base", "to_release": registry.alias("chat").stable,
            "canary_cleared": False}

    def test_a_revocation_that_cannot_be_recorded_records_no_fallback(
            self, registry: Registry, world: dict[str, str],
            monkeypatch: pytest.MonkeyPatch) -> None:
        registry.set_fallback("chat", "stable", actor="op")
        before = len(audit_log(registry))

        def refuse(*_events: Any, **_kwargs: Any) -> Any:
            raise RuntimeError("database went away")

        monkeypatch.setattr(registry, "save", refuse)
        with pytest.raises(RuntimeError):
            registry.revoke(world["beta"], "leaked", actor="sec")
        monkeypatch.undo()
        assert len(audit_log(registry)) == before
        assert registry.alias("chat").stable == world["r_beta"]

    def test_policy_commands_and_alias_show(
            self, registry: Registry, world: dict[str, str], settings: Settings) -> None:
        with pytest.raises(DomainError, match="stable, base, none"):
            registry.set_fallback("chat", "previous", actor="op")
        with pytest.raises(IllegalTransition, match="already"):
            registry.set_fallback("chat", "none", actor="op")
        code, out = cli(settings, "alias", "fallback", "chat", "stable")
        assert code == 0 and out == {"alias": "chat", "fallback": "stable"}
        code, out = cli(settings, "alias", "fallback", "chat", "sideways")
        assert code != 0
        code, shown = cli(settings, "alias", "show", "chat")
        assert code == 0 and (shown["fallback"], shown["last_fallback"]) == ("stable", None)
        registry.revoke(world["beta"], "leaked", actor="sec")
        code, shown = cli(settings, "alias", "show", "chat")
        assert shown["stable"] == world["r_alpha"]
        assert shown["last_fallback"] == {
            "adapter_digest": world["beta"], "revoked_release": world["r_beta"],
            "policy": "stable", "to_release": world["r_alpha"], "canary_cleared": False}
        kinds = [e.event_type for e in audit_log(registry)]
        assert "AliasFallbackSet" in kinds and kinds[-1] == "AliasFellBack"


class TestFallbackSQLite(OnSQLite, FallbackContract):
    pass


class TestFallbackPostgres(OnPostgres, FallbackContract):
    pass
