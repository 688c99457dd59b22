"""Incident queries on the request ledger: by adapter digest, training data version, base or
release manifest digest.

The ledger (``control.contracts.ledger``) is read, never written, here. A training data version is
resolved to the adapters registered with it (the registry metadata in the adapter catalogue),
then to every request those adapters served.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, LedgerEntry, request_ledger
from projections.routing import RoutingView


class UnknownSubject(ValueError):
    """The digest or data version asked about was never registered: an empty answer would
    read as "served nothing", which is not what is known."""


def _known(routing: RoutingView, *, adapter: str | None, training_data_version: str | None,
           base: str | None, release: str | None) -> None:
    if adapter is not None and routing.adapter(adapter) is None:
        raise UnknownSubject(f"unknown adapter digest {adapter}: no adapter with this digest "
                             "was ever registered (check the digest)")
    if release is not None and routing.release(release) is None:
        raise UnknownSubject(f"unknown release digest {release}: no release manifest with this "
                             "digest was ever recorded (check the digest)")
    if base is not None and base not in {b.digest for b in routing.bases()}:
        raise UnknownSubject(f"unknown base digest {base}: no base model with this digest was "
                             "ever registered (check the digest)")
    if training_data_version is not None and not routing.adapters_by_training_data(
            training_data_version):
        raise UnknownSubject(f"unknown training data version {training_data_version!r}: no "
                             "adapter was registered with it")


def requests_for(
    settings: Settings,
    *,
    adapter: str | None = None,
    training_data_version: str | None = None,
    base: str | None = None,
    release: str | None = None,
    since: float | None = None,
    until: float | None = None,
) -> list[LedgerEntry]:
    """Ledger rows for exactly one of ``adapter``, ``training_data_version``, ``base`` or
    ``release``, oldest first, within [``since``, ``until``).

    ``release`` finds the rows whose verified ticket named that release manifest; rows written
    before the ledger recorded releases (schema version 1) have none and are not found by it.
    Raises :class:`UnknownSubject` for a digest or data version that was never registered.
    """
    if sum(x is not None for x in (adapter, training_data_version, base, release)) != 1:
        raise ValueError("give exactly one of adapter, training data version, base, release")
    engine = make_engine(settings.db_url)
    routing = RoutingView(engine)
    _known(routing, adapter=adapter, training_data_version=training_data_version, base=base,
           release=release)
    Ledger(engine)  # the ledger at this code's version (created empty, or refused if older)
    digests = (routing.adapters_by_training_data(training_data_version)
               if training_data_version is not None else None)
    return ledger_rows(engine, adapter=adapter, adapters=digests, base=base, release=release,
                       since=since, until=until)


def ledger_rows(engine: Engine, *, adapter: str | None = None,
                adapters: Sequence[str] | None = None, base: str | None = None,
                release: str | None = None, since: float | None = None,
                until: float | None = None) -> list[LedgerEntry]:
    """The rows of one subject, oldest first (:func:`subject_query`)."""
    q = subject_query(adapter=adapter, adapters=adapters, base=base, release=release,
                      since=since, until=until)
    with engine.connect() as conn:  # positional: the table's columns are the entry's fields
        return [LedgerEntry(*r) for r in conn.execute(q).tuples().all()]


def subject_query(*, adapter: str | None = None, adapters: Sequence[str] | None = None,
                  base: str | None = None, release: str | None = None,
                  since: float | None = None, until: float | None = None) -> sa.Select[Any]:
    """The rows of what the ticket named or the slot held (``adapter``), of any of
    ``adapters`` (a training data version's), of ``base`` or of ``release``, within
    [``since``, ``until``), oldest first. Each subject has an index led by its column and the
    admission time (``ix_ledger_*_time``), so its rows are found without reading the rest of
    the ledger: ``loraplane bench scale`` times them over a million rows, and
    tests/projections/test_incident_plans.py reads the plans."""
    t = request_ledger
    if adapter is not None:
        q = sa.select(t).where(sa.or_(t.c.adapter_digest == adapter, t.c.served_digest == adapter))
    elif release is not None:
        q = sa.select(t).where(t.c.release_digest == release)
    elif base is not None:
        q = sa.select(t).where(t.c.base_digest == base)
    else:
        assert adapters is not None, "one subject"
        q = sa.select(t).where(t.c.adapter_digest.in_(list(adapters)))
    if since is not None:
        q = q.where(t.c.admitted_at >= since)
    if until is not None:
        q = q.where(t.c.admitted_at < until)
    return q.order_by(t.c.admitted_at, t.c.request_id)
