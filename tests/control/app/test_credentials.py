"""Credential lifecycle: rotating and revoking API keys, removing grants, rotating and retiring
ticket-signing keys, and revocations that report success only once hosts can see them.

One contract suite on SQLite and PostgreSQL. Each change is checked where it bites: a real
gateway (aiohttp test server over the cached routing view that ``serve`` runs) must answer 401,
the generic 403 or sign with another key within 1 s of the command STARTING (the clock is taken
before the registry method or the CLI verb is called: a command may itself wait for the
projection, and that wait is part of what the product promises; time the test process was frozen
is left out, see tests/stall_clock.py), and the CLI verbs must do the
same through ``--json``. Projection faults are real database faults: a trigger that
refuses writes to one projection table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from control.app import key_ring
from control.app.audit import audit_log
from control.app.key_ring import held_seal_keys
from control.app.registry import NotYetVisible, Registry
from control.cli.main import app
from control.contracts.config import Settings
from control.contracts.root_of_trust import ROOT_ENV, root_pub_path
from control.contracts.tickets import TicketSigner, TicketVerifier, load_public_keys
from control.domain import IllegalTransition, NotFound
from control.gateway import ticket_office
from control.gateway.server import FORBIDDEN, NO_SIGNING_KEY, UNAUTHORISED, make_app
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
from tests.stall_clock import StallClock

EVAL = {"suite": "smoke", "accuracy": 0.9, "passed": True}
IN_FORCE_WITHIN_S = 1.0  # what the product promises for every gateway


# -- a gateway, as `serve` runs it ---------------------------------------------------------------

Ask = Callable[[str, str], Awaitable[tuple[int, dict[str, Any]]]]


_CLOCK: list[StallClock] = []  # the clock of the scenario running now


def run_gateway(office: TicketOffice, scenario: Callable[[Ask], Awaitable[None]]) -> None:
    """Serve ``office`` on a local test server and run ``scenario(ask)`` against it, where
    ``ask(api_key, alias)`` posts one ticket request and returns (status, body). A StallClock
    runs meanwhile, for ``answer_within``."""

    async def main() -> None:
        async with TestClient(TestServer(make_app(office))) as client:
            async def ask(api_key: str, alias: str) -> tuple[int, dict[str, Any]]:
                r = await client.post("/v1/tickets", json={"alias": alias},
                                      headers={"Authorization": f"Bearer {api_key}"})
                return r.status, await r.json()

            await scenario(ask)

    with StallClock() as clock:
        _CLOCK.append(clock)
        try:
            asyncio.run(main())
        finally:
            _CLOCK.remove(clock)


async def answer_within(ask: Ask, api_key: str, alias: str, status: int, since: float,
                        limit_s: float = IN_FORCE_WITHIN_S) -> dict[str, Any]:
    """Ask until the gateway answers ``status``; fail unless it does within ``limit_s`` of
    ``since`` (``time.monotonic()`` taken before the command started), not counting time the
    test process was frozen (the run's StallClock)."""
    (clock,) = _CLOCK
    while True:
        got, body = await ask(api_key, alias)
        if time.monotonic() - since >= limit_s:  # over on the wall clock: leave freezes out
            elapsed, frozen = clock.counted(since)
            when = f"{elapsed:.3f} s after the command started ({frozen:.3f} s frozen left out)"
            assert elapsed < limit_s, (f"{status} only {when}" if got == status
                                       else f"still {got} {body} {when}")
        if got == status:
            return body
        await asyncio.sleep(0.01)


def kid_of(token: str) -> str:
    """The key id in a ticket's footer (what the gateway signed with)."""
    import base64

    footer = token.split(".")[3]
    return str(json.loads(base64.urlsafe_b64decode(footer + "=" * (-len(footer) % 4)))["kid"])


# -- real projection faults ----------------------------------------------------------------------

@contextlib.contextmanager
def refused_writes(engine: Engine, table: str) -> Iterator[None]:
    """While inside, the database refuses every insert into ``table`` (a trigger), so the
    projection follower cannot apply an event that writes there."""
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql(
                f"CREATE TRIGGER lp_refuse_{table} BEFORE INSERT ON {table} "
                "BEGIN SELECT RAISE(ABORT, 'projection write refused'); END")
        else:
            conn.exec_driver_sql(
                "CREATE FUNCTION lp_refuse_write() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'projection write refused'; END $$")
            conn.exec_driver_sql(
                f"CREATE TRIGGER lp_refuse_{table} BEFORE INSERT ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION lp_refuse_write()")
    try:
        yield
    finally:
        with engine.begin() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql(f"DROP TRIGGER lp_refuse_{table}")
            else:
                conn.exec_driver_sql(f"DROP TRIGGER lp_refuse_{table} ON {table}")
                conn.exec_driver_sql("DROP FUNCTION lp_refuse_write()")


def cli(settings: Settings, *args: str) -> tuple[int, dict[str, Any]]:
    res = CliRunner().invoke(app, ["--json", "--home", str(settings.home), "--actor", "ops",
                                   *args], env={"LORAPLANE_DB_URL": settings.db_url})
    lines = [line for line in res.stdout.splitlines() if line.startswith(("{", "["))]
    assert lines, res.stdout + repr(res.exception)
    return res.exit_code, json.loads(lines[-1])


class CredentialContract(WithRegistry):
    @pytest.fixture
    def world(self, registry: Registry, artifacts: Artifacts) -> dict[str, str]:
        """acme's released adapter on alias ``chat``, a base-only alias ``tiny-base`` granted
        to both tenants; returns the API keys and the adapter digest."""
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                               alias="tiny-base")
        keys = {t: registry.create_tenant(t, actor="op") for t in ("acme", "globex")}
        digest = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                           alias="chat", actor="op")
        registry.advance(digest, external=True, evaluation=EVAL, actor="op")
        registry.grant("acme", "chat", actor="op")
        registry.grant("acme", "tiny-base", actor="op")
        registry.grant("globex", "tiny-base", actor="op")
        return keys | {"alpha": digest}

    @pytest.fixture
    def office(self, registry: Registry, settings: Settings, world: dict[str, str]
               ) -> TicketOffice:
        """The gateway's ticket office as ``serve`` builds it: cached routing, the active key
        of this home, recorded as an event."""
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        registry.record_signing_key(signer.kid, signer.public_b64, actor="op")
        return TicketOffice(settings, CachedRoutingView(registry.follower.engine), signer)

    # -- API keys ---------------------------------------------------------------------------

    def test_rotated_api_key_replaces_the_old_one_at_the_gateway(
            self, registry: Registry, office: TicketOffice, world: dict[str, str],
            view: RoutingView) -> None:
        old = world["acme"]

        async def scenario(ask: Ask) -> None:
            assert (await ask(old, "chat"))[0] == 200
            start = time.monotonic()
            new = registry.rotate_api_key("acme", actor="op")
            assert new.startswith("lp_") and new != old
            assert await answer_within(ask, old, "chat", 401, start) == UNAUTHORISED
            status, body = await ask(new, "chat")
            assert status == 200 and ticket_claims(body["ticket"], office.settings.keys_dir)[
                "adapter"] == world["alpha"]
            assert (await ask(world["globex"], "tiny-base"))[0] == 200  # others untouched
            assert view.tenant_for_api_key(old) is None
            assert view.tenant_for_api_key(new) == "acme" and view.api_key_count("acme") == 1

        run_gateway(office, scenario)
        (entry,) = [e for e in audit_log(registry) if e.event_type == "ApiKeyRotated"]
        assert entry.summary == {"tenant": "acme"} and entry.actor == "op"
        assert "api_key_hash" not in repr(audit_log(registry))

    def test_revoked_api_keys_leave_the_tenant_without_a_working_key(
            self, registry: Registry, office: TicketOffice, world: dict[str, str],
            view: RoutingView) -> None:
        async def scenario(ask: Ask) -> None:
            start = time.monotonic()
            registry.revoke_api_keys("acme", actor="sec", reason="leaked in a log")
            assert await answer_within(ask, world["acme"], "chat", 401, start) == UNAUTHORISED
            assert view.api_key_count("acme") == 0
            with pytest.raises(IllegalTransition, match="no API key"):
                registry.revoke_api_keys("acme", actor="sec")
            assert (await ask(world["globex"], "tiny-base"))[0] == 200
            fresh = registry.rotate_api_key("acme", actor="op")  # the way back
            assert (await ask(fresh, "chat"))[0] == 200
            assert (await ask(world["acme"], "chat"))[0] == 401

        run_gateway(office, scenario)
        (entry,) = [e for e in audit_log(registry) if e.event_type == "ApiKeysRevoked"]
        assert entry.summary == {"tenant": "acme", "reason": "leaked in a log"}
        with pytest.raises(NotFound):
            registry.revoke_api_keys("nobody", actor="sec")

    # -- grants -----------------------------------------------------------------------------

    def test_removed_grant_gets_the_generic_403(
            self, registry: Registry, office: TicketOffice, world: dict[str, str],
            view: RoutingView) -> None:
        async def scenario(ask: Ask) -> None:
            assert (await ask(world["acme"], "chat"))[0] == 200
            start = time.monotonic()
            registry.remove_grant("acme", "chat", actor="op")
            body = await answer_within(ask, world["acme"], "chat", 403, start)
            # The same body as for an alias that never existed: nothing to tell them apart.
            assert body == FORBIDDEN == (await ask(world["acme"], "no-such-alias"))[1]
            assert (await ask(world["acme"], "tiny-base"))[0] == 200  # other grants stay
            assert not view.is_granted("acme", "chat") and view.is_granted("acme", "tiny-base")
            with pytest.raises(NotFound, match="no grant"):
                registry.remove_grant("acme", "chat", actor="op")
            registry.grant("acme", "chat", actor="op")  # and back
            assert (await ask(world["acme"], "chat"))[0] == 200

        run_gateway(office, scenario)
        assert registry.alias("chat").grants == ["acme"]
        removed = [e for e in audit_log(registry) if e.event_type == "AliasGrantRemoved"]
        assert [e.summary for e in removed] == [{"alias": "chat", "tenant": "acme"}]

    # -- signing keys ---------------------------------------------------------------------------

    def test_retired_signing_key_is_never_signed_with(
            self, registry: Registry, office: TicketOffice, world: dict[str, str],
            settings: Settings, view: RoutingView, monkeypatch: pytest.MonkeyPatch) -> None:
        first = office.signer.kid
        kids: dict[str, str] = {}
        monkeypatch.setattr(ticket_office, "RESCAN_S", 0.05)  # keep the refusal case short

        async def scenario(ask: Ask) -> None:
            second, previous = registry.rotate_signing_key(actor="op")
            kids["second"] = second
            assert previous == first and key_ring.active_signer(settings.keys_dir) is not None
            # Rotation alone changes nothing for a running gateway: the old key is still good.
            assert kid_of((await ask(world["acme"], "chat"))[1]["ticket"]) == first
            with pytest.raises(IllegalTransition, match="key rotate"):
                registry.retire_signing_key(second, actor="op")  # the active key here
            start = time.monotonic()
            registry.retire_signing_key(first, actor="op", reason="rotated")
            assert view.retired_key_ids() == frozenset({first})
            while kid_of((await answer_within(ask, world["acme"], "chat", 200, start))["ticket"]
                         ) != second:
                assert time.monotonic() - start < IN_FORCE_WITHIN_S, "still signing with it"
                await asyncio.sleep(0.01)
            assert office.signer.kid == second
            # With no unretired key left, nothing is signed at all.
            with pytest.raises(IllegalTransition, match="key rotate"):
                registry.retire_signing_key(second, actor="op")
            start = time.monotonic()
            registry.retire_signing_key(second, actor="op", force=True)
            assert await answer_within(ask, world["acme"], "chat", 503, start) == NO_SIGNING_KEY
            start = time.monotonic()
            third, _ = registry.rotate_signing_key(actor="op")
            body = await answer_within(ask, world["acme"], "chat", 200, start)
            assert kid_of(body["ticket"]) == third

        run_gateway(office, scenario)
        with pytest.raises(IllegalTransition, match="already retired"):
            registry.retire_signing_key(first, actor="op", force=True)
        with pytest.raises(NotFound):
            registry.retire_signing_key("0" * 16, actor="op")
        retired = [e.summary for e in audit_log(registry) if e.event_type == "SigningKeyRetired"]
        # each retirement carries the root's signature (control.contracts.root_of_trust)
        assert all(r.pop("root_signature") for r in retired)
        assert retired == [{"kid": first, "reason": "rotated"}, {"kid": kids["second"]}]

    def test_hosts_keep_only_unretired_public_keys(
            self, registry: Registry, office: TicketOffice, world: dict[str, str],
            settings: Settings, view: RoutingView, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:
        from control.ops.key_sync import sync_public_keys

        host = Settings(home=tmp_path / "host", db_url=settings.db_url)  # another machine
        first = office.signer.kid
        # which trusts nothing until its configuration names the root (not the database)
        assert sync_public_keys(host, view) == 0
        monkeypatch.setenv(ROOT_ENV, str(root_pub_path(settings.keys_dir)))
        assert sync_public_keys(host, view) == 1
        second, _ = registry.rotate_signing_key(actor="op")
        assert sync_public_keys(host, view) == 1
        assert set(load_public_keys(host.keys_dir / "public")) == {first, second}
        registry.retire_signing_key(first, actor="op")
        assert sync_public_keys(host, view) == 1  # one file removed
        assert set(load_public_keys(host.keys_dir / "public")) == {second}
        assert sync_public_keys(host, view) == 0
        # A host built from those files refuses what the retired key signed.
        route = view.resolve("acme", "chat")
        assert route is not None
        verifier = TicketVerifier(load_public_keys(host.keys_dir / "public"),
                                  seal_keys=held_seal_keys(office.settings.keys_dir),
                                  model="lora_llm", base=route.base_digest,
                                  tokenizer=route.tokenizer_digest)
        old_ticket = office.signer.issue(
            tenant="acme", model="lora_llm", base=route.base_digest,
            adapter=route.adapter_digest, tokenizer=route.tokenizer_digest,
            release=route.release, disclose=False, ttl_s=60)[0]
        from control.contracts.tickets import TicketRejected

        with pytest.raises(TicketRejected) as e:
            verifier.verify(old_ticket)
        assert e.value.reason == "unknown_key"
        assert verifier.verify(office.issue("acme", "chat").token).kid == second

    # -- alias revocation -------------------------------------------------------------------------

    def test_revoked_adapter_stops_its_alias_at_the_gateway(
            self, registry: Registry, office: TicketOffice, world: dict[str, str]) -> None:
        async def scenario(ask: Ask) -> None:
            assert (await ask(world["acme"], "chat"))[0] == 200
            start = time.monotonic()
            registry.revoke(world["alpha"], "leak", actor="sec")
            assert await answer_within(ask, world["acme"], "chat", 403, start) == FORBIDDEN
            assert (await ask(world["acme"], "tiny-base"))[0] == 200  # other aliases stay

        run_gateway(office, scenario)

    # -- the CLI verbs, at a running gateway -----------------------------------------------------

    def test_cli_verbs_are_in_force_at_the_gateway_within_1s_of_starting(
            self, registry: Registry, office: TicketOffice, world: dict[str, str],
            settings: Settings) -> None:
        """Each verb's clock starts before the verb is invoked: what it waits for (recording,
        projecting, confirming) counts against the promise."""

        async def scenario(ask: Ask) -> None:
            assert (await ask(world["globex"], "tiny-base"))[0] == 200
            start = time.monotonic()
            assert cli(settings, "tenant", "revoke-keys", "globex")[0] == 0
            assert await answer_within(ask, world["globex"], "tiny-base", 401, start) \
                == UNAUTHORISED
            start = time.monotonic()
            assert cli(settings, "ungrant", "acme", "tiny-base")[0] == 0
            assert await answer_within(ask, world["acme"], "tiny-base", 403, start) == FORBIDDEN
            start = time.monotonic()
            assert cli(settings, "adapter", "revoke", world["alpha"], "--reason", "leak")[0] == 0
            assert await answer_within(ask, world["acme"], "chat", 403, start) == FORBIDDEN
            # Key retirement: rotate (this home's keys folder is the office's), then retire
            # the key the office signs with; it must switch to the new one.
            registry.grant("acme", "tiny-base", actor="op")
            first = office.signer.kid
            code, rotated = cli(settings, "key", "rotate")
            assert code == 0 and rotated["previous"] == first
            start = time.monotonic()
            assert cli(settings, "key", "retire", first)[0] == 0
            while kid_of((await answer_within(ask, world["acme"], "tiny-base", 200, start)
                          )["ticket"]) != rotated["kid"]:
                assert time.monotonic() - start < IN_FORCE_WITHIN_S, "still signing with it"
                await asyncio.sleep(0.01)

        run_gateway(office, scenario)

    # -- honest revocation ---------------------------------------------------------------------

    def test_revocation_not_visible_to_hosts_fails_and_says_so(
            self, registry: Registry, world: dict[str, str], view: RoutingView,
            settings: Settings) -> None:
        with refused_writes(registry.follower.engine, "revocations"):
            with pytest.raises(NotYetVisible, match="recorded but not yet visible"):
                registry.revoke(world["alpha"], "leak", actor="sec", wait_s=0.2)
            assert registry.adapter(world["alpha"]).state == "revoked"  # recorded
            assert not view.is_revoked(world["alpha"])  # what hosts read: not there
            code, out = cli(settings, "adapter", "revoke", world["alpha"], "--reason", "again")
            assert code == 2 and "already revoked" in out["error"]
        registry.follower.catch_up()  # the fault is gone: the follower catches up
        assert view.is_revoked(world["alpha"])

    def test_cli_revoke_exits_non_zero_until_hosts_see_it(
            self, registry: Registry, world: dict[str, str], view: RoutingView,
            settings: Settings) -> None:
        with refused_writes(registry.follower.engine, "revocations"):
            code, out = cli(settings, "adapter", "revoke", world["alpha"], "--reason", "leak",
                            "--wait", "0.2")
            assert code == 2 and out["kind"] == "NotYetVisible"
            assert "revocation is recorded but not yet visible" in out["error"]
            assert str(settings.home) not in out["error"]
        registry.follower.catch_up()
        assert view.is_revoked(world["alpha"])

    def test_rotated_key_is_shown_even_when_not_yet_in_force(
            self, registry: Registry, world: dict[str, str], view: RoutingView,
            settings: Settings) -> None:
        with refused_writes(registry.follower.engine, "api_keys"):
            code, out = cli(settings, "tenant", "rotate-key", "acme", "--wait", "0.2")
            assert code == 2 and out["kind"] == "NotYetVisible" and out["visible"] is False
            new = out["api_key"]
            assert view.tenant_for_api_key(world["acme"]) == "acme"  # old key still in force
        registry.follower.catch_up()
        assert view.tenant_for_api_key(new) == "acme"
        assert view.tenant_for_api_key(world["acme"]) is None

    def test_new_signing_key_is_not_made_active_unless_hosts_can_see_it(
            self, registry: Registry, office: TicketOffice, settings: Settings,
            view: RoutingView) -> None:
        before = office.signer.kid
        with (refused_writes(registry.follower.engine, "signing_keys"),
              pytest.raises(NotYetVisible, match="NOT made active")):
            registry.rotate_signing_key(actor="op", wait_s=0.2)
        active = key_ring.active_signer(settings.keys_dir)
        assert active is not None and active.kid == before
        assert [s.kid for s in key_ring.held_signers(settings.keys_dir)] == [before]
        registry.follower.catch_up()
        assert len(view.signing_keys()) == 2  # recorded, never used: may be retired
        assert office.issue("acme", "chat").claims.kid == before

    # -- the CLI verbs ----------------------------------------------------------------------------

    def test_cli_verbs(self, registry: Registry, world: dict[str, str], view: RoutingView,
                       settings: Settings) -> None:
        code, out = cli(settings, "tenant", "rotate-key", "acme")
        assert code == 0 and out["visible"] is True and out["api_key"].startswith("lp_")
        assert view.tenant_for_api_key(out["api_key"]) == "acme"
        assert view.tenant_for_api_key(world["acme"]) is None
        code, out = cli(settings, "tenant", "revoke-keys", "globex", "--reason", "offboarded")
        assert (code, out) == (0, {"tenant": "globex", "api_keys": 0})
        assert view.api_key_count("globex") == 0
        code, out = cli(settings, "tenant", "revoke-keys", "globex")
        assert code == 2 and "no API key" in out["error"]
        code, out = cli(settings, "ungrant", "acme", "chat")
        assert (code, out) == (0, {"tenant": "acme", "alias": "chat", "granted": False})
        assert not view.is_granted("acme", "chat")
        code, out = cli(settings, "ungrant", "acme", "chat")
        assert code == 2 and out["kind"] == "NotFound"
        # Signing keys: the first rotation makes the first key; the second supersedes it.
        code, first = cli(settings, "key", "rotate")
        assert code == 0 and first["previous"] is None
        code, second = cli(settings, "key", "rotate")
        assert code == 0 and second["previous"] == first["kid"]
        code, out = cli(settings, "key", "retire", second["kid"])
        assert code == 2 and "key rotate" in out["error"]
        code, out = cli(settings, "key", "retire", first["kid"], "--reason", "rotated")
        assert (code, out) == (0, {"kid": first["kid"], "retired": True})
        code, rows = cli(settings, "key", "list")
        assert code == 0
        assert [(r["kid"], r["retired_at"] is not None, r["active_here"]) for r in rows] == [
            (first["kid"], True, False), (second["kid"], False, True)]
        code, events = cli(settings, "audit", "log")
        kinds = [e["event_type"] for e in events]
        for kind in ("ApiKeyRotated", "ApiKeysRevoked", "AliasGrantRemoved",
                     "SigningKeyRecorded", "SigningKeyRetired"):
            assert kind in kinds
        assert "key_hash" not in json.dumps(events)
        code, state = cli(settings, "audit", "log", "--as-of", "2999-01-01T00:00:00")
        assert state["retired_keys"] == [first["kid"]]
        assert state["tenants_without_key"] == ["globex"]
        assert {"tenant": "acme", "alias": "chat"} not in state["grants"]


class TestCredentialsSQLite(OnSQLite, CredentialContract):
    pass


class TestCredentialsPostgres(OnPostgres, CredentialContract):
    pass


def test_rotation_that_cannot_be_recorded_leaves_the_active_key(tmp_path: Path) -> None:
    """The new key becomes active only after its public half is recorded."""
    keys = tmp_path / "keys"
    before, _ = TicketSigner.load_or_create(keys)

    def refuse(_signer: TicketSigner) -> None:
        raise sa.exc.OperationalError("INSERT", {}, Exception("database away"))

    with pytest.raises(sa.exc.OperationalError):
        key_ring.rotate(keys, refuse)
    active = key_ring.active_signer(keys)
    assert active is not None and active.kid == before.kid
    assert [s.kid for s in key_ring.held_signers(keys)] == [before.kid]
    assert sorted(p.name for p in (keys / "public").iterdir()) == [f"{before.kid}.pub"]
    recorded: list[str] = []
    after, previous = key_ring.rotate(keys, lambda s: recorded.append(s.kid))
    assert previous == before.kid and recorded == [after.kid]
    assert [s.kid for s in key_ring.held_signers(keys)] == [after.kid, before.kid]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in (keys / "private").glob("*.pem"))
