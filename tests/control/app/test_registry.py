"""Registry commands, the artifact store and the audit log, on SQLite and on PostgreSQL.

``RegistryContract`` is one suite; each backend subclasses it and provides ``settings``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from control.app.audit import audit_log
from control.app.registry import Registry
from control.contracts.digests import directory_digest
from control.contracts.store import ArtifactCorrupt, ArtifactMissing, ArtifactStore
from control.domain import AlreadyExists, DomainError, IllegalTransition, NotFound, ValidationFailed
from projections.routing import RoutingView
from tests.fixtures_control import (
    Artifacts,
    OnPostgres,
    OnSQLite,
    WithRegistry,
)

PUBLIC_KEY_B64 = "11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo="


class RegistryContract(WithRegistry):
    @pytest.fixture
    def base(self, registry: Registry, artifacts: Artifacts) -> str:
        return registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny",
                                      actor="op", alias="tiny-base")

    # -- tenants, keys ----------------------------------------------------------------------

    def test_create_tenant(self, registry: Registry, view: RoutingView) -> None:
        key = registry.create_tenant("acme", actor="op")
        assert key.startswith("lp_") and len(key) > 40
        assert view.tenant_for_api_key(key) == "acme"
        assert view.tenant_for_api_key(key + "x") is None
        assert view.tenants() == ["acme"]
        with pytest.raises(AlreadyExists, match="acme"):
            registry.create_tenant("acme", actor="op")
        # The key is nowhere in the history, not even its hash in the audit view.
        entries = audit_log(registry)
        assert key not in repr(entries)
        assert "api_key_hash" not in repr(entries)

    def test_signing_key_rotation_is_recorded(self, registry: Registry,
                                              view: RoutingView) -> None:
        registry.record_signing_key("k1", PUBLIC_KEY_B64, actor="op")
        with pytest.raises(AlreadyExists):
            registry.record_signing_key("k1", PUBLIC_KEY_B64, actor="op")
        with pytest.raises(DomainError):
            registry.record_signing_key("k2", "not base64!", actor="op")
        assert view.signing_keys() == {"k1": PUBLIC_KEY_B64}
        assert audit_log(registry)[-1].event_type == "SigningKeyRecorded"

    # -- bases, adapters ----------------------------------------------------------------------

    def test_register_base(self, registry: Registry, artifacts: Artifacts,
                           base: str, view: RoutingView) -> None:
        assert base == directory_digest(artifacts.base)
        b = registry.base("tiny")
        assert b.digest == base and registry.base(base).name == "tiny"
        assert b.linear_shapes["model.layers.0.self_attn.k_proj"] == [16, 32]
        assert registry.store.contains(base) and registry.store.contains(b.tokenizer_digest)
        assert [r.name for r in view.bases()] == ["tiny"]
        with pytest.raises(AlreadyExists):
            registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny2", actor="op")
        # The base-only alias is servable, but only for granted tenants.
        registry.create_tenant("acme", actor="op")
        assert view.resolve("acme", "tiny-base") is None
        registry.grant("acme", "tiny-base", actor="op")
        route = view.resolve("acme", "tiny-base")
        assert route is not None and route.adapter_digest is None and route.base_digest == base

    def test_adapter_lifecycle_and_routing(self, registry: Registry, artifacts: Artifacts,
                                           base: str, view: RoutingView) -> None:
        registry.create_tenant("acme", actor="op")
        registry.create_tenant("globex", actor="op")
        digest = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                           alias="acme-chat", actor="alice")
        assert registry.adapter(digest).state == "draft"
        assert registry.store.verify(digest)
        row = view.adapter(digest)
        assert row is not None and row.state == "draft"
        assert row.rank == 4 and row.base_digest == base
        registry.grant("acme", "acme-chat", actor="op")
        assert view.resolve("acme", "acme-chat") is None  # draft: not servable
        assert registry.promote(digest, actor="alice") == "candidate"
        assert view.resolve("acme", "acme-chat") is None  # candidate: not servable either
        with pytest.raises(IllegalTransition, match="evaluation report"):
            registry.promote(digest, actor="alice")
        registry.record_evaluation(digest, {"suite": "smoke", "accuracy": 0.9, "passed": True},
                                   actor="eve", external=True)
        assert registry.promote(digest, actor="alice") == "canary"
        route = view.resolve("acme", "acme-chat")
        assert route is not None and route.adapter_digest == digest and route.release
        assert view.resolve("globex", "acme-chat") is None  # not granted
        assert registry.promote(digest, actor="alice") == "stable"
        assert view.resolve("acme", "acme-chat") == route.__class__(
            **{**route.__dict__, "canary": False})
        # A second version on the same alias: registering does not move the alias.
        d2 = registry.register_adapter(artifacts.adapters["by-name"], tenant="acme",
                                       alias="acme-chat", actor="alice")
        stable_route = view.resolve("acme", "acme-chat")
        assert stable_route is not None and stable_route.adapter_digest == digest
        registry.revoke(digest, "leaked weights", actor="sec")
        assert digest in view.revoked_digests() and view.is_revoked(digest)
        assert view.resolve("acme", "acme-chat") is None
        with pytest.raises(IllegalTransition):
            registry.point_alias("acme-chat", digest, actor="alice")
        registry.revoke(d2, "from draft", actor="sec")
        assert view.revoked_digests() == frozenset({digest, d2})
        assert view.base_for_digest(digest) == base
        kinds = [(e.aggregate, e.event_type) for e in audit_log(registry)]
        assert ("Adapter", "AdapterRevoked") in kinds and ("Alias", "AliasPointed") in kinds
        assert ("Release", "ReleaseCreated") in kinds
        assert all(e.actor for e in audit_log(registry))
        # Recorded order is the order things happened: a command that changes several
        # aggregates (a promotion creates a release and points an alias) records its events in
        # time order, so the log's times never go backwards.
        times = [e.time for e in audit_log(registry)]
        assert times == sorted(times)

    def test_alias_owned_by_another_tenant(self, registry: Registry, artifacts: Artifacts,
                                           base: str) -> None:
        registry.create_tenant("acme", actor="op")
        registry.create_tenant("globex", actor="op")
        registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                  actor="alice")
        with pytest.raises(ValidationFailed) as info:
            registry.register_adapter(artifacts.adapters["beta"], tenant="globex",
                                      alias="chat", actor="gina")
        assert info.value.check == "alias" and "acme" not in info.value.message
        with pytest.raises(ValidationFailed):  # operator-owned base alias is taken too
            registry.register_adapter(artifacts.adapters["beta"], tenant="globex",
                                      alias="tiny-base", actor="gina")

    def test_grant_needs_tenant_and_alias(self, registry: Registry, base: str) -> None:
        registry.create_tenant("acme", actor="op")
        with pytest.raises(NotFound):
            registry.grant("nobody", "tiny-base", actor="op")
        with pytest.raises(NotFound):
            registry.grant("acme", "no-such-alias", actor="op")
        with pytest.raises(NotFound):
            registry.register_adapter(Path("/nonexistent"), tenant="nobody", alias="x",
                                      actor="op")

    @pytest.mark.parametrize(("name", "check"), [
        ("pickled", "format"),
        ("unregistered-base", "base"),
        ("other-base", "base"),
        ("wrong-shape", "shapes"),
        ("big-rank", "rank"),
        ("extra-file", "files"),
    ])
    def test_rejected_adapter(self, registry: Registry, artifacts: Artifacts,
                              base: str, name: str, check: str) -> None:
        registry.create_tenant("acme", actor="op")
        stored_before = registry.store.digests()
        events_before = len(audit_log(registry))
        with pytest.raises(ValidationFailed) as info:
            registry.register_adapter(artifacts.adapters[name], tenant="acme",
                                      alias="acme-x", actor="alice")
        assert info.value.check == check
        assert str(registry.settings.home) not in info.value.message
        assert str(artifacts.adapters[name]) not in info.value.message
        assert registry.store.digests() == stored_before
        new = audit_log(registry)[events_before:]
        assert [e.event_type for e in new] == ["RegistrationRejected"]
        assert new[0].summary["check"] == check and new[0].actor == "alice"
        assert new[0].summary["tenant"] == "acme"
        with pytest.raises(NotFound):
            registry.alias("acme-x")

    def test_adapter_by_base_name_and_explicit_base(self, registry: Registry,
                                                    artifacts: Artifacts,
                                                    base: str) -> None:
        registry.create_tenant("acme", actor="op")
        d = registry.register_adapter(artifacts.adapters["by-name"], tenant="acme", alias="a1",
                                      actor="alice")
        assert registry.adapter(d).base_digest == base
        d2 = registry.register_adapter(artifacts.adapters["unregistered-base"], tenant="acme",
                                       alias="a2", actor="alice", base="tiny")
        assert registry.adapter(d2).base_digest == base

    def test_audit_order(self, registry: Registry, base: str) -> None:
        registry.create_tenant("acme", actor="op")
        entries = audit_log(registry)
        assert [e.position for e in entries] == sorted(e.position for e in entries)
        assert [e.event_type for e in entries] == [
            "BaseRegistered", "BaseNamed", "ReleaseCreated", "AliasCreated", "TenantCreated"]
        assert entries[0].summary["linear_modules"] == 15
        assert "linear_shapes" not in entries[0].summary
        assert entries[0].time.endswith("+00:00")
        assert audit_log(registry, since=entries[1].position, limit=1)[0] == entries[2]


class TestRegistrySQLite(OnSQLite, RegistryContract):
    pass


class TestRegistryPostgres(OnPostgres, RegistryContract):
    pass


# -- artifact store (no database) -----------------------------------------------------------


def test_store_put_is_read_only_idempotent_and_verified(tmp_path: Path,
                                                        artifacts: Artifacts) -> None:
    store = ArtifactStore(tmp_path / "store")
    src = artifacts.adapters["alpha"]
    digest = directory_digest(src)
    path = store.put(src, digest)
    assert path == store.path(digest) and store.contains(digest)
    assert store.put(src, digest) == path
    assert store.digests() == [digest]
    assert stat.S_IMODE(path.stat().st_mode) == 0o555
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o444 for p in path.iterdir())
    assert store.verify(digest) == path
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ArtifactCorrupt):
        store.put(artifacts.adapters["beta"], wrong)
    assert not store.contains(wrong) and store.digests() == [digest]
    assert not any((tmp_path / "store" / ".tmp").iterdir())
    with pytest.raises(ArtifactMissing):
        store.path(wrong)
    with pytest.raises(ValueError):
        store.path("../../etc")
    target = path / "adapter_config.json"
    os.chmod(path, 0o755)
    os.chmod(target, 0o644)
    target.write_text("{}")
    with pytest.raises(ArtifactCorrupt):
        store.verify(digest)
