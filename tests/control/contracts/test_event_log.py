"""Paging the notification log: one contract suite on eventsourcing's in-memory recorder, on
SQLite and on PostgreSQL (the recorders the deployment runs)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from eventsourcing.application import Application
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import Notification

from control.contracts.event_log import notification_pages, notifications, page_after
from tests.fixtures_control import close_registry, postgres_settings, sqlite_settings

EVENTS = 7


class CountingLog:
    """A recorder that notes each page it is asked for: ``(start, limit, stop)``."""

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder
        self.reads: list[tuple[int | None, int, int | None]] = []

    def select_notifications(self, start: int | None, limit: int, stop: int | None = None,
                             topics: Sequence[str] = (), *, inclusive_of_start: bool = True
                             ) -> Sequence[Notification]:
        assert inclusive_of_start is False  # every reader passes the last position it saw
        self.reads.append((start, limit, stop))
        return list(self.recorder.select_notifications(start, limit, stop, topics,
                                                       inclusive_of_start=inclusive_of_start))


def _app(env: dict[str, str], events: int) -> Application[Any]:
    app: Application[Any] = Application(env=env)
    for _ in range(events):
        app.save(Aggregate())
    return app


class EventLogContract:
    @pytest.fixture
    def env(self) -> Iterator[dict[str, str]]:
        raise NotImplementedError

    @pytest.fixture
    def app(self, env: dict[str, str]) -> Iterator[Application[Any]]:
        app = _app(env, EVENTS)
        yield app
        close_registry(app)

    @pytest.fixture
    def log(self, app: Application[Any]) -> CountingLog:
        return CountingLog(app.recorder)

    @pytest.fixture
    def ids(self, app: Application[Any]) -> list[int]:
        ids = [n.id for n in app.recorder.select_notifications(None, 100)]
        assert len(ids) == EVENTS
        return ids

    def test_pages_cover_the_log_in_order_and_end_on_an_empty_read(
            self, log: CountingLog, ids: list[int]) -> None:
        pages = list(notification_pages(log, page_size=3))
        assert [[n.id for n in p] for p in pages] == [ids[0:3], ids[3:6], ids[6:7]]
        # Read on to an empty page, not just a short one: an event recorded meanwhile is read.
        assert log.reads == [(0, 3, None), (ids[2], 3, None), (ids[5], 3, None),
                             (ids[6], 3, None)]

    def test_start_is_exclusive_and_stop_inclusive(self, log: CountingLog,
                                                   ids: list[int]) -> None:
        got = [n.id for n in notifications(log, after=ids[1], stop=ids[4], page_size=2)]
        assert got == ids[2:5]
        # The page that reaches stop is the last read: nothing beyond it can come back.
        assert log.reads == [(ids[1], 2, ids[4]), (ids[3], 2, ids[4])]

    def test_after_none_reads_from_the_first_row(self, log: CountingLog, ids: list[int]) -> None:
        assert [n.id for n in notifications(log, after=None, page_size=100)] == ids
        assert log.reads[0] == (None, 100, None)

    def test_limit_caps_the_total_and_shortens_the_last_page(
            self, log: CountingLog, ids: list[int]) -> None:
        pages = list(notification_pages(log, after=ids[0], page_size=2, limit=3))
        assert [[n.id for n in p] for p in pages] == [ids[1:3], ids[3:4]]
        assert log.reads == [(ids[0], 2, None), (ids[2], 1, None)]
        assert list(notifications(log, page_size=2, limit=0)) == []
        assert len(log.reads) == 2  # a zero limit reads nothing

    def test_pages_are_read_lazily(self, log: CountingLog, ids: list[int]) -> None:
        first = next(notifications(log, page_size=2))
        assert first.id == ids[0]
        assert log.reads == [(0, 2, None)]

    def test_one_page_after_a_position(self, log: CountingLog, ids: list[int]) -> None:
        assert [n.id for n in page_after(log, ids[3], 2)] == ids[4:6]
        assert [n.id for n in page_after(log, ids[-1], 2)] == []

    def test_reading_past_the_end_yields_nothing(self, log: CountingLog,
                                                 ids: list[int]) -> None:
        assert list(notification_pages(log, after=ids[-1], page_size=5)) == []
        assert log.reads == [(ids[-1], 5, None)]

    def test_page_size_must_be_positive(self, log: CountingLog) -> None:
        with pytest.raises(ValueError, match="page_size"):
            list(notification_pages(log, page_size=0))


class TestEventLogInMemory(EventLogContract):
    @pytest.fixture
    def env(self) -> Iterator[dict[str, str]]:
        yield {"PERSISTENCE_MODULE": "eventsourcing.popo"}


class TestEventLogSQLite(EventLogContract):
    @pytest.fixture
    def env(self, tmp_path: Path) -> Iterator[dict[str, str]]:
        settings = sqlite_settings(tmp_path / "home")
        settings.ensure_dirs()
        yield {"PERSISTENCE_MODULE": "eventsourcing_sqlalchemy",
               "SQLALCHEMY_URL": settings.db_url}


@pytest.mark.postgres
class TestEventLogPostgres(EventLogContract):
    @pytest.fixture
    def env(self, tmp_path: Path) -> Iterator[dict[str, str]]:
        with postgres_settings(tmp_path / "home") as settings:
            yield {"PERSISTENCE_MODULE": "eventsourcing_sqlalchemy",
                   "SQLALCHEMY_URL": settings.db_url}


def test_an_empty_log_has_no_pages() -> None:
    log = CountingLog(_app({"PERSISTENCE_MODULE": "eventsourcing.popo"}, 0).recorder)
    assert list(notification_pages(log, page_size=10)) == []
    assert list(notifications(log, after=None, stop=5, page_size=10)) == []
    assert page_after(log, 0, 10) == []
    assert log.reads == [(0, 10, None), (None, 10, 5), (0, 10, None)]
