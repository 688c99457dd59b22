"""One database URL, one way to open it.

SQLite is opened in WAL mode with a busy timeout and full fsync (a ledger row is durable before its
response leaves), because the gateway, the projection follower,
the CLI and the Triton backend all write to the same file from different processes.
"""

from __future__ import annotations

import threading
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

_engines: dict[str, Engine] = {}
# Threads of one process (a follower, a host's status reporter, the gateway's workers) open
# engines while another may be disposing them: the map is only touched under this lock.
_engines_lock = threading.Lock()


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA synchronous=FULL")
    cur.close()


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine for ``url``; one per URL and process."""
    with _engines_lock:
        if url in _engines:
            return _engines[url]
        if url.startswith("sqlite"):
            engine = sa.create_engine(url, connect_args={"timeout": 10})
            sa.event.listen(engine, "connect", _sqlite_pragmas)
        else:
            engine = sa.create_engine(url, pool_pre_ping=True)
        _engines[url] = engine
        return engine


def dispose_engines() -> None:
    """Close every pooled connection (tests, forks)."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    for e in engines:
        e.dispose()
