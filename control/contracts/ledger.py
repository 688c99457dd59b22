"""The request ledger: one durable row per request, written before its response leaves.

Rows are keyed by request id and indexed by adapter digest and time, and by release manifest
digest and time, so an incident responder can ask which requests a digest or a release served,
for whom, and when. The ledger lives in the same database as the event store (one URL); it is
append-mostly: a row is inserted at admission (or refusal) and updated once when the request
finishes. Its schema is versioned (``control.contracts.schema``, component ``ledger``): opening a
ledger
creates a fresh one at the latest version and refuses an older one.

Tenant feedback (schema version 4) sits beside the rows in ``request_feedback``: one rating
(success or not) per request, given by the tenant the row names, append-only. A second rating of
the same request is refused, not applied: the rating a rollout window counted (and recorded in
its event) must stay the one the table holds, so an auditor re-reading the table finds the same
figures. ``Ledger.release_window`` reads one release's figures over a time window: what the
rollout controller judges a canary by.

What a rating counts for (issue 21: a granted tenant's ratings decided its owner's rollout, and
a tenant could rate its own failed request as a success):

- **only the release's owner rates it**: ``Ledger.rate`` refuses (:class:`NotTheOwner`) a rating
  whose rater is not the tenant that owns the release that served the request, as the caller's
  ``owner_of`` lookup says (the gateway passes the routing projection's). A tenant granted
  another's alias uses it; the owner answers for its quality. A base-only release has no
  owner, so no rating counts for it. Refused rather than recorded-and-ignored: the table then
  holds exactly what windows count.
- **a rating binds to its arm**: schema version 5 records on the rating the release its request
  was served under, copied from the row in the rating's transaction; a window counts a rating
  only for that release, so no later change to a row moves a rating to another arm.
- **only an ``ok`` request can be a success**: a rating of a request that did not end ``ok``
  (failed, refused, cancelled, an identity mismatch) counts as rated and never as a success,
  whatever it says. Counted, not refused: a stream's request id reaches the client with its
  first token, before the row's outcome is known, and the outcome a window reads is the final
  one.
- **synthetic requests are out** (``control.contracts.synthetic``): no tenant can rate one, and
  a window leaves them out of every figure but identity mismatches, counting them apart.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.ledger_tables import (  # re-exported: the ledger's one import path
    BUSY_REASON,
    BUSY_REASONS,
    LEDGER,
    LEDGER_VERSION,
    LOAD_FAILED,
    MEMORY_REFUSALS,
    OUTCOMES,
    TENANT_BUSY_REASON,
    AdapterLoad,
    Completion,
    LedgerEntry,
    Outcome,
    adapter_loads,
    metadata,
    request_feedback,
    request_ledger,
)
from control.contracts.schema import open_component
from control.contracts.synthetic import is_synthetic

__all__ = [
    "BUSY_REASON",
    "BUSY_REASONS",
    "LEDGER",
    "LEDGER_VERSION",
    "LOAD_FAILED",
    "MEMORY_REFUSALS",
    "OUTCOMES",
    "TENANT_BUSY_REASON",
    "AdapterLoad",
    "AlreadyRated",
    "Completion",
    "Ledger",
    "LedgerConflict",
    "LedgerEntry",
    "NotRatable",
    "NotTheOwner",
    "Outcome",
    "Rating",
    "ReleaseWindow",
    "RowReader",
    "adapter_loads",
    "metadata",
    "p95",
    "request_feedback",
    "request_ledger",
]


class LedgerConflict(Exception):
    """Rows that can never be written as given (see :meth:`Ledger.write`); retrying is futile."""

    def __init__(self, request_ids: Sequence[str]) -> None:
        super().__init__(f"ledger rows that cannot be written: {', '.join(request_ids)}")
        self.request_ids = tuple(request_ids)


class NotRatable(LookupError):
    """No ledger row of that id names the rating tenant (unknown, or another tenant's): the
    two cases are one error, so a tenant learns nothing of other tenants' request ids."""


class AlreadyRated(Exception):
    """The request already holds a rating; ratings are never replaced."""


class NotTheOwner(Exception):
    """The rater's own request, served under a release the rater does not own (another
    tenant's alias it is granted, a base-only release, or no release): only a release's owner
    rates it (see the module notes)."""


@dataclass(frozen=True)
class Rating:
    request_id: str
    tenant: str
    success: bool
    rated_at: float
    release_digest: str | None = None  # the arm it rates (None: recorded before version 5)


@dataclass(frozen=True)
class ReleaseWindow:
    """What the ledger says about one release over one time window ``[since, until)`` of
    admission times: the figures a rollout window is judged by.

    ``requests``: rows naming the release (refused ones included); ``ok``/``failed``: how the
    served ones ended; ``identity_mismatches``: rows failed closed because the slot held
    another adapter than the ticket named, where either is this release's adapter;
    ``busy``/``memory_refusals``: refusals for want of capacity (``BUSY_REASONS``,
    ``MEMORY_REFUSALS``); ``load_failures``: failed attempts to load the release's adapter
    (``adapter_loads``) started in the window; ``rated``/``successes``: the release owner's
    ratings of the window's rows that bind to this release, as the table holds them when read,
    a success only on an ``ok`` row; ``p95_latency_s``: of the ``ok`` rows, finished minus
    admitted (None without one); ``synthetic``: the control plane's own requests on the release
    (gate, probes), left out of every other figure but ``identity_mismatches``.
    """

    requests: int = 0
    ok: int = 0
    failed: int = 0
    identity_mismatches: int = 0
    busy: int = 0
    memory_refusals: int = 0
    load_failures: int = 0
    rated: int = 0
    successes: int = 0
    p95_latency_s: float | None = None
    synthetic: int = 0


def p95(values: Sequence[float]) -> float | None:
    """The 95th percentile by nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, -(-95 * len(ordered) // 100) - 1)]


class Ledger:
    """Writes and queries the request ledger."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Creates a fresh ledger at the latest version; refuses an older or newer one with a
        # message naming `loraplane db upgrade` (no silent ALTER on the evidence table).
        open_component(engine, LEDGER)

    def admit(self, entries: Sequence[LedgerEntry]) -> None:
        """Insert rows (admitted or refused) in one transaction."""
        self.write(entries, ())

    def complete(self, completions: Sequence[Completion], now: float | None = None) -> None:
        """Record how requests ended, in one transaction; only running rows change."""
        self.write((), completions, now)

    def write(self, entries: Sequence[LedgerEntry], completions: Sequence[Completion],
              now: float | None = None, also: Callable[[Connection], None] | None = None,
              read: RowReader | None = None) -> None:
        """Insert ``entries`` and apply ``completions``, all in one transaction.

        Idempotent by request id, so a write retried after its commit was not acknowledged
        changes nothing: an entry whose row already exists with the same request, host and
        admission time is written already; a completion whose row is already finished the same
        way is applied already. Anything else that can never be written raises
        :class:`LedgerConflict` naming those request ids (a row with that id from another
        request, a completion for a row that does not exist or ended otherwise), and the
        transaction writes nothing. ``also`` runs last in the transaction (the host's log).
        ``read``: how the check reads the rows back (whole rows, in column order): the host's
        log reads them once for the check and its leaves, instead of a second time.
        """
        if not entries and not completions:
            return
        with self.engine.begin() as conn:
            if entries:
                conn.execute(_insert_new(conn), [_row(e) for e in entries])
            if completions:
                _complete(conn, completions, time.time() if now is None else now)
            conflicts = _conflicts(conn, entries, completions, read)
            if conflicts:
                raise LedgerConflict(conflicts)
            if also is not None:
                also(conn)

    def fail_running(self, host: str, reason: str = "host_restart") -> int:
        """Mark rows this host left running (it died mid-request) as failed."""
        with self.engine.begin() as conn:
            res = conn.execute(
                request_ledger.update()
                .where(request_ledger.c.host == host)
                .where(request_ledger.c.outcome == "running")
                .values(outcome="failed", reason=reason, finished_at=time.time())
            )
            return int(res.rowcount or 0)

    def query(
        self,
        *,
        adapter: str | None = None,
        release: str | None = None,
        tenant: str | None = None,
        since: float | None = None,
        until: float | None = None,
        outcome: str | None = None,
    ) -> list[LedgerEntry]:
        """Rows matching every given filter, oldest first."""
        q = sa.select(request_ledger)
        if adapter is not None:  # what the ticket named, or what the slot held
            q = q.where(sa.or_(request_ledger.c.adapter_digest == adapter,
                               request_ledger.c.served_digest == adapter))
        if release is not None:
            q = q.where(request_ledger.c.release_digest == release)
        if tenant is not None:
            q = q.where(request_ledger.c.tenant == tenant)
        if since is not None:
            q = q.where(request_ledger.c.admitted_at >= since)
        if until is not None:
            q = q.where(request_ledger.c.admitted_at < until)
        if outcome is not None:
            q = q.where(request_ledger.c.outcome == outcome)
        q = q.order_by(request_ledger.c.admitted_at, request_ledger.c.request_id)
        with self.engine.connect() as conn:
            return [LedgerEntry(**dict(r._mapping)) for r in conn.execute(q)]

    def record_load(self, load: AdapterLoad) -> None:
        self.record_loads([load])

    def record_loads(self, loads: Sequence[AdapterLoad]) -> None:
        """Insert load records, in their order, in one transaction."""
        if not loads:
            return
        with self.engine.begin() as conn:
            conn.execute(adapter_loads.insert(), [{f: getattr(load, f)
                                                   for f in AdapterLoad.__dataclass_fields__}
                                                  for load in loads])

    def last_resident(self, host: str, limit: int, scan: int = 10_000) -> list[str]:
        """The adapters ``host``'s device slots held when it last wrote a load record for
        them (their latest record says ``loaded``), most recently loaded first, at most
        ``limit``; read from the host's last ``scan`` records only, so a long history costs no
        more than a short one."""
        c = adapter_loads.c
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(c.adapter_digest, c.outcome)
                                .where(c.host == host).order_by(c.id.desc()).limit(scan)).all()
        seen: set[str] = set()
        out: list[str] = []
        for r in rows:  # newest first: a digest's first row is its latest
            if r.adapter_digest in seen:
                continue
            seen.add(r.adapter_digest)
            if r.outcome == "loaded":
                out.append(str(r.adapter_digest))
                if len(out) >= limit:
                    break
        return out

    def loads(self, adapter: str | None = None) -> list[AdapterLoad]:
        q = sa.select(*[adapter_loads.c[f] for f in AdapterLoad.__dataclass_fields__])
        if adapter is not None:
            q = q.where(adapter_loads.c.adapter_digest == adapter)
        with self.engine.connect() as conn:
            return [AdapterLoad(**dict(r._mapping))
                    for r in conn.execute(q.order_by(adapter_loads.c.id))]

    # -- feedback -------------------------------------------------------------------------------

    def rate(self, request_id: str, tenant: str, success: bool,
             now: float | None = None, *,
             owner_of: Callable[[str], str | None] | None = None) -> Rating:
        """Record ``tenant``'s rating of its request ``request_id``, bound to the release the
        request was served under.

        NotRatable when no row of that id names ``tenant`` (unknown, or another tenant's: one
        answer); NotTheOwner when ``owner_of`` (release digest -> its owner tenant, None for a
        base-only release) says the release is not the rater's, or the row has no release;
        AlreadyRated when the request holds a rating already (the first one stays). The
        checks and the insert share one transaction, and the primary key settles two ratings
        racing for one request. Without ``owner_of`` the caller vouches that the rater owns
        the release (operator tools, tests); every tenant-facing route passes it.
        """
        rated_at = time.time() if now is None else now
        try:
            with self.engine.begin() as conn:
                row = conn.execute(sa.select(request_ledger.c.tenant,
                                             request_ledger.c.release_digest).where(
                    request_ledger.c.request_id == request_id)).first()
                if row is None or row.tenant is None or row.tenant != tenant:
                    raise NotRatable(request_id)
                release = row.release_digest
                if release is None or (owner_of is not None and owner_of(release) != tenant):
                    raise NotTheOwner(request_id)
                rating = Rating(request_id, tenant, bool(success), rated_at, release)
                conn.execute(request_feedback.insert().values(
                    request_id=rating.request_id, tenant=rating.tenant,
                    success=rating.success, rated_at=rating.rated_at,
                    release_digest=rating.release_digest))
        except sa.exc.IntegrityError:
            raise AlreadyRated(request_id) from None
        return rating

    def rating(self, request_id: str) -> Rating | None:
        """The rating of ``request_id``, if it has one."""
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(request_feedback).where(
                request_feedback.c.request_id == request_id)).first()
        return Rating(**dict(r._mapping)) if r else None

    # -- rollout windows --------------------------------------------------------------------

    def release_window(self, release: str, adapter: str | None, since: float,
                       until: float) -> ReleaseWindow:
        """The figures of ``release`` (whose adapter is ``adapter``, None for a base-only
        release) over admissions in ``[since, until)``; see :class:`ReleaseWindow` and the
        module notes (whose ratings count, and for what)."""
        t, f = request_ledger, request_feedback
        in_window = sa.and_(t.c.admitted_at >= since, t.c.admitted_at < until)
        # A rating counts only for the release it was recorded against (its arm).
        bound = sa.and_(f.c.request_id == t.c.request_id, f.c.release_digest == release)
        rows = sa.select(t.c.request_id, t.c.tenant, t.c.outcome, t.c.reason, t.c.admitted_at,
                         t.c.finished_at, f.c.success).select_from(
            t.outerjoin(f, bound)).where(t.c.release_digest == release, in_window)
        with self.engine.connect() as conn:
            every = conn.execute(rows).all()
            # A mismatch row of another release still speaks of this adapter when the slot
            # held it (or the ticket named it): counted as this release's mismatch too.
            other_mismatches = 0
            failed_loads = 0
            if adapter is not None:
                other_mismatches = int(conn.execute(
                    sa.select(sa.func.count()).select_from(t).where(
                        in_window, t.c.outcome == Outcome.IDENTITY_MISMATCH.value,
                        sa.or_(t.c.release_digest.is_(None), t.c.release_digest != release),
                        sa.or_(t.c.adapter_digest == adapter, t.c.served_digest == adapter))
                ).scalar() or 0)
                failed_loads = int(conn.execute(
                    sa.select(sa.func.count()).select_from(adapter_loads).where(
                        adapter_loads.c.adapter_digest == adapter,
                        adapter_loads.c.outcome == LOAD_FAILED,
                        adapter_loads.c.started_at >= since,
                        adapter_loads.c.started_at < until)).scalar() or 0)
        # The control plane's own requests are not the release's traffic (module notes); an
        # identity mismatch is the engine's fault whoever sent the request.
        found = [r for r in every if not is_synthetic(r.tenant)]
        mismatches = sum(1 for r in every if r.outcome == Outcome.IDENTITY_MISMATCH.value)
        outcomes = [r.outcome for r in found]
        # Only a finished row is judged: one still running has no outcome to rate yet.
        rated = [(r.success, r.outcome) for r in found
                 if r.success is not None and r.outcome != Outcome.RUNNING.value]
        return ReleaseWindow(
            requests=len(found),
            ok=outcomes.count(Outcome.OK.value),
            failed=outcomes.count(Outcome.FAILED.value),
            identity_mismatches=mismatches + other_mismatches,
            busy=sum(1 for r in found if r.reason in BUSY_REASONS),
            memory_refusals=sum(1 for r in found if r.reason in MEMORY_REFUSALS),
            load_failures=failed_loads,
            rated=len(rated),
            successes=sum(1 for success, outcome in rated
                          if success and outcome == Outcome.OK.value),
            p95_latency_s=p95([r.finished_at - r.admitted_at for r in found
                               if r.outcome == Outcome.OK.value and r.finished_at is not None]),
            synthetic=len(every) - len(found),
        )

    def unattributed_busy(self, since: float, until: float) -> int:
        """Busy refusals in ``[since, until)`` made before any ticket was read (no tenant, no
        release): host-wide pressure, not any one release's."""
        t = request_ledger
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.admitted_at >= since, t.c.admitted_at < until, t.c.reason == BUSY_REASON,
                t.c.release_digest.is_(None), t.c.tenant.is_(None))).scalar() or 0)

    def get(self, request_id: str) -> LedgerEntry | None:
        with self.engine.connect() as conn:
            r = conn.execute(
                sa.select(request_ledger).where(request_ledger.c.request_id == request_id)
            ).first()
        return LedgerEntry(**dict(r._mapping)) if r else None


