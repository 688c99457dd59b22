"""Unit tests: JSON logs, tracing configuration, backend metric accounting from the ledger,
per-digest stats scoping and the chat template. No Triton, SQLite in a temp folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from backend.triton.metrics import MAX_REASONS, BackendMetrics
from control.contracts.db import make_engine
from control.contracts.ledger import AdapterLoad, Completion, Ledger, LedgerEntry
from control.contracts.telemetry import JsonFormatter, configure_logging, parent_context, tracer
from control.contracts.wire import MODEL
from control.gateway.observability import digest_stats, is_admin, stats_body
from control.gateway.openai_request import ApiError, render_chat

A = "sha256:" + "a" * 64
B = "sha256:" + "b" * 64


def _entry(rid: str, tenant: str | None, adapter: str | None, outcome: str = "running",
           reason: str | None = None) -> LedgerEntry:
    return LedgerEntry(request_id=rid, ticket_id=None, tenant=tenant, model=MODEL,
                       host="h1", base_digest=None, adapter_digest=adapter,
                       tokenizer_digest=None, admitted_at=100.0, outcome=outcome, reason=reason)


@pytest.fixture()
def ledger(tmp_path: Path) -> Ledger:
    led = Ledger(make_engine(f"sqlite:///{tmp_path / 'l.db'}"))
    led.admit([_entry("r1", "acme", A), _entry("r2", "acme", A), _entry("r3", "globex", B),
               _entry("r4", None, None, "rejected", "signature"),
               _entry("r5", "acme", A, "rejected", "revoked")])
    led.complete([Completion("r1", "ok", 5, 7), Completion("r2", "ok", 3, 2),
                  Completion("r3", "ok", 4, 4)], now=100.5)
    _own(led, {A: "acme", B: "globex"})
    return led


def _own(led: Ledger, owners: dict[str, str]) -> None:
    """The adapters' projection rows: who owns which digest."""
    import datetime as dt

    from projections.tables import adapters, create_tables

    create_tables(led.engine)
    with led.engine.begin() as conn:
        for digest, tenant in owners.items():
            conn.execute(adapters.insert().values(
                digest=digest, tenant=tenant, alias=f"{tenant}-x", base_digest=A,
                tokenizer_digest=A, state="stable", rank=8, registered_at=dt.datetime.now(dt.UTC),
                owner="", training_data_version="", licence="", allowed_tasks=""))


def test_json_log_lines_carry_extra_fields() -> None:
    rec = logging.makeLogRecord({"msg": "ticket refused %s", "args": ("x",), "levelname": "INFO",
                                 "name": "loraplane.gateway", "tenant": "acme"})
    line = json.loads(JsonFormatter().format(rec))
    assert line["msg"] == "ticket refused x" and line["tenant"] == "acme"
    assert line["level"] == "info" and line["logger"] == "loraplane.gateway"
    with pytest.raises(ValueError, match="json or text"):
        configure_logging("xml")


