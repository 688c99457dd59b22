"""Lifecycle guards, release manifests, canary aliases, rollback, limits, signatures, revocation
steps, incident queries and concurrent commands: one contract suite on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from control.app.audit import audit_log
from control.app.registry import Registry
from control.app.releases import MANIFEST_FILE, get_document
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, LedgerEntry
from control.contracts.tickets import TicketSigner
from control.domain import (
    AdapterMetadata,
    Conflict,
    DomainError,
    IllegalTransition,
    TenantPolicy,
    ValidationFailed,
)
from control.gateway.ticket_office import NotGranted, TicketOffice
from projections.as_of import state_as_of
from projections.follower import open_registry
from projections.incidents import UnknownSubject, requests_for
from projections.routing import RoutingView
from tests.fixtures_control import (
    Artifacts,
    OnPostgres,
    OnSQLite,
    WithRegistry,
    close_registry,
)

EVAL = {"producer": "ml-team eval pipeline", "suite": "smoke", "accuracy": 0.91,
        "passed": True}


def _events(registry: Registry) -> int:
    return int(registry.recorder.max_notification_id() or 0)


def _ec_keys(tmp: Path, name: str) -> tuple[Path, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    priv = tmp / f"{name}.pem"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub = key.public_key().public_bytes(serialization.Encoding.PEM,
                                        serialization.PublicFormat.SubjectPublicKeyInfo)
    return priv, pub.decode()


def _sign(folder: Path, private_key: Path, out: Path) -> Path:
    import model_signing

    model_signing.signing.Config().use_elliptic_key_signer(private_key=private_key).sign(
        folder, out)
    return out


class LifecycleContract(WithRegistry):
    @pytest.fixture
    def base(self, registry: Registry, artifacts: Artifacts) -> str:
        digest = registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny",
                                        actor="op", alias="tiny-base")
        registry.create_tenant("acme", actor="op")
        registry.create_tenant("globex", actor="op")
        return digest

    def test_illegal_transitions_record_nothing(self, registry: Registry,
                                                artifacts: Artifacts, base: str) -> None:
        d = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                      actor="alice")
        before = _events(registry)
        for to in ("stable", "canary", "deprecated", "revoked", "nonsense"):
            with pytest.raises(IllegalTransition):
                registry.promote(d, to=to, actor="alice")
        registry.promote(d, actor="alice")  # -> candidate
        with pytest.raises(IllegalTransition, match="evaluation report"):
            registry.promote(d, actor="alice")
        assert _events(registry) == before + 1
        assert registry.adapter(d).state == "candidate"
        assert registry.store.digests() == sorted(registry.store.digests())  # nothing partial

    def test_release_manifest_canary_split_and_rollback(
            self, registry: Registry, artifacts: Artifacts, base: str, view: RoutingView,
            settings: Settings) -> None:
        v1 = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                       alias="chat", actor="alice",
                                       metadata=AdapterMetadata(owner="ml-team",
                                                                training_data_version="td-1"))
        registry.grant("acme", "chat", actor="op")
        assert registry.advance(v1, external=True, evaluation=EVAL, actor="alice",
                                inference_defaults={"max_tokens": 32}) == "stable"
        r1 = registry.adapter(v1).release
        assert r1 is not None
        doc = get_document(registry.store, MANIFEST_FILE, r1)
        assert doc["adapter_digest"] == v1 and doc["base_digest"] == base
        assert doc["inference_defaults"] == {"max_tokens": 32}
        assert doc["evaluation_report_digest"] == registry.adapter(v1).evaluation_report
        assert {"tokenizer_digest", "chat_template_digest"} <= set(doc)
        # v2 enters canary at 30%: sessions split by hash, each session sticky.
        v2 = registry.register_adapter(artifacts.adapters["by-name"], tenant="acme",
                                       alias="chat", actor="alice")
        registry.advance(v2, external=True, evaluation=EVAL, to="canary", canary_percent=30,
                         actor="alice")
        r2 = registry.adapter(v2).release
        picks = {s: view.resolve("acme", "chat", f"s{s}") for s in range(300)}
        assert all(p is not None for p in picks.values())
        share = sum(p.release == r2 for p in picks.values() if p) / len(picks)
        assert 0.2 < share < 0.4, share
        assert all(view.resolve("acme", "chat", f"s{s}") == p for s, p in picks.items())
        # The ticket binds what was resolved at issue time.
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        office = TicketOffice(settings, view, signer)
        canary_session = next(f"s{s}" for s, p in picks.items() if p and p.release == r2)
        issued = office.issue("acme", "chat", canary_session)
        assert issued.release == r2 and issued.claims.adapter == v2
        # Graduation needs a completed rollout or a break-glass (the alias has a stable
        # release of its own): a plain promotion is refused, recording nothing.
        before = _events(registry)
        with pytest.raises(IllegalTransition, match="completed rollout"):
            registry.promote(v2, actor="alice")
        assert _events(registry) == before
        # Graduation: stable; the split ends; then rollback is one command and one event.
        assert registry.break_glass(v2, to="stable", reason="hotfix for ticket 42",
                                    actor="oncall") == "stable"
        glass = [e for e in audit_log(registry) if e.event_type == "BreakGlassUsed"]
        assert [(g.actor, g.summary["to"], g.summary["overrides"], g.summary["reason"])
                for g in glass] == [("oncall", "stable", "no_rollout", "hotfix for ticket 42")]
        assert {view.resolve("acme", "chat", f"s{s}").release for s in range(50)} == {r2}  # type: ignore[union-attr]
        before = _events(registry)
        assert registry.rollback("chat", actor="oncall") == r1
        assert _events(registry) == before + 1
        assert audit_log(registry)[-1].event_type == "AliasRolledBack"
        assert {view.resolve("acme", "chat", f"s{s}").release for s in range(50)} == {r1}  # type: ignore[union-attr]
        # The issued ticket still names v2's bytes; a new one for that session gets v1.
        assert issued.claims.adapter == v2
        assert office.issue("acme", "chat", canary_session).claims.adapter == v1
        with pytest.raises(IllegalTransition, match="no previous"):
            registry.rollback("chat", actor="oncall")
        # Deprecated and revoked stop new resolution.
        registry.point_alias("chat", v2, actor="oncall")
        registry.promote(v2, to="deprecated", actor="alice")
        assert view.resolve("acme", "chat", "x") is None
        with pytest.raises(IllegalTransition, match="not servable"):
            registry.point_alias("chat", v2, actor="oncall")
        registry.rollback("chat", actor="oncall")
        assert view.resolve("acme", "chat", "x").adapter_digest == v1  # type: ignore[union-attr]
        registry.revoke(v1, "leak", actor="sec")
        assert view.resolve("acme", "chat", "x") is None
        with pytest.raises(NotGranted):
            office.issue("acme", "chat", "x")

    def test_revocation_workflow_events(self, registry: Registry, artifacts: Artifacts,
                                        base: str, view: RoutingView) -> None:
        d = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                      actor="alice")
        registry.advance(d, external=True, evaluation=EVAL, actor="alice")
        with pytest.raises(IllegalTransition):
            registry.record_serving_step(d, "host-a", "drained", actor="backend")
        registry.revoke(d, "leak", actor="sec")
        for host in ("host-a", "host-b"):
            for step in ("drained", "purged", "unloaded"):
                registry.record_serving_step(d, host, step, actor="backend")
        assert view.serving_steps(d) == {"host-a": ["drained", "purged", "unloaded"],
                                         "host-b": ["drained", "purged", "unloaded"]}
        kinds = [e.event_type for e in audit_log(registry)]
        assert kinds[-6:] == ["AdapterDrained", "AdapterPurged", "AdapterUnloaded"] * 2
        assert registry.store.contains(d)  # the record and bytes stay; serving never resumes
        with pytest.raises(IllegalTransition):
            registry.point_alias("chat", d, actor="op")

    def test_tenant_limits(self, registry: Registry, artifacts: Artifacts, base: str,
                           tmp_path: Path) -> None:
        registry.set_policy("acme", TenantPolicy(max_adapters=1, max_rank=2,
                                                 allowed_target_modules={base: ["q_proj"]}),
                            actor="op")
        with pytest.raises(ValidationFailed) as info:  # alpha has rank 4
            registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="a",
                                      actor="alice")
        assert info.value.check == "rank"
        with pytest.raises(ValidationFailed) as info:  # beta targets q_proj and v_proj
            registry.register_adapter(artifacts.adapters["beta"], tenant="acme", alias="a",
                                      actor="alice")
        assert info.value.check == "limits" and "v_proj" in info.value.message
        registry.set_policy("acme", TenantPolicy(max_adapters=1, max_file_bytes=500),
                            actor="op")
        with pytest.raises(ValidationFailed) as info:
            registry.register_adapter(artifacts.adapters["gamma"], tenant="acme", alias="a",
                                      actor="alice")
        assert info.value.check == "limits" and "bytes" in info.value.message
        registry.set_policy("acme", TenantPolicy(max_adapters=1), actor="op")
        registry.register_adapter(artifacts.adapters["beta"], tenant="acme", alias="a",
                                  actor="alice")
        with pytest.raises(ValidationFailed, match="limit is 1"):
            registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="a",
                                      actor="alice")
        # globex has no policy: unaffected, and no message names acme.
        registry.register_adapter(artifacts.adapters["alpha"], tenant="globex", alias="g",
                                  actor="gina")
        rejected = [e for e in audit_log(registry) if e.event_type == "RegistrationRejected"]
        assert len(rejected) == 4 and all(e.summary["tenant"] == "acme" for e in rejected)

    def test_submitted_folder_shape(self, registry: Registry, artifacts: Artifacts,
                                    base: str, tmp_path: Path) -> None:
        import shutil

        src = artifacts.adapters["alpha"]
        linked_dir = tmp_path / "linked"
        linked_dir.symlink_to(src)
        outside = tmp_path / "outside"
        shutil.copytree(src, outside)
        traversal = tmp_path / "traversal"
        shutil.copytree(src, traversal)
        (traversal / "adapter_config.json").unlink()
        (traversal / "adapter_config.json").symlink_to(outside / "adapter_config.json")
        extra = tmp_path / "extra"
        shutil.copytree(src, extra)
        (extra / "README.md").write_text("hi")
        nested = tmp_path / "nested"
        shutil.copytree(src, nested)
        (nested / "sub").mkdir()
        (nested / "sub" / "x").write_text("x")
        stored = registry.store.digests()
        for folder in (linked_dir, traversal, extra, nested):
            with pytest.raises(ValidationFailed) as info:
                registry.register_adapter(folder, tenant="acme", alias="a", actor="alice")
            assert info.value.check == "files", folder.name
            assert str(tmp_path) not in info.value.message
        assert registry.store.digests() == stored

    def test_signatures(self, registry: Registry, artifacts: Artifacts, base: str,
                        tmp_path: Path, view: RoutingView) -> None:
        import shutil

        priv, pub = _ec_keys(tmp_path, "trusted")
        other_priv, _ = _ec_keys(tmp_path, "other")
        registry.set_policy("acme", TenantPolicy(require_signature=True, trusted_keys=[pub]),
                            actor="op")
        src = artifacts.adapters["alpha"]
        with pytest.raises(ValidationFailed) as info:
            registry.register_adapter(src, tenant="acme", alias="a", actor="alice")
        assert info.value.check == "signature"
        bad = _sign(src, other_priv, tmp_path / "other.sig")
        with pytest.raises(ValidationFailed, match="trusted keys"):
            registry.register_adapter(src, tenant="acme", alias="a", actor="alice",
                                      signature=bad)
        good = _sign(src, priv, tmp_path / "good.sig")
        tampered = tmp_path / "tampered"
        shutil.copytree(artifacts.adapters["beta"], tampered)
        with pytest.raises(ValidationFailed, match="signature"):
            registry.register_adapter(tampered, tenant="acme", alias="a", actor="alice",
                                      signature=good)
        d = registry.register_adapter(src, tenant="acme", alias="a", actor="alice",
                                      signature=good)
        sig = registry.adapter(d).signature
        assert sig is not None and sig["signed_digest"] == d
        assert sig["method"] == "model-signing/key"
        assert registry.promote(d, actor="alice") == "candidate"
        row = view.adapter(d)
        assert row is not None and row.signature == "model-signing/key"
        # A policy tightened after registration still guards candidate.
        unsigned_tenant_adapter = registry.register_adapter(
            artifacts.adapters["beta"], tenant="globex", alias="g", actor="gina")
        registry.set_policy("globex", TenantPolicy(require_signature=True, trusted_keys=[pub]),
                            actor="op")
        with pytest.raises(IllegalTransition, match="signature"):
            registry.promote(unsigned_tenant_adapter, actor="gina")

    def test_incident_queries_by_training_data_and_base(
            self, registry: Registry, artifacts: Artifacts, base: str,
            settings: Settings) -> None:
        d1 = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="a",
                                       actor="alice",
                                       metadata=AdapterMetadata(training_data_version="td-7",
                                                                licence="apache-2.0",
                                                                allowed_tasks=["chat"]))
        d2 = registry.register_adapter(artifacts.adapters["beta"], tenant="globex", alias="g",
                                       actor="gina",
                                       metadata=AdapterMetadata(training_data_version="td-8"))
        ledger = Ledger(make_engine(settings.db_url))
        now = time.time()
        rows = [LedgerEntry(request_id=f"r{i}", ticket_id=None, tenant=t, model="lora_llm",
                            host="h", base_digest=base, adapter_digest=d, tokenizer_digest=None,
                            admitted_at=now + i, outcome="ok")
                for i, (t, d) in enumerate([("acme", d1), ("globex", d2), ("acme", None)])]
        ledger.admit(rows)
        by_td = requests_for(settings, training_data_version="td-7")
        assert [r.request_id for r in by_td] == ["r0"]
        assert [r.request_id for r in requests_for(settings, base=base)] == ["r0", "r1", "r2"]
        with pytest.raises(UnknownSubject, match="unknown training data version 'nope'"):
            requests_for(settings, training_data_version="nope")
        one_off = d1[:-1] + ("0" if d1[-1] != "0" else "1")  # one character off
        with pytest.raises(UnknownSubject, match=f"unknown adapter digest {one_off}"):
            requests_for(settings, adapter=one_off)
        with pytest.raises(UnknownSubject, match="unknown release digest"):
            requests_for(settings, release=one_off)
        with pytest.raises(UnknownSubject, match="unknown base digest"):
            requests_for(settings, base=one_off)
        with pytest.raises(ValueError):
            requests_for(settings, base=base, adapter=d1)

    def test_state_as_of(self, registry: Registry, artifacts: Artifacts, base: str) -> None:
        d = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                      actor="alice")
        registry.advance(d, external=True, evaluation=EVAL, actor="alice")
        between = max(e.time for e in audit_log(registry))
        time.sleep(0.05)
        registry.revoke(d, "leak", actor="sec")
        import datetime as dt

        then = state_as_of(registry, dt.datetime.fromisoformat(between))
        assert [a["state"] for a in then["adapters"]] == ["stable"] and then["revoked"] == []
        chat = next(a for a in then["aliases"] if a["alias"] == "chat")
        assert chat["stable_release"] == registry.adapter(d).release
        now = state_as_of(registry, dt.datetime.now(dt.UTC))
        assert [a["state"] for a in now["adapters"]] == ["revoked"] and now["revoked"] == [d]
        before = state_as_of(registry, dt.datetime(2000, 1, 1))
        assert before["adapters"] == [] and before["position"] == 0

    def test_concurrent_alias_moves_one_wins(self, registry: Registry, artifacts: Artifacts,
                                             base: str, settings: Settings) -> None:
        d = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme", alias="chat",
                                      actor="alice")
        registry.advance(d, external=True, evaluation=EVAL, actor="alice")
        d2 = registry.register_adapter(artifacts.adapters["by-name"], tenant="acme",
                                       alias="chat", actor="alice")
        registry.advance(d2, external=True, evaluation=EVAL, to="canary", actor="alice")
        other = open_registry(settings)
        try:
            # Both load the alias at the same version, both move it: one save wins.
            a1, a2 = registry.alias("chat"), other.alias("chat")
            before = _events(registry)
            r_base = registry.release_manifest(registry.alias("tiny-base").stable or "")
            a1.point(r_base, True, "one")
            a2.clear_canary("two")
            registry.commit(a1, what="alias")
            with pytest.raises(Conflict, match="concurrently"):
                other.commit(a2, what="alias")
            assert _events(registry) == before + 1
            # Real threads: every attempt either records exactly one event or says Conflict.
            results: list[str] = []
            lock = threading.Lock()
            targets = [d, r_base.digest]

            def mover(reg: Registry, k: int) -> None:
                for i in range(6):
                    try:
                        reg.point_alias("chat", targets[(i + k) % 2], actor=f"t{k}")
                        out = "ok"
                    except Conflict:
                        out = "conflict"
                    except (IllegalTransition, DomainError):
                        out = "noop"  # already pointing there
                    with lock:
                        results.append(out)

            start = _events(registry)
            threads = [threading.Thread(target=mover, args=(r, k))
                       for k, r in enumerate((registry, other))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert len(results) == 12
            pointed = [e for e in audit_log(registry, since=start)
                       if e.event_type == "AliasPointed"]
            assert len(pointed) == results.count("ok")
            versions = [registry.alias("chat").version]
            assert versions[0] == len([e for e in audit_log(registry)
                                       if e.aggregate_id == str(registry.alias("chat").id)])
        finally:
            close_registry(other)


class TestLifecycleSQLite(OnSQLite, LifecycleContract):
    pass


class TestLifecyclePostgres(OnPostgres, LifecycleContract):
    pass


def test_cli_policy_evaluate_canary_rollback(tmp_path: Path, artifacts: Artifacts) -> None:
    from typer.testing import CliRunner

    from control.cli.main import app

    home = tmp_path / "home"

    def cli(*args: str) -> tuple[int, object]:
        res = CliRunner().invoke(app, ["--json", "--home", str(home), "--actor", "ops", *args],
                                 env={"LORAPLANE_DB_URL": ""})
        try:
            return res.exit_code, json.loads(res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return res.exit_code, res.stdout

    assert cli("base", "register", str(artifacts.base), "--tokenizer", str(artifacts.tokenizer),
               "--name", "tiny")[0] == 0
    assert cli("tenant", "create", "acme")[0] == 0
    code, out = cli("tenant", "policy", "acme", "--max-adapters", "5", "--max-replicas", "0")
    assert code != 0 and "max_replicas must be a positive integer" in str(out)
    code, out = cli("tenant", "policy", "acme", "--max-adapters", "5", "--max-replicas", "2")
    assert code == 0 and out["max_adapters"] == 5  # type: ignore[index]
    assert out["max_replicas"] == 2  # type: ignore[index]
    code, out = cli("adapter", "register", str(artifacts.adapters["alpha"]), "--tenant", "acme",
                    "--alias", "chat", "--training-data-version", "td-1")
    assert code == 0, out
    d1 = out["digest"]  # type: ignore[index]
    report = tmp_path / "eval.json"
    report.write_text(json.dumps(EVAL))
    assert cli("adapter", "promote", d1)[1]["state"] == "candidate"  # type: ignore[index]
    code, out = cli("adapter", "promote", d1)
    assert code != 0 and "evaluation" in out["error"]  # type: ignore[index]
    assert cli("adapter", "evaluate", d1, str(report), "--external")[0] == 0
    assert cli("adapter", "promote", d1)[1]["state"] == "canary"  # type: ignore[index]
    assert cli("adapter", "promote", d1)[1]["state"] == "stable"  # type: ignore[index]
    code, out = cli("adapter", "register", str(artifacts.adapters["by-name"]), "--tenant",
                    "acme", "--alias", "chat")
    d2 = out["digest"]  # type: ignore[index]
    code, out = cli("adapter", "release", d2, "--evaluation", str(report), "--external")
    # not the alias's first release: stable needs a rollout or a break-glass, and the walk is
    # one transaction, so the refusal leaves d2 where it was
    assert code != 0 and "completed rollout" in out["error"], out  # type: ignore[index]
    code, out = cli("adapter", "release", d2, "--evaluation", str(report), "--external",
                    "--to", "canary")
    assert code == 0 and out["state"] == "canary", out  # type: ignore[index]
    code, out = cli("adapter", "break-glass", d2, "--to", "stable")
    assert code != 0  # the reason is required
    code, out = cli("adapter", "break-glass", d2, "--to", "stable", "--reason", "  ")
    assert code != 0 and "reason" in out["error"], out  # type: ignore[index]
    code, out = cli("adapter", "break-glass", d2, "--to", "stable", "--reason", "hotfix")
    assert code == 0 and out["state"] == "stable", out  # type: ignore[index]
    code, shown = cli("alias", "show", "chat")
    assert len(shown["history"]) == 1  # type: ignore[index]
    code, out = cli("alias", "rollback", "chat")
    assert code == 0 and out["release"] == shown["history"][0]  # type: ignore[index]
    code, out = cli("release", "show", out["release"])  # type: ignore[index]
    assert code == 0 and out["adapter_digest"] == d1  # type: ignore[index]
    code, out = cli("adapter", "revoke", d2, "--reason", "x")
    code, out = cli("adapter", "serving-step", d2, "--host", "h1", "--step", "drained")
    assert code == 0
    code, out = cli("adapter", "show", d2)
    assert out["serving_steps"] == {"h1": ["drained"]}  # type: ignore[index]
    assert cli("audit", "checkpoint")[0] == 0
    code, out = cli("audit", "verify")
    assert code == 0 and out["ok"] and out["sealed_events"] == out["events"], out  # type: ignore[index]
    code, out = cli("audit", "log", "--as-of", "2000-01-01T00:00:00")
    assert code == 0 and out["adapters"] == []  # type: ignore[index]
    export = tmp_path / "history.jsonl"
    assert cli("audit", "export", "--out", str(export))[0] == 0
    lines = [json.loads(x) for x in export.read_text().splitlines()]
    assert lines and all(len(x["event_hash"]) == 64 for x in lines)
    code, out = cli("incident", "requests", "--training-data-version", "td-1")
    assert code == 0 and out == []