def _complete(conn: sa.Connection, completions: Sequence[Completion], t: float) -> None:
    stmt = (
        request_ledger.update()
        .where(request_ledger.c.request_id == sa.bindparam("rid"))
        .where(request_ledger.c.outcome == Outcome.RUNNING.value)
        .values(
            outcome=sa.bindparam("o"),
            tokens_in=sa.bindparam("ti"),
            tokens_out=sa.bindparam("to"),
            reason=sa.bindparam("r"),
            served_digest=sa.bindparam("sd"),
            finished_at=t,
        )
    )
    conn.execute(stmt, [
        {"rid": c.request_id, "o": str(c.outcome), "ti": c.tokens_in, "to": c.tokens_out,
         "r": c.reason, "sd": c.served_digest}
        for c in completions
    ])


def _insert_new(conn: Connection) -> sa.Insert:
    """INSERT that skips a row whose request id exists already (both dialects the ledger runs
    on); :func:`_conflicts` then tells a repeat of the same row from a clash."""
    if conn.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert as pg_insert

        return pg_insert(request_ledger).on_conflict_do_nothing(index_elements=["request_id"])
    if conn.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert as sqlite_insert

        return sqlite_insert(request_ledger).on_conflict_do_nothing(
            index_elements=["request_id"])
    return request_ledger.insert()


