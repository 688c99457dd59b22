"""A host's revocation steps go into ``serving_step_reports``; the control plane folds them into
the adapter's events (``fold_reports``), in order, once, under the reporting host's name."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import sqlalchemy as sa

from control.app.serving_steps import fold_reports
from control.contracts.db import make_engine
from control.contracts.serving_reports import TableSteps, serving_step_reports
from tests.fixtures_control import sqlite_settings

KNOWN = "sha256:" + "1" * 64
UNKNOWN = "sha256:" + "2" * 64


class _Adapter:
    def __init__(self) -> None:
        self.serving_steps: dict[str, list[str]] = {}


class _Registry:
    """What ``fold_reports`` uses of the registry: an adapter's recorded steps, and recording."""

    def __init__(self) -> None:
        self.adapters = {KNOWN: _Adapter()}
        self.recorded: list[tuple[str, str, str, str]] = []

    def adapter(self, digest: str) -> _Adapter:
        return self.adapters[digest]  # KeyError: an unknown digest

    def record_serving_step(self, digest: str, host: str, step: str, *, actor: str) -> None:
        done = self.adapters[digest].serving_steps.setdefault(host, [])
        assert step not in done
        done.append(step)
        self.recorded.append((digest, host, step, actor))


def test_reports_fold_into_events_in_order_once(tmp_path: Path) -> None:
    s = sqlite_settings(tmp_path)
    s.ensure_dirs()
    steps = TableSteps(s)
    # Reported out of order and twice: the table holds each step once.
    for step in ("purged", "drained", "drained", "unloaded"):
        steps.record(KNOWN, "h1", step)
    steps.record(UNKNOWN, "h1", "drained")
    assert steps.done(KNOWN, "h1") == ["drained", "purged", "unloaded"]
    assert steps.done(KNOWN, "h2") == []
    registry = _Registry()
    registry.adapters[KNOWN].serving_steps["h0"] = ["drained"]  # another host's, untouched
    engine = make_engine(s.db_url)
    assert fold_reports(cast(Any, registry), engine) == 3
    assert registry.recorded == [(KNOWN, "h1", step, "host:h1")
                                 for step in ("drained", "purged", "unloaded")]
    assert fold_reports(cast(Any, registry), engine) == 0  # folded reports are not re-read
    with engine.connect() as conn:
        unfolded = conn.execute(sa.select(serving_step_reports.c.digest).where(
            serving_step_reports.c.folded_at.is_(None))).scalars().all()
    assert unfolded == [UNKNOWN]  # kept until it can be folded
    # A step another control plane folded first is only marked.
    steps.record(KNOWN, "h2", "drained")
    registry.adapters[KNOWN].serving_steps["h2"] = ["drained"]
    assert fold_reports(cast(Any, registry), engine) == 0
    assert steps.done(KNOWN, "h2") == ["drained"]


def test_an_unknown_step_is_refused(tmp_path: Path) -> None:
    s = sqlite_settings(tmp_path)
    s.ensure_dirs()
    with pytest.raises(ValueError, match="unknown serving step"):
        TableSteps(s).record(KNOWN, "h1", "evicted")


def test_serve_keeps_folding_until_stopped(tmp_path: Path) -> None:
    """What ``serve`` runs beside the follower: a report is folded within a few intervals."""
    import threading
    import time

    from control.app.serving_steps import keep_folding

    s = sqlite_settings(tmp_path)
    s.ensure_dirs()
    registry, stop = _Registry(), threading.Event()
    folder = threading.Thread(target=keep_folding,
                              args=(cast(Any, registry), make_engine(s.db_url), stop, 0.01))
    folder.start()
    try:
        TableSteps(s).record(KNOWN, "h1", "drained")
        deadline = time.monotonic() + 10
        while not registry.recorded and time.monotonic() < deadline:
            time.sleep(0.01)
        assert registry.recorded == [(KNOWN, "h1", "drained", "host:h1")]
    finally:
        stop.set()
        folder.join(timeout=5)
    assert not folder.is_alive()
