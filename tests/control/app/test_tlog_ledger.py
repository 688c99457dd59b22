"""The hosts' ledger logs end to end: the recorder appends final rows to its host's Merkle log in
the write transaction and signs checkpoints; the control plane records the host keys and
verifies each checkpoint as an event; ``audit verify --ledger`` locates each kind of tampering
made through SQL by host and position; receipts verify offline and fail naming the check. On
SQLite and on PostgreSQL (marker ``postgres``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection
from typer.testing import CliRunner

from backend.serving.recorder import LedgerWriter
from control.app.ledger_audit import (
    Finding,
    coverage,
    keep_verifying,
    load,
    receipt,
    sync,
    verify,
)
from control.cli.main import app
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Completion, Ledger, LedgerEntry, Outcome, request_ledger
from control.contracts.ledger_log import (
    LEDGER_LOG,
    HostLog,
    leaf,
    leaf_doc,
    leaf_text,
    ledger_checkpoints,
    ledger_log,
    ledger_verified,
    opened,
    output_sha256,
    publish_verified,
)
from control.contracts.receipt import trusted_keys, verify_receipt
from control.contracts.schema import SchemaOutdated, upgrade
from control.contracts.tlog import ProofError, TlogProof
from tests.fixtures_control import OnPostgres, OnSQLite, close_registry

D = "sha256:" + "a" * 64
BASE = "sha256:" + "b" * 64
TOK = "sha256:" + "c" * 64
LEDGER_COLUMNS = [c.name for c in request_ledger.columns]


def serve(settings: Settings, host: str, n: int, start: int = 0) -> list[str]:
    """``n`` requests through a recorder with ``host``'s log (every fifth refused); the writer
    closes, signing its checkpoint. Returns the request ids in order."""
    ledger = Ledger(make_engine(settings.db_url))
    writer = LedgerWriter(ledger, host=host, checkpoint_s=3600)
    done = threading.Semaphore(0)
    ids = []
    for i in range(start, start + n):
        rid = f"{host}-{i:04d}"
        ids.append(rid)
        entry = LedgerEntry(rid, f"ticket-{i}", "acme", "lora_llm", host, BASE, D, TOK,
                            admitted_at=1000.0 + i, max_tokens=8, temperature=0.0, top_p=1.0)
        if i % 5 == 4:
            writer.insert(replace(entry, outcome=Outcome.REJECTED, reason="revoked",
                                  finished_at=1000.5 + i), lambda _ok: done.release())
            continue
        ledger.admit([entry])
        writer.complete(Completion(rid, Outcome.OK, 3, 7, served_digest=D),
                        lambda _ok: done.release(), output=f"answer {i}")
    for _ in ids:
        assert done.acquire(timeout=30)
    writer.close()
    return ids


class LedgerLogContract:
    @pytest.fixture
    def reg(self, settings: Settings) -> Iterator[Any]:
        from projections.follower import open_registry

        r = open_registry(settings)
        yield r
        close_registry(r)

    def sql(self, settings: Settings, statement: str, **params: Any) -> None:
        with make_engine(settings.db_url).begin() as conn:
            conn.execute(sa.text(statement), params)

    def test_rows_enter_their_hosts_log_and_checkpoints_verify(self, settings: Settings,
                                                               reg: Any) -> None:
        ids = serve(settings, "host-a", 12)
        serve(settings, "host-b", 3)
        engine = make_engine(settings.db_url)
        report = sync(reg, engine)
        assert (report.keys_recorded, sorted(report.verified), report.refused) == (
            2, [("host-a", 12), ("host-b", 3)], [])
        with engine.connect() as conn:
            logged = conn.execute(sa.select(ledger_log.c.idx, ledger_log.c.request_id,
                                            ledger_log.c.leaf)
                                  .where(ledger_log.c.host == "host-a")
                                  .order_by(ledger_log.c.idx)).all()
        assert sorted(r.request_id for r in logged) == ids
        leaf = json.loads(next(r.leaf for r in logged if r.request_id == ids[0]))
        assert (leaf["tenant"], leaf["ticket_id"], leaf["served_digest"], leaf["base_digest"],
                leaf["tokenizer_digest"], leaf["temperature"], leaf["output_sha256"]) == (
            "acme", "ticket-0", D, BASE, TOK, 0.0, output_sha256("answer 0"))
        assert json.loads(next(r.leaf for r in logged if r.request_id == ids[4]))[
            "output_sha256"] is None  # a refusal has no output
        agg = load(reg, "host-a")
        assert agg is not None and agg.verified_size == 12
        assert verify(reg, engine).ok
        # Verified once: a second sync records nothing more.
        assert sync(reg, engine).verified == []

    def test_each_kind_of_tampering_is_located_by_host_and_position(
            self, settings: Settings, reg: Any) -> None:
        serve(settings, "host-a", 10)
        serve(settings, "host-b", 4)
        engine = make_engine(settings.db_url)
        sync(reg, engine)
        with engine.connect() as conn:
            at = dict(conn.execute(sa.select(ledger_log.c.request_id, ledger_log.c.idx)
                                   .where(ledger_log.c.host == "host-a")).all())
        self.sql(settings, "UPDATE request_ledger SET tokens_out = 99 WHERE request_id = :r",
                 r="host-a-0002")
        self.sql(settings, "DELETE FROM request_ledger WHERE request_id = :r", r="host-a-0005")
        self.sql(settings, "INSERT INTO request_ledger (request_id, model, host, admitted_at, "
                 "finished_at, outcome, tenant) VALUES ('forged-1', 'lora_llm', 'host-a', "
                 "1003.2, 1003.3, 'ok', 'acme')")
        for a, b in ((7, -1), (8, 7), (-1, 8)):  # swap positions 7 and 8
            self.sql(settings, "UPDATE ledger_log SET idx = :b WHERE host = 'host-a' AND "
                     "idx = :a", a=a, b=b)
        findings = verify(reg, engine).findings
        kinds = {(f.kind, f.host, f.position) for f in findings}
        assert ("modified", "host-a", at["host-a-0002"]) in kinds
        assert ("deleted", "host-a", at["host-a-0005"]) in kinds
        assert ("reordered", "host-a", 7) in kinds and ("reordered", "host-a", 8) in kinds
        inserted = [f for f in findings if f.kind == "inserted"]
        assert [(f.host, "forged-1" in f.detail) for f in inserted] == [("host-a", True)]
        # The swap changed the tree the verified checkpoint signed: named by its range.
        assert ("root", "host-a", 0) in kinds
        assert not [f for f in findings if f.host == "host-b"]  # the other host's log is intact
        modified = next(f for f in findings if f.kind == "modified")
        assert "tokens_out" in modified.detail

    def test_a_log_changed_before_its_checkpoint_is_verified_is_refused(
            self, settings: Settings, reg: Any) -> None:
        ids = serve(settings, "host-a", 6)
        engine = make_engine(settings.db_url)
        # Both the row and its entry, consistently: only the host's signed root tells.
        self.sql(settings, "UPDATE ledger_log SET leaf = REPLACE(leaf, :a, :b) "
                 "WHERE request_id = 'host-a-0001'", a='"tokens_out":7', b='"tokens_out":70')
        report = sync(reg, engine)
        assert report.verified == [] and [(h, s) for h, s, _ in report.refused] == [
            ("host-a", 6)]
        assert "consistency" in report.refused[0][2]
        findings = verify(reg, engine).findings
        assert Finding("refused", "host-a", 6, report.refused[0][2]) in findings
        cover = coverage(reg, engine, ids)
        assert cover.covered == 0 and "host-a" in cover.failed_hosts
        assert any("host host-a's log failed verification" in g for g in cover.gaps())

    def test_incident_coverage_names_rows_past_the_last_checkpoint(
            self, settings: Settings, reg: Any) -> None:
        first = serve(settings, "host-a", 5)
        engine = make_engine(settings.db_url)
        sync(reg, engine)
        later = serve(settings, "host-a", 3, start=5)
        with engine.begin() as conn:  # the later checkpoint is not verified yet
            conn.execute(ledger_checkpoints.delete().where(ledger_checkpoints.c.size == 8))
        cover = coverage(reg, engine, [*first, *later, "never-logged"])
        assert (cover.covered, cover.past_checkpoint, cover.unlogged) == (5, {"host-a": 3}, 1)
        assert cover.gaps()[0] == "3 rows past host host-a's last verified checkpoint"
        assert cover.status[later[0]] == "past checkpoint" and cover.status[first[0]] == (
            "covered")

    def test_receipts_verify_offline_and_each_tampered_one_fails_naming_its_check(
            self, settings: Settings, reg: Any, tmp_path: Path) -> None:
        serve(settings, "host-a", 6)
        engine = make_engine(settings.db_url)
        sync(reg, engine)
        serve(settings, "host-a", 5, start=6)  # a second checkpoint, by a new key
        serve(settings, "host-b", 2)
        sync(reg, engine)
        text = receipt(reg, engine, "host-a-0002")
        agg = load(reg, "host-a")
        assert agg is not None and [s for s, _ in agg.verified] == [6, 11]
        keys = "".join(k + "\n" for k in agg.vkeys)
        trusted = trusted_keys(keys)
        ok = verify_receipt(text, b"answer 2", trusted)
        assert (ok.entry["request_id"], ok.index, ok.tree_size) == ("host-a-0002",
                                                                   ok.entry["index"], 6)

        def check(bad: str, output: bytes = b"answer 2", keys_: str = keys) -> str:
            with pytest.raises(ProofError) as e:
                verify_receipt(bad, output, trusted_keys(keys_))
            return e.value.check

        assert check(text, b"answer 2!") == "output"
        proof = TlogProof.parse(text)
        assert proof.extra is not None
        forged = proof.extra.replace(D.encode(), ("sha256:" + "e" * 64).encode())
        assert check(replace(proof, extra=forged).text()) == "inclusion"
        assert check(replace(proof, checkpoint=agg.notes[11]).text()) == "inclusion"
        other = load(reg, "host-b")
        assert other is not None
        assert check(text, keys_="".join(k + "\n" for k in other.vkeys)) == "unknown key"

        # The same, through the CLI: exit 1 naming the check; exit 0 when it holds.
        files = {"receipt": text, "bad": replace(proof, checkpoint=agg.notes[11]).text(),
                 "out": "answer 2", "changed": "answer 3", "keys": keys}
        for name, body in files.items():
            (tmp_path / name).write_text(body)

        def cli(*args: str) -> Any:
            return CliRunner().invoke(app, ["receipt", "verify", *args,
                                            "--keys", str(tmp_path / "keys")])

        good = cli(str(tmp_path / "receipt"), "--output", str(tmp_path / "out"))
        assert good.exit_code == 0 and "receipt verified" in good.output
        changed = cli(str(tmp_path / "receipt"), "--output", str(tmp_path / "changed"))
        assert changed.exit_code == 1 and "check 'output'" in changed.output
        moved = cli(str(tmp_path / "bad"), "--output", str(tmp_path / "out"))
        assert moved.exit_code == 1 and "check 'inclusion'" in moved.output

    def test_cli_fetches_a_receipt_and_audit_verify_ledger_fails_on_tampering(
            self, settings: Settings, reg: Any, tmp_path: Path) -> None:
        serve(settings, "host-a", 5)
        env = {"LORAPLANE_DB_URL": settings.db_url}
        home = ["--home", str(settings.home)]
        runner = CliRunner()
        got = runner.invoke(app, [*home, "receipt", "get", "host-a-0001", "--out",
                                  str(tmp_path / "r.tlog-proof")], env=env)
        assert got.exit_code == 0, got.output
        keys = runner.invoke(app, [*home, "receipt", "keys", "--out", str(tmp_path / "k")],
                             env=env)
        assert keys.exit_code == 0, keys.output
        (tmp_path / "o").write_text("answer 1")
        ok = runner.invoke(app, ["receipt", "verify", str(tmp_path / "r.tlog-proof"),
                                 "--output", str(tmp_path / "o"), "--keys", str(tmp_path / "k")])
        assert ok.exit_code == 0, ok.output
        intact = runner.invoke(app, [*home, "--json", "audit", "verify", "--ledger"], env=env)
        assert intact.exit_code == 0, intact.output
        assert json.loads(intact.output)["ledger"]["verified"] == 5
        self.sql(settings, "DELETE FROM request_ledger WHERE request_id = 'host-a-0003'")
        tampered = runner.invoke(app, [*home, "--json", "audit", "verify", "--ledger"], env=env)
        assert tampered.exit_code == 1
        found = json.loads(tampered.output)["ledger"]["findings"]
        assert [(f["kind"], f["host"]) for f in found] == [("deleted", "host-a")]


    def test_a_write_retried_after_its_commit_appends_nothing_twice(
            self, settings: Settings) -> None:
        ledger = Ledger(make_engine(settings.db_url))
        host_log = HostLog(ledger.engine, "host-a")
        entry = LedgerEntry("r-1", None, None, "lora_llm", "host-a", BASE, None, None, 1.0,
                            finished_at=1.0, outcome=Outcome.REJECTED, reason="busy")
        for _ in range(2):  # Ledger.write is idempotent: so is the log's append
            ledger.write([entry], [], None, lambda conn: host_log.committed(
                host_log.append(conn, ["r-1"], {})))
        with ledger.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(ledger_log)).scalar() == 1
        assert host_log.frontier.size == 1

    def test_an_entry_re_encoded_with_its_row_s_values_is_found_modified(
            self, settings: Settings, reg: Any) -> None:
        # Every value still equals the row's; only the entry's bytes differ from the leaf the
        # writer makes of that row (one leaf function for writer and auditor).
        serve(settings, "host-a", 3)
        engine = make_engine(settings.db_url)
        sync(reg, engine)
        self.sql(settings, "UPDATE ledger_log SET leaf = :head || substr(leaf, 2) "
                 "WHERE host = 'host-a' AND idx = 1", head='{"x":1,')
        kinds = {(f.kind, f.position) for f in verify(reg, engine).findings}
        assert ("modified", 1) in kinds

    def test_two_writers_of_one_host_never_share_a_position(self, settings: Settings) -> None:
        ledger = Ledger(make_engine(settings.db_url))
        first, second = HostLog(ledger.engine, "host-a"), HostLog(ledger.engine, "host-a")
        for n, writer in enumerate([first, second, first, first, second]):
            ids = [f"r-{n}-{k}" for k in range(3)]
            entries = [LedgerEntry(i, None, None, "lora_llm", "host-a", BASE, None, None, 1.0,
                                   finished_at=2.0, outcome=Outcome.REJECTED, reason="busy")
                       for i in ids]
            appended: list[tuple[int, bytes]] = []

            def hook(conn: Connection, w: HostLog = writer, i: list[str] = ids,
                     out: list[tuple[int, bytes]] = appended) -> None:
                out.extend(w.append(conn, i, {}))

            ledger.write(entries, [], None, hook)
            writer.committed(appended)
            assert [a for a, _ in appended] == list(range(3 * n, 3 * n + 3))
        first.resync()
        assert (first.frontier.size, second.frontier.size) == (15, 15)
        assert first.frontier.root() == second.frontier.root()

    def test_the_control_planes_loop_verifies_checkpoints_as_hosts_sign_them(
            self, settings: Settings, reg: Any) -> None:
        stop = threading.Event()
        loop = threading.Thread(target=keep_verifying, args=(
            reg, make_engine(settings.db_url), stop, 0.05), daemon=True)
        loop.start()
        try:
            serve(settings, "host-a", 4)
            for _ in range(200):  # bounded: 10 s
                agg = load(reg, "host-a")
                if agg is not None and agg.verified_size == 4:
                    break
                stop.wait(0.05)
            assert agg is not None and agg.verified_size == 4
        finally:
            stop.set()
            loop.join(5)


def test_the_leaf_function_writes_the_canonical_json_of_the_leaf_document() -> None:
    # The writer's fast encoder and the canonical form must agree on every kind of value a
    # row can hold (text needing escapes, None, big ints, floats json writes its own way).
    odd: list[Any] = [None, 'q"\\\n\x01\u00e9\u2028\U0001d11e', D, 0, -7, 2 ** 70, 1.5, 1e16, 1e-7,
                      0.1 + 0.2, -0.0, float("nan"), float("-inf"), True]
    for k in range(len(odd) * 3):
        row = {c: odd[(k + n) % len(odd)] for n, c in enumerate(LEDGER_COLUMNS)}
        for out in (None, "f" * 64):
            assert leaf(row, k, out) == leaf_text(leaf_doc(row, k, out))


class TestLedgerLogSQLite(OnSQLite, LedgerLogContract):
    pass


class TestLedgerLogPostgres(OnPostgres, LedgerLogContract):
    pass


def test_a_version_1_log_is_refused_until_upgraded_then_holds_verified_checkpoints(
        tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'v1.db'}")
    opened(engine)
    with engine.begin() as conn:  # the log as version 1 left it: no verified read model
        ledger_verified.drop(conn)
        conn.execute(sa.text("UPDATE loraplane_schema SET version = 1 "
                             "WHERE component = 'ledger_log'"))
    with pytest.raises(SchemaOutdated):
        opened(engine)
    changes = {c.component: c.action
               for c in upgrade(engine, rebuild=None, components=(LEDGER_LOG,))}
    assert changes == {"ledger_log": "upgraded"}
    with opened(engine).begin() as conn:
        assert publish_verified(conn, "h", [(3, "cm9vdA==", "note")]) == 1
        assert publish_verified(conn, "h", [(3, "cm9vdA==", "note")]) == 0


def test_the_log_reads_the_rows_once_with_the_ledger_s_own_check(tmp_path: Path) -> None:
    """A logged completion costs the ledger's transaction two statements more than a plain one
    (move the head, insert the leaf): the rows the log hashes are the ones the ledger's check
    read back, not read a second time (before: three more, ``loraplane bench ledger``)."""
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger = Ledger(engine)

    def statements(host: str | None, rid: str) -> int:
        ledger.admit([LedgerEntry(rid, "t", "tenant", "lora_llm", host or "plain", BASE, D, D,
                                  admitted_at=1.0)])
        writer = LedgerWriter(ledger, host=host)
        seen: list[str] = []
        done = threading.Event()
        listen = lambda *a: seen.append(a[2])  # noqa: E731 (conn, cursor, statement, ...)
        sa.event.listen(engine, "before_cursor_execute", listen)
        try:
            writer.complete(Completion(rid, Outcome.OK, 3, 4, served_digest=D),
                            lambda _ok: done.set(), output="answer")
            assert done.wait(30)
        finally:
            sa.event.remove(engine, "before_cursor_execute", listen)
            writer.close()
        assert ledger.get(rid) is not None and ledger.get(rid).outcome == "ok"  # type: ignore[union-attr]
        return len(seen)

    plain, logged = statements(None, "r-plain"), statements("host-a", "r-logged")
    assert logged - plain == 2, (plain, logged)
    with engine.connect() as conn:
        assert conn.execute(sa.select(ledger_log.c.request_id)).scalars().all() == ["r-logged"]
