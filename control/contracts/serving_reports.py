"""A Triton host's revocation steps, reported into a table the control plane folds into events.

A host's steps after a revocation (drained, purged, unloaded; ``backend.serving.requests.
RevocationSteps``) used to be recorded by the host itself, as events, through the registry: every
host held a credential that could write any event (a signing key, a grant). Now a host inserts a
row into ``serving_step_reports`` (:class:`TableSteps`: its database role may insert its own rows
there and nothing else; ``control.app.db_roles``), and the control plane's ``serve`` folds new rows
into the adapter's events (``control.app.serving_steps.fold_reports``), recorded with the actor
``host:<host>`` as before. A report is kept after folding, marked ``folded_at``; a host re-reads its
own reports to know which steps it already reported.
"""

from __future__ import annotations

import time

import sqlalchemy as sa

from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.schema import Component, declare, open_component

STEPS = ("drained", "purged", "unloaded")  # the order a host goes through them

metadata = sa.MetaData()

serving_step_reports = sa.Table(
    "serving_step_reports", metadata,
    sa.Column("digest", sa.String(71), primary_key=True),
    sa.Column("host", sa.String(128), primary_key=True),
    sa.Column("step", sa.String(16), primary_key=True),
    sa.Column("reported_at", sa.Float, nullable=False),
    sa.Column("folded_at", sa.Float, nullable=True),  # set by the control plane
)
SERVING_REPORTS = declare(Component("serving_reports", 1, metadata, lambda _insp: 1))


class TableSteps:
    """``RevocationSteps`` for a Triton host: one row per step, never an event (module notes)."""

    def __init__(self, settings: Settings) -> None:
        self.engine = make_engine(settings.db_url)
        open_component(self.engine, SERVING_REPORTS)

    def done(self, digest: str, host: str) -> list[str]:
        t = serving_step_reports
        with self.engine.connect() as conn:
            found = set(conn.execute(sa.select(t.c.step).where(
                t.c.digest == digest, t.c.host == host)).scalars())
        return [s for s in STEPS if s in found]

    def record(self, digest: str, host: str, step: str) -> None:
        if step not in STEPS:
            raise ValueError(f"unknown serving step {step!r}: one of {', '.join(STEPS)}")
        t = serving_step_reports
        with self.engine.begin() as conn:
            exists = conn.execute(sa.select(t.c.step).where(
                t.c.digest == digest, t.c.host == host, t.c.step == step)).first()
            if exists is None:  # reporting twice is reporting once
                conn.execute(t.insert().values(digest=digest, host=host, step=step,
                                               reported_at=time.time()))
