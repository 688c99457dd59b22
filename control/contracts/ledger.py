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
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from control.contracts.schema import Component, add_column, declare, index_named, open_component
from control.contracts.synthetic import is_synthetic

metadata = sa.MetaData()


class Outcome(StrEnum):
    """How a request ended, as the ledger records it."""

    RUNNING = "running"  # admitted, not finished (or its host died: marked failed at restart)
    OK = "ok"
    REJECTED = "rejected"  # refused before generation: ticket, revocation, limits, busy
    FAILED = "failed"
    CANCELLED = "cancelled"  # the client cancelled or went away
    # The slot that computed the row did not hold the adapter the ticket named: the request
    # failed closed, and the row names both digests.
    IDENTITY_MISMATCH = "identity_mismatch"
    # Running when its adapter was revoked with the kill switch (``adapter revoke --immediate``):
    # ended there; ``tokens_out`` counts the tokens the client had received.
    REVOKED = "revoked"


request_ledger = sa.Table(
    "request_ledger",
    metadata,
    sa.Column("request_id", sa.String(36), primary_key=True),
    sa.Column("ticket_id", sa.String(64), nullable=True),
    sa.Column("tenant", sa.String(128), nullable=True),
    sa.Column("model", sa.String(128), nullable=False),
    sa.Column("host", sa.String(128), nullable=False),
    sa.Column("base_digest", sa.String(71), nullable=True),
    sa.Column("adapter_digest", sa.String(71), nullable=True),
    sa.Column("tokenizer_digest", sa.String(71), nullable=True),
    sa.Column("admitted_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("tokens_in", sa.Integer, nullable=True),
    sa.Column("tokens_out", sa.Integer, nullable=True),
    sa.Column("outcome", sa.String(32), nullable=False),  # an Outcome (32 since version 3)
    sa.Column("reason", sa.String(64), nullable=True),
    # Schema version 2: the release manifest the verified ticket named (None for rows whose ticket
    # did not verify, for a base without a release, and for rows written before version 2).
    sa.Column("release_digest", sa.String(71), nullable=True),
    # Schema version 3: the adapter digest the engine's slot held while it computed this row's
    # tokens, read from the slot, not from the ticket (None: the base slot, or never computed).
    # ``adapter_digest`` is what the verified ticket named; the two differ only on an
    # identity_mismatch row, and the incident view searches both.
    sa.Column("served_digest", sa.String(71), nullable=True),
    # Schema version 6: the sampling values the engine generated with, after the release's
    # inference defaults filled what the request left out (None: the row was refused before its
    # values were checked, or was written before version 6; ``seed`` None: a random seed).
    sa.Column("max_tokens", sa.Integer, nullable=True),
    sa.Column("temperature", sa.Float, nullable=True),
    sa.Column("top_p", sa.Float, nullable=True),
    sa.Column("seed", sa.BigInteger, nullable=True),
    sa.Index("ix_ledger_adapter_time", "adapter_digest", "admitted_at"),
    sa.Index("ix_ledger_time", "admitted_at"),
    sa.Index("ix_ledger_release_time", "release_digest", "admitted_at"),
    sa.Index("ix_ledger_served_time", "served_digest", "admitted_at"),
    # Schema version 7: ``incident requests --base`` scanned the whole table without it.
    sa.Index("ix_ledger_base_time", "base_digest", "admitted_at"),
)

OUTCOMES = tuple(o.value for o in Outcome)

# Reasons the serving side writes on ``rejected`` rows that a rollout window counts apart
# (backend/serving/service.py writes them; tests/control/contracts/test_feedback.py holds these
# names to that source). ``busy``: the host's bound on requests in flight or its scheduler queue
# was full; a busy refusal before the ticket was read has no tenant and no release, and is
# counted host-wide only. The memory refusals are ``adapter_`` + the adapter cache's reason: no
# slot or device budget was free for the adapter (the host's out-of-memory answer).
BUSY_REASON = "busy"
MEMORY_REFUSALS = frozenset({"adapter_no_room", "adapter_device_budget", "adapter_tenant_share"})
LOAD_FAILED = "failed"  # adapter_loads.outcome of an attempt that did not make it resident

# One row per attempt to make an adapter resident on a host: the evidence that a refused request
# never caused a load, and the record of loads that failed (bytes changed in the store, say).
adapter_loads = sa.Table(
    "adapter_loads",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("host", sa.String(128), nullable=False),
    sa.Column("adapter_digest", sa.String(71), nullable=False, index=True),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("seconds", sa.Float, nullable=False),
    sa.Column("outcome", sa.String(16), nullable=False),  # loaded | failed | unloaded
    sa.Column("resident_bytes", sa.BigInteger, nullable=True),
    sa.Column("reason", sa.String(64), nullable=True),
)


# Schema version 4: tenant feedback, one rating per request (the primary key), never changed.
# ``tenant`` repeats the row's tenant so a rating reads on its own; only that tenant may rate.
request_feedback = sa.Table(
    "request_feedback",
    metadata,
    sa.Column("request_id", sa.String(36), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False),
    sa.Column("success", sa.Boolean, nullable=False),
    sa.Column("rated_at", sa.Float, nullable=False),
    # Schema version 5: the release the rated request was served under (its arm), copied from
    # the row when the rating is recorded. None: a rating recorded before version 5, which no
    # window counts (whose release it rated, and whether its owner gave it, was never checked).
    sa.Column("release_digest", sa.String(71), nullable=True),
)


@dataclass(frozen=True)
class AdapterLoad:
    host: str
    adapter_digest: str
    started_at: float
    seconds: float
    outcome: str
    resident_bytes: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class LedgerEntry:
    request_id: str
    ticket_id: str | None
    tenant: str | None
    model: str
    host: str
    base_digest: str | None
    adapter_digest: str | None
    tokenizer_digest: str | None
    admitted_at: float
    finished_at: float | None = None
    tokens_in: int | None = None
    tokens_out: int | None = None
    outcome: str = Outcome.RUNNING
    reason: str | None = None
    release_digest: str | None = None
    served_digest: str | None = None
    max_tokens: int | None = None  # the sampling values used (schema version 6)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None


if [c.name for c in request_ledger.columns] != list(LedgerEntry.__dataclass_fields__):
    # Readers build entries from rows by position (projections.incidents): one order for both.
    raise ImportError("request_ledger's columns and LedgerEntry's fields differ in order")


@dataclass(frozen=True)
class Completion:
    request_id: str
    outcome: str
    tokens_in: int | None = None
    tokens_out: int | None = None
    reason: str | None = None
    served_digest: str | None = None  # read from the slot that computed the tokens


# -- the ledger's schema component (control.contracts.schema) -----------------------------------

def _ledger_version(insp: sa.Inspector) -> int:
    # Versions 2 and 3 each added one column, version 4 a table; the newest of them present
    # tells the version. Without a request_ledger (only adapter_loads) nothing needs altering:
    # the missing tables are created at the latest version.
    if not insp.has_table(request_ledger.name):
        return LEDGER_VERSION
    if insp.has_table(request_feedback.name):
        rated = {c["name"] for c in insp.get_columns(request_feedback.name)}
        if "release_digest" not in rated:
            return 4
        columns = {c["name"] for c in insp.get_columns(request_ledger.name)}
        if "max_tokens" not in columns:
            return 5
        indexes = {i["name"] for i in insp.get_indexes(request_ledger.name)}
        return 7 if "ix_ledger_base_time" in indexes else 6
    columns = {c["name"] for c in insp.get_columns(request_ledger.name)}
    if "served_digest" in columns:
        return 3
    return 2 if "release_digest" in columns else 1


def _ledger_1_to_2(conn: Connection) -> None:
    add_column(conn, request_ledger.c.release_digest)
    index_named(request_ledger, "ix_ledger_release_time").create(conn)


def _ledger_2_to_3(conn: Connection) -> None:
    add_column(conn, request_ledger.c.served_digest)
    index_named(request_ledger, "ix_ledger_served_time").create(conn)
    if conn.dialect.name == "postgresql":  # SQLite does not enforce VARCHAR lengths
        conn.exec_driver_sql("ALTER TABLE request_ledger ALTER COLUMN outcome TYPE VARCHAR(32)")


def _ledger_3_to_4(conn: Connection) -> None:
    # The table as version 4 made it: version 5's column is added by the next step, so a
    # ledger upgraded from 3 ends exactly like one upgraded from 4.
    sa.Table(request_feedback.name, sa.MetaData(),
             sa.Column("request_id", sa.String(36), primary_key=True),
             sa.Column("tenant", sa.String(128), nullable=False),
             sa.Column("success", sa.Boolean, nullable=False),
             sa.Column("rated_at", sa.Float, nullable=False)).create(conn)


def _ledger_4_to_5(conn: Connection) -> None:
    # Ratings already held keep a NULL release: no window counts them (see the table).
    add_column(conn, request_feedback.c.release_digest)


def _ledger_5_to_6(conn: Connection) -> None:
    # Rows already held keep NULL: what they were sampled with was not recorded.
    for column in ("max_tokens", "temperature", "top_p", "seed"):
        add_column(conn, request_ledger.c[column])


def _ledger_6_to_7(conn: Connection) -> None:
    # checkfirst: a ledger written by a build that declared the index but not yet the version
    # has it already
    index_named(request_ledger, "ix_ledger_base_time").create(conn, checkfirst=True)


LEDGER_VERSION = 7
LEDGER = declare(Component("ledger", LEDGER_VERSION, metadata, _ledger_version,
                           steps={1: _ledger_1_to_2, 2: _ledger_2_to_3, 3: _ledger_3_to_4,
                                  4: _ledger_4_to_5, 5: _ledger_5_to_6, 6: _ledger_6_to_7}))


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
    ``busy``/``memory_refusals``: refusals for want of capacity (``BUSY_REASON``,
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
        with self.engine.begin() as conn:
            conn.execute(adapter_loads.insert(), [{f: getattr(load, f)
                                                   for f in AdapterLoad.__dataclass_fields__}])

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
            busy=sum(1 for r in found if r.reason == BUSY_REASON),
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
