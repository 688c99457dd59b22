"""The projection tables: the one place that knows their names and columns.

SQLAlchemy Core tables on their own ``MetaData``, bound to no engine, so the same definitions
serve the live database and a scratch database that a rebuild replays into.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from control.contracts.schema import Component, declare, open_component

metadata = sa.MetaData()

# The projections' schema version (control.contracts.schema, component ``projections``). Raise
# it whenever a table or column below changes: a database at an older version is then dropped and
# rebuilt
# from the event store by ``loraplane db upgrade`` (the rows are derived, so nothing is lost).
# 2: ``signing_keys.retired_at``. 3: ``tenants.tickets_not_before``. 4: ``session_pins`` and
# ``routes.fallback``. 5: ``revocations.immediate``. 6: ``signing_keys.root_signature``. 7:
# ``tenants.pool`` and ``tenants.regions``. 8: ``tenants.resident_share`` and
# ``tenants.loads_per_minute``. 9: ``routing_changes``. 10: ``tenants.max_replicas``. A new
# version also teaches ``detect_version`` its columns.
SCHEMA_VERSION = 10

_digest = sa.String(71)  # "sha256:" + 64 hex
_name = sa.String(64)
_ts = sa.DateTime(timezone=True)

# An alias: its stable release and optional canary release (manifest digests). Whether a
# release is servable is read from its adapter's state at resolution time.
routes = sa.Table(
    "routes", metadata,
    sa.Column("alias", _name, primary_key=True),
    sa.Column("owner", _name, nullable=True),  # None: an operator's base-only alias
    sa.Column("stable_release", _digest, nullable=True),
    sa.Column("canary_release", _digest, nullable=True),
    sa.Column("canary_percent", sa.Integer, nullable=False),
    # What the alias serves after its stable release's adapter is revoked (a FallbackPolicy).
    sa.Column("fallback", sa.String(8), nullable=False),
)

releases = sa.Table(
    "releases", metadata,
    sa.Column("digest", _digest, primary_key=True),
    sa.Column("tenant", _name, nullable=True),  # None: base-only release
    sa.Column("adapter_digest", _digest, nullable=True, index=True),  # None: the base alone
    sa.Column("base_digest", _digest, nullable=False),
    sa.Column("tokenizer_digest", _digest, nullable=False),
    sa.Column("chat_template_digest", _digest, nullable=True),
    sa.Column("inference_defaults", sa.Text, nullable=False),  # canonical JSON
    sa.Column("evaluation_report_digest", _digest, nullable=True),
    sa.Column("created_at", _ts, nullable=False),
)

grants = sa.Table(
    "grants", metadata,
    sa.Column("tenant", _name, primary_key=True),
    sa.Column("alias", _name, primary_key=True),
)

api_keys = sa.Table(
    "api_keys", metadata,
    sa.Column("key_hash", sa.String(64), primary_key=True),
    sa.Column("tenant", _name, nullable=False, index=True),
)

tenants = sa.Table(
    "tenants", metadata,
    sa.Column("name", _name, primary_key=True),
    sa.Column("created_at", _ts, nullable=False),
    # When the tenant's credentials last lost something (an API key rotated or revoked, a
    # grant removed), as epoch seconds: Triton hosts refuse the tenant's tickets issued at or
    # before it, so the change takes effect on tickets already out, not only on new ones.
    sa.Column("tickets_not_before", sa.Float, nullable=True),
    # Placement, from the tenant's policy (issue 25): its dedicated pool (None: the shared one)
    # and the regions its requests may run in (comma-separated; "": any).
    sa.Column("pool", _name, nullable=True),
    sa.Column("regions", sa.Text, nullable=False, default="", server_default=""),
    # Fair sharing of the hosts' adapter cache, from the tenant's policy (issue 24; None: the
    # host's defaults): the part of a host's adapter memory its adapters may hold, and the cold
    # loads per minute its requests may start.
    sa.Column("resident_share", sa.Float, nullable=True),
    sa.Column("loads_per_minute", sa.Float, nullable=True),
    # How many hosts may hold one of its adapters in a device slot at once (None: no bound).
    sa.Column("max_replicas", sa.Integer, nullable=True),
)

adapters = sa.Table(
    "adapters", metadata,
    sa.Column("digest", _digest, primary_key=True),
    sa.Column("tenant", _name, nullable=False, index=True),
    sa.Column("alias", _name, nullable=False),
    sa.Column("base_digest", _digest, nullable=False),
    sa.Column("tokenizer_digest", _digest, nullable=False),
    sa.Column("state", sa.String(32), nullable=False),
    sa.Column("rank", sa.Integer, nullable=False),
    sa.Column("registered_at", _ts, nullable=False),
    sa.Column("owner", sa.String(200), nullable=False),
    sa.Column("training_data_version", sa.String(200), nullable=False, index=True),
    sa.Column("licence", sa.String(200), nullable=False),
    sa.Column("allowed_tasks", sa.Text, nullable=False),  # comma-separated task names
    sa.Column("signature", sa.String(32), nullable=True),  # verification method, if signed
    sa.Column("evaluation_report_digest", _digest, nullable=True),
    sa.Column("release_digest", _digest, nullable=True),
)

# The serving side's work after a revocation: one row per (digest, host, step).
serving_steps = sa.Table(
    "serving_steps", metadata,
    sa.Column("digest", _digest, primary_key=True),
    sa.Column("host", _name, primary_key=True),
    sa.Column("step", sa.String(16), primary_key=True),  # drained | purged | unloaded
    sa.Column("at", _ts, nullable=False),
)

bases = sa.Table(
    "bases", metadata,
    sa.Column("digest", _digest, primary_key=True),
    sa.Column("name", _name, nullable=False, unique=True),
    sa.Column("tokenizer_digest", _digest, nullable=False),
)

revocations = sa.Table(
    "revocations", metadata,
    sa.Column("digest", _digest, primary_key=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("revoked_at", _ts, nullable=False),
    # The kill switch (``adapter revoke --immediate``): hosts end running work on the digest
    # too, instead of letting it drain. Set by the revocation or by a later escalation.
    sa.Column("immediate", sa.Boolean, nullable=False),
)

# Every recorded ticket-signing key; ``retired_at`` is set once it is retired (hosts refuse
# its tickets, gateways stop signing with it, and its public file is removed from hosts).
signing_keys = sa.Table(
    "signing_keys", metadata,
    sa.Column("kid", _name, primary_key=True),
    sa.Column("public_key", sa.Text, nullable=False),
    sa.Column("created_at", _ts, nullable=False),
    sa.Column("retired_at", _ts, nullable=True),
    # The offline root's signature over the record (control.contracts.root_of_trust): readers
    # trust the key only if it verifies against the root of their configuration.
    sa.Column("root_signature", sa.Text, nullable=True),
)

# The release each session (tenant, alias, session id) keeps: control.domain.session. A pin
# that ended stays as a row with ``ended`` set, so a reader that loads changed rows only
# (projections.route_cache) learns of the end too. ``expires_at`` in epoch seconds.
# ``version``: the SessionPin aggregate's version this row last applied. ``changed``: a counter
# over this table, raised on every write (followers write one batch at a time, under the
# tracking lock), so a reader asks for the rows changed since the last value it saw.
session_pins = sa.Table(
    "session_pins", metadata,
    sa.Column("tenant", _name, primary_key=True),
    sa.Column("alias", _name, primary_key=True),
    sa.Column("session", sa.String(128), primary_key=True),
    sa.Column("release", _digest, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("ended", sa.Boolean, nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("pinned_at", _ts, nullable=False),
    sa.Column("changed", sa.BigInteger, nullable=False, index=True),
    sa.Index("ix_session_pins_alias_release", "alias", "release"),
)

# Position of each projection in the event store's notification log. Written in the same
# transaction as the view rows it accounts for. The follower's row is named TRACKING_NAME; readers
# (the gateway's cache, the hosts' governance view) read it as the projections' change stamp.
TRACKING_NAME = "routing"
# PostgreSQL NOTIFY channel: a projection batch committed (payload: the new position).
CHANGE_CHANNEL = "loraplane_projection"
projection_tracking = sa.Table(
    "projection_tracking", metadata,
    sa.Column("name", sa.String(32), primary_key=True),
    sa.Column("position", sa.BigInteger, nullable=False),
)

# What each projection batch changed of the tables the gateway's route cache holds
# (``projections.route_cache``): one row per (kind, key) a batch touched, at the batch's last
# position, written in the batch's transaction (``projections.writers.changes``). A reader at
# position P reloads only the keys of rows above P. Kinds: ``tenant`` (its API keys and
# placement), ``alias`` (its route and grants), ``release``, ``adapter`` (the releases of it),
# ``key`` (a signing key), and ``all`` (an event no kind describes: reload everything). The
# follower prunes old rows and records below which position the log is no longer complete
# (tracking row CHANGES_PRUNED); a reader older than that reloads everything.
routing_changes = sa.Table(
    "routing_changes", metadata,
    sa.Column("position", sa.BigInteger, primary_key=True),
    sa.Column("kind", sa.String(8), primary_key=True),
    sa.Column("key", sa.String(200), primary_key=True),
)
CHANGES_PRUNED = "routing_changes_pruned"

VIEW_TABLES: tuple[sa.Table, ...] = (
    routes, releases, grants, api_keys, tenants, adapters, bases, revocations, signing_keys,
    serving_steps, session_pins,
)


def detect_version(insp: sa.Inspector) -> int:
    """The version of projection tables found without a version row, read from the columns.

    The release before versions left version 1 (no ``signing_keys.retired_at``). Tables that
    already have it are the latest, caught between another process's CREATE and its version
    row (two first starts at once): they must not be mistaken for an old release.
    """
    def has(table: sa.Table, column: str) -> bool:
        return insp.has_table(table.name) and column in {
            c["name"] for c in insp.get_columns(table.name)}

    if not has(signing_keys, "retired_at"):
        return 1
    if not has(tenants, "tickets_not_before"):
        return 2
    if not (has(routes, "fallback") and insp.has_table(session_pins.name)):
        return 3
    if not has(revocations, "immediate"):
        return 4
    if not has(signing_keys, "root_signature"):
        return 5
    if not has(tenants, "pool"):
        return 6
    if not has(tenants, "resident_share"):
        return 7
    if not insp.has_table(routing_changes.name):
        return 8
    return 10 if has(tenants, "max_replicas") else 9


def create_tables(engine: Engine) -> None:
    """Create the projection tables on ``engine`` where missing, at ``SCHEMA_VERSION``.

    Raises ``control.contracts.schema.SchemaError`` when the database holds them at another version.
    """
    # Creation runs under the schema lock, so concurrent first starts never race on CREATE TABLE.
    open_component(engine, PROJECTIONS)


PROJECTIONS = declare(Component("projections", SCHEMA_VERSION, metadata, detect_version,
                                rebuildable=True))
