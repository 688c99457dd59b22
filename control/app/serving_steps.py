"""The registry side of a host's revocation steps (``backend.serving.service.RevocationSteps``).

In-process services (tests, benches) hand :class:`RegistrySteps` to the serving glue, which opens
it on the first revocation; serving itself never imports the registry. A Triton host reports into
``serving_step_reports`` instead (``control.contracts.serving_reports.TableSteps``: its database
role may write no event), and the control plane folds those reports into the same events
(:func:`fold_reports`, run by ``serve``).
"""

from __future__ import annotations

import logging
import threading
import time

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.schema import open_component
from control.contracts.serving_reports import SERVING_REPORTS, STEPS, serving_step_reports

log = logging.getLogger("loraplane.serving_steps")


class RegistrySteps:
    """Reads and records one host's revocation steps as events on the adapter."""

    def __init__(self, settings: Settings) -> None:
        # follow=False: a host records facts; the control plane's follower projects them.
        self.registry = Registry(settings, follow=False)

    def done(self, digest: str, host: str) -> list[str]:
        return list(self.registry.adapter(digest).serving_steps.get(host, []))

    def record(self, digest: str, host: str, step: str) -> None:
        self.registry.record_serving_step(digest, host, step, actor=f"host:{host}")


# -- a host's reports, folded into events (control.contracts.serving_reports) -------------------

FOLD_INTERVAL_S = 0.5


def fold_reports(registry: Registry, engine: Engine) -> int:
    """Record, as events on the adapter, every step a host reported that is not folded yet, in
    the steps' order and with the actor ``host:<host>``, then mark the reports folded; returns
    how many steps were recorded. A step the adapter already holds (another control plane
    folded it first) is only marked. A report that cannot be folded (an unknown digest, a step
    out of order) stays unfolded and is logged once per pass; the others go on."""
    t = serving_step_reports
    with engine.connect() as conn:
        pending = conn.execute(sa.select(t.c.digest, t.c.host, t.c.step)
                               .where(t.c.folded_at.is_(None))).all()
    by_host: dict[tuple[str, str], set[str]] = {}
    for digest, host, step in pending:
        by_host.setdefault((str(digest), str(host)), set()).add(str(step))
    recorded = 0
    for (digest, host), steps in sorted(by_host.items()):
        try:
            done = registry.adapter(digest).serving_steps.get(host, [])
            for step in (s for s in STEPS if s in steps and s not in done):
                registry.record_serving_step(digest, host, step, actor=f"host:{host}")
                recorded += 1
        except Exception:
            log.warning("cannot fold the revocation steps host %s reported", host,
                        exc_info=True)
            continue
        with engine.begin() as conn:
            conn.execute(t.update().where(t.c.digest == digest, t.c.host == host,
                                          t.c.step.in_(sorted(steps)), t.c.folded_at.is_(None))
                         .values(folded_at=time.time()))
    return recorded


def keep_folding(registry: Registry, engine: Engine, stop: threading.Event,
                 interval_s: float = FOLD_INTERVAL_S) -> None:
    """``fold_reports`` every ``interval_s`` until ``stop`` (``serve`` runs it beside the
    projection follower)."""
    open_component(engine, SERVING_REPORTS)
    while not stop.wait(interval_s):
        try:
            fold_reports(registry, engine)
        except Exception:  # the database may be briefly away: try again next time
            log.warning("folding hosts' revocation steps failed", exc_info=True)
