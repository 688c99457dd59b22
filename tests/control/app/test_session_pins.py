"""Sessions keep their release: pins as events, their projection, the gateway's in-memory view,
races between gateways, expiry, revocation and rollback. One contract suite on SQLite and
PostgreSQL (``control.domain.session``, ``control.app.sessions``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient, TestServer

from control.app.audit import audit_log
from control.app.registry import Registry
from control.app.sessions import SessionPins
from control.contracts.config import ConfigError, Settings
from control.contracts.db import make_engine
from control.contracts.tickets import TicketSigner
from control.domain import SessionPin, session_pin_id
from control.gateway.server import UNAVAILABLE, make_app
from control.gateway.ticket_office import NotGranted, TicketOffice
from projections.follower import PIN_KEEP_S, ProjectionFollower, open_registry, snapshot
from projections.route_cache import CachedRoutingView
from projections.routing import RoutingView
from projections.tables import session_pins
from tests.fixtures_control import (
    Artifacts,
    OnPostgres,
    OnSQLite,
    WithRegistry,
    close_registry,
    ticket_claims,
)

EVAL = {"suite": "smoke", "accuracy": 0.9, "passed": True}


def _reasons(registry: Registry, session: str) -> list[str]:
    """The SessionRepinned reasons recorded for ``session``, in order."""
    return [e.summary["reason"] for e in audit_log(registry)
            if e.event_type == "SessionRepinned" and e.summary["session"] == session]


class SessionPinContract(WithRegistry):
    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts) -> dict[str, str]:
        """acme's alias ``chat`` on alpha (stable) with beta registered but not released;
        globex's ``g-chat``; a base alias. Returns API keys, digests and release digests."""
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                               alias="tiny-base")
        keys = {t: registry.create_tenant(t, actor="op") for t in ("acme", "globex")}
        alpha = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                          alias="chat", actor="op")
        registry.advance(alpha, external=True, evaluation=EVAL, actor="op")
        beta = registry.register_adapter(artifacts.adapters["beta"], tenant="acme",
                                         alias="chat", actor="op")
        gamma = registry.register_adapter(artifacts.adapters["gamma"], tenant="globex",
                                          alias="g-chat", actor="op")
        registry.advance(gamma, external=True, evaluation=EVAL, actor="op")
        registry.grant("acme", "chat", actor="op")
        registry.grant("globex", "g-chat", actor="op")
        release = registry.adapter(alpha).release
        assert release is not None
        return keys | {"alpha": alpha, "beta": beta, "gamma": gamma, "r_alpha": release}

    @pytest.fixture
    def signer(self, settings: Settings) -> TicketSigner:
        return TicketSigner.load_or_create(settings.keys_dir)[0]

    def _office(self, settings: Settings, registry: Registry, signer: TicketSigner, *,
                view: RoutingView | None = None,
                clock: Callable[[], float] = time.time) -> TicketOffice:
        """A gateway's office as ``serve`` builds it: cached routing, pins recorded."""
        return TicketOffice(settings, view or CachedRoutingView(registry.follower.engine,
                                                                refresh_s=0),
                            signer, SessionPins(registry, actor="gateway", clock=clock))

    def _release_beta(self, registry: Registry, world: dict[str, str]) -> str:
        registry.advance(world["beta"], external=True, evaluation=EVAL, to="canary",
                         actor="op")
        registry.break_glass(world["beta"], to="stable", reason="fixture: beta replaces alpha",
                             actor="op")  # stable: the alias moves
        release = registry.adapter(world["beta"]).release
        assert release is not None and registry.alias("chat").stable == release
        return release

    # -- keeping the release --------------------------------------------------------------------

    def test_a_session_keeps_its_release_across_a_promotion_and_a_canary(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], view: RoutingView) -> None:
        office = self._office(settings, registry, signer)
        first = office.issue("acme", "chat", "chat-1")
        assert first.release == world["r_alpha"]
        r_beta = self._release_beta(registry, world)
        for _ in range(3):  # the chat's later turns
            assert office.issue("acme", "chat", "chat-1").release == world["r_alpha"]
        assert office.issue("acme", "chat").release == r_beta  # no session: no pin
        assert office.issue("acme", "chat", "chat-2").release == r_beta  # a new session
        # A canary on the old release (100%) moves no pinned session either.
        registry.set_canary("chat", world["r_alpha"], 100, actor="op")
        assert office.issue("acme", "chat", "chat-2").release == r_beta
        # The SQL view and the in-memory view answer alike, pinned or not.
        cached = CachedRoutingView(registry.follower.engine, refresh_s=0)
        for session in ("chat-1", "chat-2", "chat-3", None):
            assert cached.resolve("acme", "chat", session) == view.resolve("acme", "chat",
                                                                           session)
        sql = view.resolve("acme", "chat", "chat-1")
        assert sql is not None and sql.pinned and sql.release == world["r_alpha"]
        # One pin per session, recorded once: later turns recorded nothing.
        pinned = [e for e in audit_log(registry) if e.aggregate == "SessionPin"]
        assert [(e.event_type, e.summary["session"]) for e in pinned] == [
            ("SessionPinned", "chat-1"), ("SessionPinned", "chat-2")]
        # A grant removed ends what a pin gives: the pin never outranks the grant.
        registry.remove_grant("acme", "chat", actor="op")
        with pytest.raises(NotGranted):
            office.issue("acme", "chat", "chat-1")

    def test_pins_are_per_tenant(self, registry: Registry, settings: Settings,
                                 signer: TicketSigner, world: dict[str, str],
                                 view: RoutingView) -> None:
        office = self._office(settings, registry, signer)
        office.issue("acme", "chat", "shared-id")
        office.issue("globex", "g-chat", "shared-id")
        with pytest.raises(NotGranted):  # the same session id gives globex nothing of acme's
            office.issue("globex", "chat", "shared-id")
        assert view.session_pin("globex", "chat", "shared-id") is None
        pins = {(p.tenant, p.alias) for p in view.session_pins("chat")}
        assert pins == {("acme", "chat")}

    # -- the projection ---------------------------------------------------------------------------

    def test_pins_are_projected_from_their_events_and_rebuild_alike(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], view: RoutingView, tmp_path: Path) -> None:
        now = [time.time()]
        office = self._office(settings, registry, signer, clock=lambda: now[0])
        office.issue("acme", "chat", "a")
        pin = view.session_pin("acme", "chat", "a")
        assert pin is not None and (pin.release, pin.version, pin.ended) == (
            world["r_alpha"], 1, False)
        assert abs(pin.expires_at - (now[0] + settings.session_ttl_s)) < 1e-3
        # Views judge expiry by the wall clock: "b" is recorded already past its expiry.
        now[0] -= 2 * settings.session_ttl_s
        office.issue("acme", "chat", "b")
        now[0] = time.time()
        assert office.end_session("acme", "chat", "a")
        assert not office.end_session("acme", "chat", "a")  # ended already: nothing recorded
        assert not office.end_session("acme", "chat", "never")
        ended = view.session_pin("acme", "chat", "a")
        assert ended is not None and ended.ended and ended.version == 2
        office.issue("acme", "chat", "b")  # expired: re-pinned
        assert _reasons(registry, "b") == ["expired"]
        office.issue("acme", "chat", "a")  # ended: started again
        assert _reasons(registry, "a") == ["restarted"]
        with registry.follower.engine.connect() as conn:
            changed = sorted(conn.execute(sa.select(session_pins.c.changed)).scalars())
        assert len(set(changed)) == 2 and changed[-1] >= 4  # raised on every write
        fresh = sa.create_engine(f"sqlite:///{tmp_path / 'rebuilt.db'}")
        try:
            ProjectionFollower(registry, fresh).rebuild_into(fresh)
            assert snapshot(fresh)["session_pins"] == snapshot(registry.follower.engine)[
                "session_pins"]
        finally:
            fresh.dispose()

    # -- the gateway's memory ---------------------------------------------------------------------

    def test_the_gateway_honours_its_own_pin_before_any_follower_projects_it(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], view: RoutingView) -> None:
        """As ``serve`` runs it: pins recorded without catching the projection up."""
        quiet = open_registry(settings, follow=False)
        try:
            mine = CachedRoutingView(registry.follower.engine, refresh_s=0)
            office = self._office(settings, quiet, signer, view=mine)
            assert office.issue("acme", "chat", "fast").release == world["r_alpha"]
            assert view.session_pin("acme", "chat", "fast") is None  # not projected yet
            route = mine.resolve("acme", "chat", "fast")
            assert route is not None and route.pinned  # from memory, at once
            # Another gateway's view has no memory of it: it sees no pin until the projection
            # shows one, and then reads it from there.
            theirs = CachedRoutingView(registry.follower.engine, refresh_s=0)
            other = theirs.resolve("acme", "chat", "fast")
            assert other is not None and not other.pinned
            registry.follower.catch_up()
            other = theirs.resolve("acme", "chat", "fast")
            assert other is not None and other.pinned
            assert mine.resolve("acme", "chat", "fast") == other
            assert not mine._remembered  # the snapshot holds it now: memory let go
            # The other gateway's office reads the pin back, records nothing.
            before = len(audit_log(registry))
            office2 = self._office(settings, registry, signer, view=theirs)
            assert office2.issue("acme", "chat", "fast").release == world["r_alpha"]
            assert len(audit_log(registry)) == before
        finally:
            close_registry(quiet)

    def test_an_end_reaches_the_other_gateways_through_the_projection(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str]) -> None:
        a = self._office(settings, registry, signer)
        b = self._office(settings, registry, signer)
        a.issue("acme", "chat", "s")
        route = b.routing.resolve("acme", "chat", "s")
        assert route is not None and route.pinned
        r_beta = self._release_beta(registry, world)
        assert b.issue("acme", "chat", "s").release == world["r_alpha"]
        assert a.end_session("acme", "chat", "s")
        assert b.issue("acme", "chat", "s").release == r_beta  # resolved afresh

    # -- races ----------------------------------------------------------------------------------

    def test_two_gateways_racing_on_one_session_end_with_one_pin(
            self, settings: Settings, world: dict[str, str], registry: Registry) -> None:
        r_beta = self._release_beta(registry, world)
        registries = [open_registry(settings), open_registry(settings)]
        try:
            barrier = threading.Barrier(2)
            results: dict[int, str] = {}
            errors: list[BaseException] = []

            def gateway(i: int) -> None:
                pins = SessionPins(registries[i], actor=f"gateway-{i}")
                load = pins._load
                first = [True]

                def racing_load(*args: Any) -> SessionPin | None:
                    found = load(*args)
                    if first[0]:  # both read "no pin" before either writes
                        first[0] = False
                        barrier.wait(timeout=10)
                    return found

                pins._load = racing_load  # type: ignore[method-assign]
                try:
                    # Each gateway's own resolution differs (one saw the alias before it moved).
                    pin = pins.pin("acme", "chat", "raced", (world["r_alpha"], r_beta)[i],
                                   servable=lambda _r: True)
                    results[i] = pin.release
                except BaseException as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=gateway, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors, errors
            assert results[0] == results[1]  # both sign the winner's release
            agg = registry.repository.get(session_pin_id("acme", "chat", "raced"))
            assert isinstance(agg, SessionPin) and agg.version == 1  # one pin, never re-pinned
            assert agg.release == results[0]
        finally:
            for r in registries:
                close_registry(r)

    # -- expiry, revocation, rollback -----------------------------------------------------------

    def test_an_expired_pin_is_repinned_to_what_the_alias_resolves_now(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str]) -> None:
        now = [time.time()]
        office = self._office(settings, registry, signer, clock=lambda: now[0])
        office.issue("acme", "chat", "long-chat")
        r_beta = self._release_beta(registry, world)
        assert office.issue("acme", "chat", "long-chat").release == world["r_alpha"]
        # The view judges expiry by the wall clock: record a pin that is already past it.
        now[0] -= 2 * settings.session_ttl_s
        office.end_session("acme", "chat", "long-chat")
        office.issue("acme", "chat", "long-chat")  # restarted, with an expiry in the past
        now[0] = time.time()
        assert office.issue("acme", "chat", "long-chat").release == r_beta
        assert _reasons(registry, "long-chat") == ["restarted", "expired"]

    def test_long_expired_pins_leave_the_table_and_a_returning_session_is_pinned_again(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], view: RoutingView) -> None:
        now = [time.time() - 3 * PIN_KEEP_S]  # pins recorded long ago: long expired now
        office = self._office(settings, registry, signer, clock=lambda: now[0])
        for session in ("old-1", "old-2", "ended"):
            office.issue("acme", "chat", session)
        office.end_session("acme", "chat", "ended")
        now[0] = time.time()
        office.issue("acme", "chat", "fresh")  # live: stays, and holds the highest `changed`
        registry.follower.catch_up()

        def rows() -> dict[str, int]:
            with registry.follower.engine.connect() as conn:
                return {r.session: r.changed for r in conn.execute(sa.select(session_pins))}

        before = rows()
        assert set(before) == {"old-1", "old-2", "ended", "fresh"}
        assert registry.follower.prune_pins() == 3
        assert set(rows()) == {"fresh"}
        # A pruned session that comes back is pinned again, and its row comes back with a
        # `changed` above every value a reader has seen.
        again = office.issue("acme", "chat", "old-1")
        assert again.release == world["r_alpha"]
        registry.follower.catch_up()
        after = rows()
        assert set(after) == {"fresh", "old-1"} and after["old-1"] > max(before.values())
        route = view.resolve("acme", "chat", "old-1")
        assert route is not None and route.pinned and route.release == world["r_alpha"]
        # A rebuild from the events prunes as the live tables were pruned: the two agree.
        fresh = make_engine(f"sqlite:///{settings.home / 'rebuilt.db'}")
        registry.follower.rebuild_into(fresh)
        with fresh.connect() as conn:
            assert set(conn.execute(sa.select(session_pins.c.session)).scalars()) == {
                "fresh", "old-1"}

    def test_a_revoked_pinned_release_is_never_served(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], view: RoutingView) -> None:
        office = self._office(settings, registry, signer)
        office.issue("acme", "chat", "s")
        r_beta = self._release_beta(registry, world)
        registry.revoke(world["alpha"], "leaked", actor="sec")
        # Before any re-pin, no view serves the pinned release any more.
        for v in (view, CachedRoutingView(registry.follower.engine, refresh_s=0)):
            route = v.resolve("acme", "chat", "s")
            assert route is not None and route.release == r_beta and not route.pinned
        assert office.issue("acme", "chat", "s").release == r_beta
        assert _reasons(registry, "s") == ["not_servable"]
        pinned = view.resolve("acme", "chat", "s")
        assert pinned is not None and pinned.pinned and pinned.release == r_beta

    def test_a_rollback_repins_or_drains_the_sessions_of_one_release(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], view: RoutingView) -> None:
        office = self._office(settings, registry, signer)
        office.issue("acme", "chat", "old")
        r_beta = self._release_beta(registry, world)
        for s in ("new-1", "new-2", "ended"):
            assert office.issue("acme", "chat", s).release == r_beta
        office.end_session("acme", "chat", "ended")
        office.issue("globex", "g-chat", "new-1")
        # The rollout's rollback: the alias back on alpha, beta's sessions re-pinned to it.
        registry.rollback("chat", actor="controller")
        registry.repin_sessions("chat", r_beta, world["r_alpha"], reason="rollback",
                                actor="controller")
        for s in ("old", "new-1", "new-2"):
            assert office.issue("acme", "chat", s).release == world["r_alpha"]
        ended = view.session_pin("acme", "chat", "ended")
        assert ended is not None and ended.ended and ended.release == r_beta  # not moved
        theirs = view.session_pin("globex", "g-chat", "new-1")
        assert theirs is not None and theirs.release != world["r_alpha"]
        kinds = [e.event_type for e in audit_log(registry) if e.aggregate == "Alias"]
        assert kinds[-2:] == ["AliasRolledBack", "AliasSessionsRepinned"]
        # Draining is recorded as a choice; nothing moves.
        registry.drain_sessions("chat", world["r_alpha"], reason="policy: drain",
                                actor="controller")
        assert office.issue("acme", "chat", "new-1").release == world["r_alpha"]

    def test_a_moved_pin_does_not_return_to_the_release_it_left(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str]) -> None:
        """The pin's aggregate still names beta after the alias moved it to alpha; when alpha
        is revoked, the session re-pins to what the alias serves, never back to beta."""
        office = self._office(settings, registry, signer)
        r_beta = self._release_beta(registry, world)
        office.issue("acme", "chat", "s")  # on beta
        registry.rollback("chat", actor="controller")
        registry.repin_sessions("chat", r_beta, world["r_alpha"], reason="rollback",
                                actor="controller")
        registry.set_fallback("chat", "base", actor="op")
        registry.revoke(world["alpha"], "leaked", actor="sec")
        issued = office.issue("acme", "chat", "s")
        assert issued.release == registry.alias("chat").stable != r_beta
        assert issued.claims.adapter is None  # the base alone
        assert _reasons(registry, "s") == ["not_servable"]

    # -- ending a session over HTTP -------------------------------------------------------------

    def test_a_tenant_ends_only_its_own_sessions(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], view: RoutingView) -> None:
        office = self._office(settings, registry, signer)
        r_beta: list[str] = []

        async def main() -> None:
            async with TestClient(TestServer(make_app(office))) as client:
                def auth(tenant: str) -> dict[str, str]:
                    return {"Authorization": f"Bearer {world[tenant]}"}

                async def ticket(session: str) -> str:
                    r = await client.post("/v1/tickets", json={"alias": "chat",
                                                               "session": session},
                                          headers=auth("acme"))
                    assert r.status == 200
                    return str(ticket_claims((await r.json())["ticket"],
                                             office.settings.keys_dir)["release"])

                assert await ticket("conv") == world["r_alpha"]
                r_beta.append(self._release_beta(registry, world))
                assert await ticket("conv") == world["r_alpha"]
                # globex ends "its" session of that name: 204, and acme's pin is untouched.
                r = await client.delete("/v1/sessions/conv", params={"alias": "chat"},
                                        headers=auth("globex"))
                assert r.status == 204 and await r.read() == b""
                assert await ticket("conv") == world["r_alpha"]
                # The same answer for a session that never existed, on any alias name.
                for alias in ("chat", "g-chat", "no-such-alias"):
                    r = await client.delete("/v1/sessions/nope", params={"alias": alias},
                                            headers=auth("acme"))
                    assert r.status == 204
                r = await client.delete("/v1/sessions/conv", params={"alias": "chat"})
                assert r.status == 401
                r = await client.delete("/v1/sessions/conv", headers=auth("acme"))
                assert r.status == 400
                r = await client.delete("/v1/sessions/conv", params={"alias": "chat"},
                                        headers=auth("acme"))
                assert r.status == 204
                assert await ticket("conv") == r_beta[0]  # a new conversation
                r = await client.post("/v1/tickets", json={"alias": "chat", "session": "a b"},
                                      headers=auth("acme"))
                assert r.status == 400

        asyncio.run(main())
        assert _reasons(registry, "conv") == ["restarted"]
        ends = [e for e in audit_log(registry) if e.event_type == "SessionEnded"]
        assert [(e.summary["tenant"], e.summary["session"]) for e in ends] == [("acme", "conv")]


    def test_no_ticket_when_its_pin_cannot_be_recorded(
            self, registry: Registry, settings: Settings, signer: TicketSigner,
            world: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
        office = self._office(settings, registry, signer)

        def outage(*_events: Any, **_kwargs: Any) -> Any:
            raise sa.exc.OperationalError("INSERT", {}, Exception("connection refused"))

        monkeypatch.setattr(registry, "save", outage)

        async def main() -> tuple[int, dict[str, Any], int]:
            async with TestClient(TestServer(make_app(office))) as client:
                auth = {"Authorization": f"Bearer {world['acme']}"}
                r = await client.post("/v1/tickets", json={"alias": "chat", "session": "s"},
                                      headers=auth)
                plain = await client.post("/v1/tickets", json={"alias": "chat"}, headers=auth)
                return r.status, await r.json(), plain.status

        status, body, plain = asyncio.run(main())
        assert (status, body) == (503, UNAVAILABLE)  # fails closed, says nothing more
        assert plain == 200  # a request without a session needs no pin


class TestSessionPinsSQLite(OnSQLite, SessionPinContract):
    pass


class TestSessionPinsPostgres(OnPostgres, SessionPinContract):
    pass


def test_session_ttl_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LORAPLANE_SESSION_TTL_S", raising=False)
    assert Settings.from_env(tmp_path).session_ttl_s == 3600
    monkeypatch.setenv("LORAPLANE_SESSION_TTL_S", "90")
    assert Settings.from_env(tmp_path).session_ttl_s == 90
    for bad, message in (("soon", "whole number"), ("0", "positive"), ("-5", "positive"),
                         (str(8 * 24 * 3600), "at most")):
        monkeypatch.setenv("LORAPLANE_SESSION_TTL_S", bad)
        with pytest.raises(ConfigError, match=message):
            Settings.from_env(tmp_path)
