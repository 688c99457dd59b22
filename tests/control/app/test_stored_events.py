"""What the event store holds stays readable: topics from before the domain was split, and
lifecycle states stored as plain strings.

Databases recorded before ``control.domain`` became one module per aggregate name every event
class ``control.domain:<Aggregate>.<Event>`` (and every created event names its aggregate,
``control.domain:<Aggregate>``, in its stored state). These tests record a history, rewrite the
stored rows to that former form with SQL, and read the database back through a fresh registry,
the projections, the audit log and ``audit verify``. One suite on SQLite and PostgreSQL.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
from typing import Any

import pytest
import sqlalchemy as sa
from eventsourcing.utils import get_topic

from control.app.audit import audit_log, export_lines
from control.app.integrity import AuditSeal
from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.domain import (
    REVOKED,
    STABLE,
    Adapter,
    AdapterState,
    SigningKey,
    TenantPolicy,
    ValidationFailed,
    signing_key_id,
)
from projections.as_of import state_as_of
from projections.follower import open_registry
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, WithRegistry, close_registry

EVENTS = "registry_events"  # eventsourcing-sqlalchemy's stored events table of "Registry"
EVAL = {"suite": "smoke", "accuracy": 0.91, "passed": True}
# A topic written after the split: the module that defines the class, e.g.
# "control.domain.tenant:Tenant.TenantCreated".
_NEW_TOPIC = re.compile(rb"control\.domain\.[a-z_]+:")


def _later() -> dt.datetime:
    return dt.datetime.now(dt.UTC) + dt.timedelta(days=1)


class StoredEventsContract(WithRegistry):
    @pytest.fixture
    def history(self, registry: Registry, artifacts: Artifacts) -> str:
        """Every aggregate kind and most event kinds; returns the adapter's digest."""
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                               alias="tiny-base")
        registry.create_tenant("acme", actor="op", policy=TenantPolicy(max_adapters=5))
        registry.rotate_api_key("acme", actor="op")
        d = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                      actor="alice")
        registry.grant("acme", "chat", actor="op")
        registry.advance(d, external=True, evaluation=EVAL, actor="alice")
        with pytest.raises(ValidationFailed):
            registry.register_adapter(artifacts.adapters["pickled"], tenant="acme",
                                      alias="chat", actor="alice")
        registry.record_signing_key("k1", base64.b64encode(b"k" * 32).decode(), actor="op")
        registry.record_signing_key("k2", base64.b64encode(b"j" * 32).decode(), actor="op")
        registry.retire_signing_key("k1", actor="op")
        registry.revoke(d, "leaked", actor="sec")
        registry.record_serving_step(d, "host-a", "drained", actor="backend")
        return d

    def _rewrite_to_former_topics(self, settings: Settings) -> int:
        """Rewrite every stored row as the single-module domain wrote it; return how many."""
        with make_engine(settings.db_url).begin() as conn:
            rows = conn.execute(sa.text(f"SELECT id, topic, state FROM {EVENTS}")).all()
            for row in rows:
                topic = _NEW_TOPIC.sub(b"control.domain:", row.topic.encode()).decode()
                state = _NEW_TOPIC.sub(b"control.domain:", bytes(row.state))
                conn.execute(sa.text(f"UPDATE {EVENTS} SET topic = :t, state = :s WHERE id = :i"),
                             {"t": topic, "s": state, "i": row.id})
        with make_engine(settings.db_url).connect() as conn:
            stored = conn.execute(sa.text(f"SELECT topic, state FROM {EVENTS}")).all()
        assert all(t.startswith("control.domain:") for t, _ in stored)
        assert not any(_NEW_TOPIC.search(bytes(s)) for _, s in stored)
        assert any(b'"originator_topic":"control.domain:Adapter"' in bytes(s) for _, s in stored)
        return len(rows)

    def test_a_database_with_former_topics_loads_back(
            self, registry: Registry, history: str, settings: Settings) -> None:
        d = history
        audit_before = audit_log(registry)
        state_before = state_as_of(registry, _later())
        count = self._rewrite_to_former_topics(settings)
        assert count == len(audit_before) > 15

        reg = open_registry(settings, follow=False)
        try:
            adapter = reg.adapter(d)
            assert adapter.state is REVOKED and adapter.had_canary
            assert adapter.serving_steps == {"host-a": ["drained"]}
            release = reg.release_manifest(adapter.release or "")
            assert release.adapter_digest == d and release.tenant == "acme"
            # The revocation's fallback (policy none) left the alias without a stable release.
            chat = reg.alias("chat")
            assert chat.stable is None and chat.last_fallback is not None
            assert chat.last_fallback["revoked_release"] == release.digest
            assert reg.alias("chat").may_resolve("acme")
            assert reg.tenant("acme").policy == TenantPolicy(max_adapters=5)
            assert reg.base("tiny").digest == release.base_digest
            key = reg.repository.get(signing_key_id("k1"))
            assert isinstance(key, SigningKey) and key.retired
            # The projections rebuilt from the former topics are the same tables.
            assert {**state_as_of(reg, _later()), "as_of": None} == {
                **state_before, "as_of": None}
            # The audit log reads the same history, event by event.
            assert audit_log(reg) == audit_before
            kinds = {(e.aggregate, e.event_type) for e in audit_before}
            assert ("RegistrationRejection", "RegistrationRejected") in kinds
            assert ("Adapter", "AdapterPromoted") in kinds

            # New events land under the new topics beside the former ones.
            reg.record_serving_step(d, "host-a", "purged", actor="backend")
            assert reg.adapter(d).serving_steps == {"host-a": ["drained", "purged"]}
            with make_engine(settings.db_url).connect() as conn:
                last = conn.execute(sa.text(
                    f"SELECT topic FROM {EVENTS} ORDER BY id DESC LIMIT 1")).scalar()
            assert last == get_topic(Adapter.AdapterPurged)
            assert last == "control.domain.adapter:Adapter.AdapterPurged"
        finally:
            close_registry(reg)

    def test_audit_verify_hashes_the_stored_topic_strings(
            self, registry: Registry, history: str, settings: Settings) -> None:
        seal = AuditSeal.for_registry(registry)
        assert seal.seal() is not None
        # The event hash covers the stored topic string: rewriting it is a modification.
        count = self._rewrite_to_former_topics(settings)
        report = seal.verify()
        assert {p.kind for p in report.problems} == {"modified"}
        assert len(report.problems) == count

    def test_audit_seals_and_verifies_former_and_new_topics_together(
            self, registry: Registry, history: str, settings: Settings) -> None:
        count = self._rewrite_to_former_topics(settings)
        with make_engine(settings.db_url).begin() as conn:
            # That deployment had no write-time chain either (control.app.chain): opening it
            # chains the rows as they are, as it does for any store recorded before the chain.
            conn.exec_driver_sql(f"DROP TABLE {EVENTS}_chain")
        reg = open_registry(settings, follow=False)
        try:
            # As a deployment from before the split would have sealed its history.
            seal = AuditSeal.for_registry(reg)
            row = seal.seal()
            assert row is not None
            assert row["last_position"] == reg.recorder.max_notification_id()
            reg.record_serving_step(history, "host-a", "purged", actor="backend")
            report = seal.verify()
            assert report.ok and report.sealed_events == count and report.unsealed_events == 1
            assert seal.seal() is not None
            report = seal.verify()
            assert report.ok and report.sealed_events == count + 1
            exported = [json.loads(line) for line in export_lines(reg)]
            assert len(exported) == count + 1
            assert {e["event_type"] for e in exported} >= {"TenantCreated", "AdapterPurged"}
        finally:
            close_registry(reg)

    def test_lifecycle_states_are_stored_as_plain_strings(
            self, registry: Registry, artifacts: Artifacts, settings: Settings) -> None:
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        registry.create_tenant("acme", actor="op")
        d = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                      actor="alice")
        final = registry.advance(d, external=True, evaluation=EVAL, actor="alice")
        assert final == "stable" and final is STABLE
        with make_engine(settings.db_url).connect() as conn:
            stored = conn.execute(sa.text(
                f"SELECT state FROM {EVENTS} WHERE topic = :t ORDER BY id"),
                {"t": get_topic(Adapter.AdapterPromoted)}).scalars().all()
        promotions: list[dict[str, Any]] = [json.loads(bytes(s)) for s in stored]
        assert [(p["from_state"], p["to"]) for p in promotions] == [
            ("draft", "candidate"), ("candidate", "canary"), ("canary", "stable")]
        assert all(type(p["to"]) is str and type(p["from_state"]) is str for p in promotions)
        assert b'"to":"stable"' in bytes(stored[-1])
        reopened = open_registry(settings, follow=False)  # replays the state from the store
        try:
            state = reopened.adapter(d).state
            assert state == AdapterState.STABLE and state is AdapterState.STABLE
        finally:
            close_registry(reopened)


class TestStoredEventsSQLite(OnSQLite, StoredEventsContract):
    pass


class TestStoredEventsPostgres(OnPostgres, StoredEventsContract):
    pass
