"""Host ledger checkpoint keys go through the root of trust (control.contracts.host_keys): a host
keeps one key across restarts, the control plane verifies checkpoints only with a key the root
enrolled (`loraplane host enroll`, or a development home's root), and a key presented without
enrolment, or an enrolment forged in the store, is refused by `audit ledger-sync` and reported
by `audit verify --ledger`. On SQLite and PostgreSQL (marker ``postgres``)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from control.app.ledger_audit import enroll, load, sync, verify
from control.cli.main import app
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.host_keys import key_path, sign_enrollment, vkey_path
from control.contracts.ledger_log import HostLog
from control.contracts.root_of_trust import RootError, init_root
from tests.control.app.test_tlog_ledger import serve
from tests.fixtures_control import OnPostgres, OnSQLite, close_registry


def test_a_hosts_key_is_kept_across_restarts(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    keys = tmp_path / "keys"
    first = HostLog(engine, "host-a", keys_dir=keys).signer.verifier.vkey()
    again = HostLog(engine, "host-a", keys_dir=keys).signer.verifier.vkey()
    assert first == again
    assert stat.S_IMODE(os.stat(key_path(keys, "host-a")).st_mode) == 0o600
    assert vkey_path(keys, "host-a").read_text().strip() == first  # what the operator enrols
    # A Triton process names no folder: it keeps the key in its home's (LORAPLANE_HOME).
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path))
    assert HostLog(engine, "host-a").signer.verifier.vkey() == first
    assert HostLog(engine, "host-b").signer.verifier.vkey() != first


class HostKeyContract:
    @pytest.fixture
    def reg(self, settings: Settings) -> Iterator[Any]:
        from projections.follower import open_registry

        r = open_registry(settings)
        yield r
        close_registry(r)

    @pytest.fixture
    def offline_root(self, settings: Settings, tmp_path: Path,
                     monkeypatch: pytest.MonkeyPatch) -> Path:
        """A deployment whose root key is offline, and whose host keeps its key in the home."""
        out = tmp_path / "offline" / "root.pem"
        init_root(out, settings.keys_dir)
        monkeypatch.setenv("LORAPLANE_HOME", str(settings.home))
        return out

    def test_a_development_home_enrols_presented_keys_itself(
            self, settings: Settings, reg: Any) -> None:
        serve(settings, "host-a", 3)
        report = sync(reg, make_engine(settings.db_url))
        assert (report.verified, report.refused) == ([("host-a", 3)], [])
        agg = load(reg, "host-a")
        assert agg is not None and list(agg.enrolled) == agg.vkeys

    def test_an_unenrolled_key_is_refused_until_the_root_enrols_it(
            self, settings: Settings, reg: Any, offline_root: Path) -> None:
        serve(settings, "host-a", 4)
        engine = make_engine(settings.db_url)
        env = {"LORAPLANE_DB_URL": settings.db_url}
        home = ["--home", str(settings.home)]
        runner = CliRunner()
        refused = runner.invoke(app, [*home, "--json", "audit", "ledger-sync"], env=env)
        assert refused.exit_code == 1, refused.output
        assert "unknown key" in json.loads(refused.output)["refused"][0][2]
        found = verify(reg, engine).findings
        assert sorted(f.kind for f in found) == ["refused", "unenrolled"]
        # A restarted host signs with the same key: enrolling it once is enough.
        serve(settings, "host-a", 2, start=4)
        key = vkey_path(settings.keys_dir, "host-a")
        done = runner.invoke(app, [*home, "host", "enroll", "host-a", "--key-file", str(key),
                                   "--root-key", str(offline_root)], env=env)
        assert done.exit_code == 0, done.output
        synced = runner.invoke(app, [*home, "--json", "audit", "ledger-sync"], env=env)
        assert synced.exit_code == 0, synced.output
        assert json.loads(synced.output)["verified"] == [["host-a", 4], ["host-a", 6]]
        intact = runner.invoke(app, [*home, "--json", "audit", "verify", "--ledger"], env=env)
        assert intact.exit_code == 0, intact.output  # the refusal was resolved by enrolment
        assert json.loads(intact.output)["ledger"]["verified"] == 6

    def test_a_key_presented_or_enrolled_through_the_store_alone_is_refused(
            self, settings: Settings, reg: Any, offline_root: Path, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:
        serve(settings, "host-a", 3)
        enroll(reg, "host-a", vkey_path(settings.keys_dir, "host-a"), offline_root)
        engine = make_engine(settings.db_url)
        assert sync(reg, engine).verified == [("host-a", 3)]
        # Someone with database access writes as host-a with a key of their own (presented in
        # ledger_host_keys, checkpoint signed), and an enrolment event for that key signed by a
        # root of their own: the store cannot tell, the configured root can.
        monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path / "attacker"))
        serve(settings, "host-a", 2, start=3)
        forged = vkey_path(tmp_path / "attacker" / "keys", "host-a").read_text().strip()
        agg = load(reg, "host-a")
        assert agg is not None
        agg.enroll(forged, sign_enrollment(Ed25519PrivateKey.generate(), "host-a", forged),
                   "mallory")
        reg.save(agg)
        report = sync(reg, engine)
        assert report.verified == [] and report.refused[0][:2] == ("host-a", 5)
        assert "unknown key" in report.refused[0][2]
        kinds = sorted(f.kind for f in verify(reg, engine).findings)
        assert kinds == ["refused", "unenrolled", "unvouched"]

    def test_enrolment_is_refused_for_a_wrong_root_or_another_hosts_key(
            self, settings: Settings, reg: Any, offline_root: Path, tmp_path: Path) -> None:
        serve(settings, "host-a", 1)
        key = vkey_path(settings.keys_dir, "host-a")
        other = tmp_path / "other.pem"
        init_root(other, tmp_path / "elsewhere")
        with pytest.raises(RootError, match="not the root this deployment trusts"):
            enroll(reg, "host-a", key, other)
        with pytest.raises(ValueError, match=r"not of 'loraplane\.ledger/host-b'"):
            enroll(reg, "host-b", key, offline_root)
        (tmp_path / "junk").write_text("not a key\n")
        with pytest.raises(ValueError, match="holds no host checkpoint key"):
            enroll(reg, "host-a", tmp_path / "junk", offline_root)


class TestHostKeysOnSQLite(OnSQLite, HostKeyContract):
    pass


class TestHostKeysOnPostgres(OnPostgres, HostKeyContract):
    pass