# A RowReader returns the rows of the given request ids, whole and in column order.
RowReader = Callable[[Connection, list[str]], Mapping[str, Sequence[Any]]]
_CHECKED = tuple(c.name for c in request_ledger.columns).index
_HOST, _ADMITTED, _OUTCOME, _REASON = (_CHECKED(c) for c in
                                       ("host", "admitted_at", "outcome", "reason"))


def _conflicts(conn: Connection, entries: Sequence[LedgerEntry],
               completions: Sequence[Completion], read: RowReader | None = None) -> list[str]:
    """Request ids of ``entries`` and ``completions`` that the table, as this transaction sees
    it, does not hold as written: another request's row under the id, or a completion whose row
    is missing or ended in another way."""
    ids = sorted({e.request_id for e in entries} | {c.request_id for c in completions})
    held: dict[str, tuple[Any, ...]]
    if read is not None:
        held = {i: (r[_HOST], r[_ADMITTED], r[_OUTCOME], r[_REASON])
                for i, r in read(conn, ids).items()}
    else:
        t = request_ledger
        held = {r[0]: tuple(r[1:]) for r in conn.execute(
            sa.select(t.c.request_id, t.c.host, t.c.admitted_at, t.c.outcome, t.c.reason)
            .where(t.c.request_id.in_(ids)))}
    bad = [e.request_id for e in entries
           if (r := held.get(e.request_id)) is None or r[:2] != (e.host, e.admitted_at)]
    bad += [c.request_id for c in completions
            if (r := held.get(c.request_id)) is None
            or r[2:] != (str(c.outcome), c.reason)]
    return sorted(set(bad))


def _row(e: LedgerEntry) -> dict[str, object]:
    if e.outcome not in OUTCOMES:
        raise ValueError(f"unknown ledger outcome {e.outcome!r}")
    row = {f: getattr(e, f) for f in LedgerEntry.__dataclass_fields__}
    row["outcome"] = str(e.outcome)
    return row
