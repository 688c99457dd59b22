"""Each incident query finds its subject's rows through an index led by the subject's column,
on SQLite and on PostgreSQL: a million-row ledger is never read whole to answer one
``incident requests`` (``loraplane bench scale`` times them; the README names the plans).

Before: ``--base`` had no index and scanned the table."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import request_ledger
from control.tools.bench_incidents import _digest, fill, indexes_used
from projections.incidents import ledger_rows, subject_query
from tests.fixtures_control import OnPostgres, OnSQLite

ADAPTER, BASE, RELEASE = _digest("adapter", 3), _digest("base", 3), _digest("release", 6)
SUBJECTS: list[tuple[str, dict[str, Any], set[str]]] = [
    # what the ticket named or the slot held: both indexes
    ("adapter", {"adapter": ADAPTER}, {"ix_ledger_adapter_time", "ix_ledger_served_time"}),
    ("release", {"release": RELEASE}, {"ix_ledger_release_time"}),
    ("training data", {"adapters": [ADAPTER, _digest("adapter", 4)]},
     {"ix_ledger_adapter_time"}),
    ("base", {"base": BASE}, {"ix_ledger_base_time"}),
]


class Plans:
    @pytest.fixture
    def filled(self, settings: Settings) -> Any:
        engine = make_engine(settings.db_url)
        fill(engine, 5000)
        return engine

    @pytest.mark.parametrize(("kind", "subject", "wanted"), SUBJECTS,
                             ids=[s[0] for s in SUBJECTS])
    def test_the_subject_s_rows_come_through_its_index(
            self, filled: Any, kind: str, subject: dict[str, Any], wanted: set[str]) -> None:
        used = set(indexes_used(filled, subject_query(**subject), usable=True))
        assert wanted <= used, f"{kind}: plan reads {sorted(used) or 'the whole table'}"

    def test_rows_are_the_subject_s_and_oldest_first(self, filled: Any) -> None:
        rows = ledger_rows(filled, adapter=ADAPTER)
        assert rows and all(ADAPTER in (r.adapter_digest, r.served_digest) for r in rows)
        assert [r.admitted_at for r in rows] == sorted(r.admitted_at for r in rows)
        with filled.connect() as conn:  # rows whose slot held another adapter than named
            named, held = conn.execute(sa.select(
                request_ledger.c.adapter_digest, request_ledger.c.served_digest).where(
                request_ledger.c.adapter_digest != request_ledger.c.served_digest).limit(1)).one()
        for digest in (named, held):  # found under either digest
            assert any((r.adapter_digest, r.served_digest) == (named, held)
                       for r in ledger_rows(filled, adapter=digest))


class TestOnSQLite(Plans, OnSQLite):
    pass


@pytest.mark.postgres
class TestOnPostgres(Plans, OnPostgres):
    pass
