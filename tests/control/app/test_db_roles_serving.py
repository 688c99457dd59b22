"""A Triton host's service, in-process, serving on PostgreSQL with nothing but its own role:
verified tickets answered, ledger rows (and their Merkle log) and its status report written under
its name, a revocation applied and its steps reported, which the control plane then folds into
events."""

from __future__ import annotations

import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa

from backend.serving.engine import Engine
from backend.serving.host_report import HostReporter
from backend.serving.scheduler import SchedulerLimits
from backend.serving.service import IncomingRequest, LoraService
from control.app.db_roles import RoleNames, apply_roles
from control.app.serving_steps import fold_reports
from control.contracts.db import make_engine
from control.contracts.host_status import HostStatusTable
from control.contracts.ledger import Ledger
from control.contracts.serving_reports import TableSteps
from tests.fixtures_control import postgres_settings
from tests.integration.conftest import ACTOR
from tests.serving_home import Sink, provision_home, wait_for


@pytest.mark.postgres
def test_a_host_serves_with_its_own_role(kit_dir: Path, tmp_path: Path) -> None:
    from control.cli.database import _declare_components
    from control.contracts.schema import upgrade

    suffix = uuid.uuid4().hex[:8]
    names, host = RoleNames(f"lps_{suffix}"), f"host-{suffix}"
    with postgres_settings(tmp_path) as s:
        home = provision_home(s, kit_dir)
        admin = make_engine(s.db_url)
        _declare_components()
        upgrade(admin, rebuild=None)  # every component's tables: a host creates none
        apply_roles(admin, names=names, hosts=[host])
        try:
            own = sa.make_url(s.db_url).set(username=host).render_as_string(hide_password=False)
            svc = LoraService(replace(s, db_url=own), home.base_digest, host=host,
                              engine=Engine(kit_dir / "base", kit_dir / "tokenizer",
                                            device="cpu", max_rank=s.max_rank, max_adapters=4),
                              limits=SchedulerLimits(max_running=4, max_queued=16),
                              prefix_cache_bytes=0, steps=TableSteps)
            try:
                digest = home.digests["gamma"]
                sink = Sink()
                svc.submit(IncomingRequest(b"Hi", home.ticket("globex", "globex-gamma")), sink)
                answer = sink.wait()
                assert answer.ok, answer
                row = Ledger(admin).get(answer.request_id)
                assert row is not None and (row.host, row.outcome) == (host, "ok")
                with admin.connect() as conn:  # and its Merkle log, under its name too
                    logged = conn.execute(sa.text(
                        "SELECT count(*) FROM ledger_log WHERE host = :h"), {"h": host}).scalar()
                assert logged == 1
                # its status report, written under its own role, shows the adapter it loaded
                reporter = HostReporter.into(own, svc)
                assert reporter.report_once() and reporter.report_once()  # insert, then update
                (status,) = [st for st in HostStatusTable(admin).all() if st.host == host]
                assert [e.digest for e in status.device] == [home.digests["gamma"]]
                home.registry.revoke(digest, "test", actor=ACTOR)
                wait_for(lambda: digest not in svc.engine.resident_adapters(), "the unload", 10)
                wait_for(lambda: TableSteps(s).done(digest, host) == [
                    "drained", "purged", "unloaded"], "the host's reports", 10)
            finally:
                svc.close()
            # The control plane's side: the reports become the adapter's events.
            assert fold_reports(home.registry, admin) == 3
            assert home.registry.adapter(digest).serving_steps[host] == [
                "drained", "purged", "unloaded"]
        finally:
            from control.contracts.db import dispose_engines

            dispose_engines()
            with admin.begin() as conn:
                for role in (names.control, names.gateway, host, names.hosts):
                    conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
                    conn.exec_driver_sql(f'DROP ROLE "{role}"')