def test_tracing_is_off_by_default_and_specs_are_checked(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.delenv("LORAPLANE_TRACES", raising=False)
    assert type(tracer("t")).__name__ == "NoOpTracer"
    with pytest.raises(ValueError, match="off, console, otlp or file"):
        tracer("t", "zipkin")
    assert parent_context(None) is None


def test_backend_metrics_from_ledger_rows(ledger: Ledger) -> None:
    ledger.record_load(AdapterLoad("h1", A, 99.0, 0.1, "loaded", 1000))
    ledger.record_load(AdapterLoad("h1", B, 99.0, 0.1, "failed", reason="DigestMismatch"))
    ledger.record_load(AdapterLoad("other-host", B, 99.0, 0.1, "loaded", 10))
    m = BackendMetrics(None, ledger.engine, "h1")
    m._last_load_id = 0  # count the loads recorded above
    m.account(["r1", "r2", "r4", "r5"])
    assert m.value("loraplane_backend_requests_total", outcome="ok") == 2
    assert m.value("loraplane_backend_requests_total", outcome="rejected") == 2
    assert m.value("loraplane_backend_refusals_total", reason="signature") == 1
    assert m.value("loraplane_backend_refusals_total", reason="revoked") == 1
    assert m.value("loraplane_backend_tokens_total", kind="prompt") == 8
    assert m.value("loraplane_backend_tokens_total", kind="completion") == 9
    assert m.value("loraplane_backend_request_seconds_count") == 2
    assert m.value("loraplane_backend_request_seconds_sum") == pytest.approx(1.0)
    # one load of A (the miss of the first request), the second request a hit; B's failed
    # load counts, another host's load does not
    assert m.value("loraplane_backend_adapter_cache_total", event="miss",
                   reason="not_resident") == 1
    assert m.value("loraplane_backend_adapter_cache_total", event="hit", reason="resident") == 1
    assert m.value("loraplane_backend_adapter_cache_total", event="load_failure",
                   reason="digestmismatch") == 1  # exception names, lower-cased
    labels = {dict(k[1]).get("reason") for k in m.values} - {None}
    assert not any(d in str(labels) for d in (A, B, "acme", "globex"))


def test_reason_labels_are_bounded(ledger: Ledger) -> None:
    m = BackendMetrics(None, ledger.engine, "h1")
    got = {m._reason(f"reason_{i}") for i in range(MAX_REASONS * 3)}
    assert len(got) == MAX_REASONS + 1 and "other" in got
    assert m._reason("sha256:" + "a" * 64) == "other"


def test_digest_stats_scoped_to_the_tenant(ledger: Ledger) -> None:
    acme = digest_stats(ledger.engine, "acme")
    assert [(r.adapter_digest, r.requests, r.ok, r.rejected, r.tokens_out) for r in acme] == [
        (A, 3, 2, 1, 9)]
    assert all(r.tenant is None for r in acme)
    assert "globex" not in json.dumps(stats_body(acme, operator=False))
    everyone = digest_stats(ledger.engine, None)
    assert {(r.tenant, r.adapter_digest) for r in everyone} == {("acme", A), ("globex", B)}
    assert digest_stats(ledger.engine, "nobody") == []
    # The operator's CLI view counts refusals that no verified ticket names on their own line.
    with_unattributed = digest_stats(ledger.engine, None, unattributed=True)
    [alone] = [r for r in with_unattributed if r.tenant is None]
    assert (alone.adapter_digest, alone.requests, alone.rejected) == (None, 1, 1)
    assert sum(r.rejected for r in with_unattributed) == 2  # every rejected row of the ledger


def test_a_granted_tenants_stats_never_name_the_owners_adapter(ledger: Ledger) -> None:
    """Issue 21: acme sent requests on globex's adapter B (an alias globex granted it), on two
    arms of globex's rollout (B, then C). Acme's own view counts them under one "granted"
    entry; neither digest appears. The operator's view still names them."""
    c = "sha256:" + "c" * 64
    _own(ledger, {c: "globex"})
    ledger.admit([_entry("g1", "acme", B), _entry("g2", "acme", c), _entry("g3", "acme", None)])
    ledger.complete([Completion("g1", "ok", 1, 1), Completion("g2", "ok", 1, 1),
                     Completion("g3", "ok", 1, 1)], now=100.5)
    acme = digest_stats(ledger.engine, "acme")
    assert {(r.adapter_digest, r.requests) for r in acme} == {(A, 3), ("granted", 2), (None, 1)}
    body = json.dumps(stats_body(acme, operator=False))
    assert B not in body and c not in body and "globex" not in body
    everyone = digest_stats(ledger.engine, None)
    assert {(r.tenant, r.adapter_digest) for r in everyone} >= {("acme", B), ("acme", c)}


def test_stats_cli_counts_every_refusal_and_fits_80_columns(ledger: Ledger,
                                                           tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from control.cli.main import app

    url = str(ledger.engine.url)
    res = CliRunner().invoke(app, ["--home", str(tmp_path / "h"), "stats"],
                             env={"LORAPLANE_DB_URL": url, "COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    assert "(unverified)" in res.stdout and "…" not in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 80


def test_admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LORAPLANE_ADMIN_TOKEN", raising=False)
    assert not is_admin("")
    assert not is_admin("anything")
    monkeypatch.setenv("LORAPLANE_ADMIN_TOKEN", "s3cret")
    assert is_admin("s3cret") and not is_admin("s3cre")


def test_chat_template() -> None:
    assert render_chat([{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]) == (
        "system: Be brief.\nuser: Hi\nassistant:")
    for bad in ([], "hi", [{"role": "tool", "content": "x"}], [{"role": "user", "content": 3}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]):
        with pytest.raises(ApiError):
            render_chat(bad)


def test_audit_and_incident_tables_fit_80_columns_without_splitting_values(
        ledger: Ledger) -> None:
    from rich.console import Console

    from control.app.audit import AuditEntry
    from control.tools.views import audit_table, incident_table

    digest = "sha256:" + "c" * 64
    entry = AuditEntry(position=12, time="2026-12-01T06:41:45.424000+00:00",
                       actor="demo-operator", aggregate="Release",
                       event_type="ReleaseCreated", aggregate_id="x",
                       summary={"digest": digest, "tokenizer_digest": digest,
                                "reason": "demo: suspected data leak"})
    console = Console(width=80, record=True)
    console.print(audit_table([entry]))
    console.print(incident_table(ledger.query(), digest))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any("tokenizer=" in line for line in lines)  # one pair per line, key shortened
    assert not any(line.rstrip(" │").endswith(("cccc", "ccc…")) and "=" not in line
                   for line in lines)  # no value continued on the next line
    assert any(digest in line for line in lines)  # the incident title names it in full
