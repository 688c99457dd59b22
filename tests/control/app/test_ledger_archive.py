"""Ledger retention (issue 24): ``loraplane audit archive`` exports the finished rows admitted
before a cut-off with their log entries, records ``LedgerArchive.LedgerArchived`` before it
deletes them, and the audit story still holds: ``audit verify --ledger`` counts archived rows
apart yet still reports a row deleted without an archive, the archive file verifies against its
event and the hosts' logs (a tampered one does not), receipts of archived requests still verify,
and incident queries name the archive. On SQLite and on PostgreSQL (marker ``postgres``).

Before: there was no way to shed old ledger rows; deleting them made ``audit verify`` report
every one as deleted."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from backend.serving.recorder import LedgerWriter
from control.app import ledger_archive
from control.app.ledger_archive import (
    ArchiveError,
    archive,
    archives_overlapping,
    record,
    verify_archive,
)
from control.app.ledger_audit import load, receipt, sync, verify
from control.cli.main import app
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Completion, Ledger, LedgerEntry, Outcome, request_ledger
from control.contracts.ledger_log import ledger_log
from control.contracts.receipt import trusted_keys, verify_receipt
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, close_registry

D = "sha256:" + "a" * 64
BASE = "sha256:" + "b" * 64
TOK = "sha256:" + "c" * 64
CUT = 1006.0  # rows i < 6 of each host are admitted before it (admitted_at = 1000 + i)


def serve(settings: Settings, host: str, n: int, base: str = BASE) -> list[str]:
    """``n`` requests through a recorder keeping ``host``'s log (every fifth refused), admitted
    at 1000 + i; the writer closes, signing its checkpoint. Returns the request ids."""
    ledger = Ledger(make_engine(settings.db_url))
    writer = LedgerWriter(ledger, host=host, checkpoint_s=3600)
    done = threading.Semaphore(0)
    ids = []
    for i in range(n):
        rid = f"{host}-{i:04d}"
        ids.append(rid)
        entry = LedgerEntry(rid, f"ticket-{i}", "acme", "lora_llm", host, base, D, TOK,
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


def rows(settings: Settings) -> dict[str, dict[str, Any]]:
    with make_engine(settings.db_url).connect() as conn:
        return {r.request_id: dict(r._mapping) for r in conn.execute(sa.select(request_ledger))}


class ArchiveContract:
    @pytest.fixture
    def reg(self, settings: Settings) -> Iterator[Any]:
        from projections.follower import open_registry

        r = open_registry(settings)
        yield r
        close_registry(r)

    @pytest.fixture
    def served(self, settings: Settings, reg: Any) -> sa.Engine:
        serve(settings, "host-a", 10)
        serve(settings, "host-b", 4)
        engine = make_engine(settings.db_url)
        sync(reg, engine)
        return engine

    def sql(self, engine: sa.Engine, statement: str, **params: Any) -> None:
        with engine.begin() as conn:
            conn.execute(sa.text(statement), params)

    def test_archive_then_verify_passes_and_later_rows_are_untouched(
            self, settings: Settings, reg: Any, served: sa.Engine, tmp_path: Path) -> None:
        before = rows(settings)
        # Log positions follow completion order, which the writer does not tie to the request
        # number (a refused row's insert may land after a later request's completion): read
        # each archived request's position from the hosts' logs before archiving.
        with served.connect() as conn:
            logged = {(r.host, r.request_id): int(r.idx) for r in conn.execute(
                sa.select(ledger_log.c.host, ledger_log.c.request_id, ledger_log.c.idx))}
        wanted = [("host-a", f"host-a-{i:04d}") for i in range(6)] + [
            ("host-b", f"host-b-{i:04d}") for i in range(4)]
        positions = sorted((h, logged[(h, rid)]) for h, rid in wanted)
        out = tmp_path / "ledger-1970.jsonl"
        r = archive(reg, served, CUT, out, actor="olga")
        assert (r.rows, r.deleted) == (10, 10)  # host-a 0..5, host-b 0..3
        assert {h: (d["rows"], d["logged"]) for h, d in r.hosts.items()} == {
            "host-a": (6, 6), "host-b": (4, 4)}
        after = rows(settings)
        assert sorted(after) == [f"host-a-{i:04d}" for i in range(6, 10)]
        assert all(after[k] == before[k] for k in after)  # the rows after the cut-off: as they were
        lines = out.read_bytes().splitlines()
        assert len(lines) == 11 and json.loads(lines[0])["before"] == CUT
        docs = [json.loads(x) for x in lines[1:]]  # by host, then log position
        assert [(d["host"], d["index"]) for d in docs] == positions
        assert sorted(d["row"]["request_id"] for d in docs) == [
            *(f"host-a-{i:04d}" for i in range(6)), *(f"host-b-{i:04d}" for i in range(4))]
        report = verify(reg, served)
        assert report.ok, report.findings
        assert (report.archived, report.entries) == (10, 14)
        agg = record(reg)
        assert agg is not None and agg.pending == []
        event = agg.archives[r.sha256 or ""]
        assert (event["rows"], event["actor"], event["hosts"]["host-a"]["first"],
                event["hosts"]["host-a"]["last"]) == (
                    10, "olga", min(i for h, i in positions if h == "host-a"),
                    max(i for h, i in positions if h == "host-a"))
        # The log entries stay: an archived request's receipt still verifies offline.
        text = receipt(reg, served, "host-a-0002")
        host_a = load(reg, "host-a")
        assert host_a is not None
        ok = verify_receipt(text, b"answer 2", trusted_keys("".join(
            k + "\n" for k in host_a.vkeys)))
        assert ok.entry["request_id"] == "host-a-0002"

    def test_a_row_deleted_without_an_archive_is_still_reported(
            self, settings: Settings, reg: Any, served: sa.Engine, tmp_path: Path) -> None:
        # Before any archive, and after one: a row past the cut-off, and a row before it that
        # was running when the archive ran (so no archive took it), are each named deleted.
        ledger = Ledger(served)
        ledger.admit([LedgerEntry("late", None, "acme", "lora_llm", "host-a", BASE, D, TOK,
                                  admitted_at=1001.5)])
        archive(reg, served, CUT, tmp_path / "a.jsonl")
        assert "late" in rows(settings)  # running: never archived
        writer = LedgerWriter(ledger, host="host-a", checkpoint_s=3600)
        done = threading.Event()
        writer.complete(Completion("late", Outcome.OK, 1, 1, served_digest=D),
                        lambda _ok: done.set(), output="late answer")
        assert done.wait(30)
        writer.close()
        sync(reg, served)
        assert verify(reg, served).ok
        self.sql(served, "DELETE FROM request_ledger WHERE request_id IN ('late', "
                 "'host-a-0008')")
        with served.connect() as conn:
            at = dict(conn.execute(sa.select(ledger_log.c.request_id, ledger_log.c.idx).where(
                ledger_log.c.request_id.in_(["late", "host-a-0008"]))).all())
        report = verify(reg, served)
        assert sorted((f.kind, f.host, f.position) for f in report.findings) == sorted(
            ("deleted", "host-a", at[k]) for k in ("late", "host-a-0008"))
        assert report.archived == 10

    def test_the_archive_file_verifies_and_a_tampered_one_does_not(
            self, settings: Settings, reg: Any, served: sa.Engine, tmp_path: Path) -> None:
        out = tmp_path / "a.jsonl"
        r = archive(reg, served, CUT, out)
        check = verify_archive(reg, served, out)
        assert check.ok, check.problems
        assert (check.sha256, check.rows, check.covered, check.still_in_ledger) == (
            r.sha256, 10, 10, 0)
        lines = out.read_text().splitlines()

        def tampered(name: str, k: int, change: Any) -> list[str]:
            doc = json.loads(lines[k])
            change(doc)
            bad = tmp_path / name
            bad.write_text("\n".join([*lines[:k], json.dumps(doc), *lines[k + 1:]]) + "\n")
            c = verify_archive(reg, served, bad)
            assert not c.ok
            return sorted({check for check, _ in c.problems})

        # A value changed in a row: another digest, and the row no longer is its entry's.
        assert tampered("row.jsonl", 3, lambda d: d["row"].update(tokens_out=70)) == [
            "digest", "entry"]
        # Row and entry changed together: the entry is not the one the log holds.
        def both(d: dict[str, Any]) -> None:
            d["row"]["tenant"] = "globex"
            d["leaf"] = d["leaf"].replace('"tenant":"acme"', '"tenant":"globex"')

        assert tampered("both.jsonl", 3, both) == ["digest", "log"]
        # A row left out: the counts and positions differ from the event.
        short = tmp_path / "short.jsonl"
        short.write_text("\n".join(lines[:-1]) + "\n")
        assert {c for c, _ in verify_archive(reg, served, short).problems} == {"digest"}

        runner = CliRunner()
        env = {"LORAPLANE_DB_URL": settings.db_url}
        home = ["--home", str(settings.home)]
        good = runner.invoke(app, [*home, "audit", "archive-verify", str(out)], env=env)
        assert good.exit_code == 0 and "archive verified" in good.output, good.output
        bad = runner.invoke(app, [*home, "--json", "audit", "archive-verify",
                                  str(tmp_path / "row.jsonl")], env=env)
        assert bad.exit_code == 1
        assert not json.loads(bad.stdout)["ok"]

    def test_a_second_run_archives_nothing_and_says_so(
            self, settings: Settings, reg: Any, served: sa.Engine, tmp_path: Path) -> None:
        out = tmp_path / "a.jsonl"
        first = archive(reg, served, CUT, out)
        again = archive(reg, served, CUT, out)  # the same command: its file exists
        assert (again.sha256, again.rows, again.deleted, again.completed) == (None, 0, 0, [])
        assert sha(out) == first.sha256  # the archive's file left alone
        agg = record(reg)
        assert agg is not None and list(agg.archives) == [first.sha256]
        runner = CliRunner()
        got = runner.invoke(app, ["--home", str(settings.home), "audit", "archive",
                                  "--before", "1970-01-01T00:16:46", "--out", str(out)],
                            env={"LORAPLANE_DB_URL": settings.db_url})
        assert got.exit_code == 0 and "nothing to archive" in got.output, got.output

    def test_a_crash_between_the_event_and_the_delete_is_completed_by_the_next_run(
            self, settings: Settings, reg: Any, served: sa.Engine, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:
        def crash(*_a: Any) -> int:
            raise sa.exc.OperationalError("DELETE", {}, Exception("connection lost"))

        monkeypatch.setattr(ledger_archive, "_delete", crash)
        out = tmp_path / "a.jsonl"
        with pytest.raises(ArchiveError, match="recorded but deleting its rows failed"):
            archive(reg, served, CUT, out)
        assert len(rows(settings)) == 14  # the rows stay
        agg = record(reg)
        assert agg is not None and [a["sha256"] for a in agg.pending] == [sha(out)]
        assert verify(reg, served).ok  # recorded, not deleted: nothing missing either
        monkeypatch.undo()
        done = archive(reg, served, CUT, out)
        assert done.completed == [(sha(out), 10)] and done.sha256 is None
        assert len(rows(settings)) == 4
        agg = record(reg)
        assert agg is not None and agg.pending == [] and agg.deleted == {sha(out): 10}
        assert verify(reg, served).archived == 10

    def test_nothing_is_deleted_when_the_event_cannot_be_recorded(
            self, settings: Settings, reg: Any, served: sa.Engine, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(*_a: Any, **_k: Any) -> Any:
            raise sa.exc.OperationalError("INSERT", {}, Exception("event store away"))

        monkeypatch.setattr(reg, "save", refuse)
        out = tmp_path / "a.jsonl"
        with pytest.raises(ArchiveError, match="nothing was deleted"):
            archive(reg, served, CUT, out)
        assert len(rows(settings)) == 14 and not out.exists()
        monkeypatch.undo()
        assert record(reg) is None

    def test_bad_input_is_refused_clearly(self, settings: Settings, reg: Any,
                                          served: sa.Engine, tmp_path: Path) -> None:
        out = tmp_path / "a.jsonl"
        with pytest.raises(ArchiveError, match="in the future"):
            archive(reg, served, 4_000_000_000.0, out)
        with pytest.raises(ArchiveError, match="no folder"):
            archive(reg, served, CUT, tmp_path / "missing" / "a.jsonl")
        (tmp_path / "plain").write_text("x")
        with pytest.raises(ArchiveError, match="cannot write"):
            archive(reg, served, CUT, tmp_path / "plain" / "a.jsonl")
        with pytest.raises(ArchiveError, match="it is a folder"):
            archive(reg, served, CUT, tmp_path)
        out.write_text("someone's notes\n")
        with pytest.raises(ArchiveError, match="exists: choose another file"):
            archive(reg, served, CUT, out)
        assert len(rows(settings)) == 14 and record(reg) is None
        first = archive(reg, served, 1003.0, out, force=True)
        assert first.rows == 6 and sha(out) == first.sha256  # rows 0..2 of each host
        # --force never replaces a recorded archive's file.
        with pytest.raises(ArchiveError, match="is the recorded archive"):
            archive(reg, served, CUT, out, force=True)
        runner = CliRunner()
        got = runner.invoke(app, ["--home", str(settings.home), "--json", "audit", "archive",
                                  "--before", "2999-01-01T00:00:00", "--out", str(out)],
                            env={"LORAPLANE_DB_URL": settings.db_url})
        assert got.exit_code == 2 and "in the future" in json.loads(got.stdout)["error"]

    def test_one_host_alone_and_a_tampered_row_is_never_archived(
            self, settings: Settings, reg: Any, served: sa.Engine, tmp_path: Path) -> None:
        r = archive(reg, served, CUT, tmp_path / "b.jsonl", host="host-b")
        assert (r.rows, list(r.hosts)) == (4, ["host-b"])
        assert sum(k.startswith("host-a") for k in rows(settings)) == 10
        self.sql(served, "UPDATE request_ledger SET tokens_out = 99 WHERE request_id = "
                 "'host-a-0001'")
        with pytest.raises(ArchiveError, match="host-a-0001 differs from its entry"):
            archive(reg, served, CUT, tmp_path / "a.jsonl")
        assert sum(k.startswith("host-a") for k in rows(settings)) == 10
        assert not (tmp_path / "a.jsonl").exists()


class TestArchiveSQLite(OnSQLite, ArchiveContract):
    pass


class TestArchivePostgres(OnPostgres, ArchiveContract):
    pass


def sha(path: Path) -> str:
    return ledger_archive.sha256_of(path)


def test_incident_queries_name_the_archive_that_took_rows_of_their_range(
        tmp_path: Path, artifacts: Artifacts) -> None:
    from projections.follower import open_registry
    from tests.fixtures_control import sqlite_settings

    settings = sqlite_settings(tmp_path / "home")
    settings.ensure_dirs()
    reg = open_registry(settings)
    try:
        base = reg.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op")
        serve(settings, "host-a", 10, base=base)
        engine = make_engine(settings.db_url)
        sync(reg, engine)
        r = archive(reg, engine, CUT, tmp_path / "a.jsonl")
        assert [a["sha256"] for a in archives_overlapping(reg, None)] == [r.sha256]
        assert archives_overlapping(reg, CUT) == []  # a range after the cut-off: complete
    finally:
        close_registry(reg)
    runner = CliRunner()
    cli = ["--home", str(settings.home)]
    q = ["incident", "requests", "--base", base, "--include-refused"]
    human = runner.invoke(app, [*cli, *q], env={"COLUMNS": "250"})
    assert human.exit_code == 0, human.output
    assert "archived" in human.output and f"sha256:{r.sha256}" in human.output
    got = runner.invoke(app, [*cli, "--json", *q])
    assert got.exit_code == 0, got.output
    assert [x["request_id"] for x in json.loads(got.stdout)] == [
        f"host-a-{i:04d}" for i in range(6, 10)]
    note = json.loads(got.stderr)["archived"]
    assert [(a["sha256"], a["rows"]) for a in note] == [(r.sha256, 6)]
    later = runner.invoke(app, [*cli, "--json", *q, "--since", "1970-01-01T00:16:46"])
    assert later.exit_code == 0 and later.stderr == ""
