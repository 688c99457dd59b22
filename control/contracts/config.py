"""Where loraplane keeps its state, configured by environment variables.

``LORAPLANE_HOME`` (default ``./.loraplane``) holds the SQLite database, the artifact store and the
ticket keys. ``LORAPLANE_DB_URL`` overrides the database (one URL for the event store, the
projections and the request ledger). Every process of a deployment reads the same two variables.

Separate credentials (PostgreSQL only; ``loraplane db roles`` creates the roles): the control
plane uses ``LORAPLANE_DB_URL``; a Triton host uses ``LORAPLANE_HOST_DB_URL`` (its own login role,
named by its host id) and a gateway's routing reads and ledger reads use
``LORAPLANE_GATEWAY_DB_URL``. Unset, each falls back to ``LORAPLANE_DB_URL``: the embedded SQLite
default has no roles, so there one URL serves every part.

Ticket lifetime: ``LORAPLANE_TICKET_TTL_S`` (default 300) is what a gateway signs;
``LORAPLANE_TICKET_MAX_TTL_S`` (default 300, at most 3600) is the longest lifetime a Triton host
accepts, so neither a misconfigured gateway nor a leaked signing key can mint day-long tickets.
A lifetime above the cap, or one that is not a positive whole number of seconds, is refused when
the settings are read, before anything starts.

Session pins: ``LORAPLANE_SESSION_TTL_S`` (default 3600, at most 7 days) is how long a session
keeps the release it first resolved (``control.domain.session``), counted from when it was
pinned; a request without a session id is never pinned. Not a positive whole number of seconds,
or above the ceiling: refused when the settings are read.

Adapter memory on a Triton host (see ``backend/serving/memory.py`` for how the plan is computed):
``LORAPLANE_ADAPTER_BYTES`` (device bytes for the adapter slot banks; unset: a share of the device
memory left after the base weights), ``LORAPLANE_ADAPTER_SLOTS`` (cap on resident adapters,
default 64), ``LORAPLANE_MAX_RANK`` (default 64; every slot is padded to it) and
``LORAPLANE_TENANT_RESIDENT_SHARE`` (the part of the adapter memory one tenant may hold, default
0.5, never less than one slot). A malformed value is refused when the settings are read.
``LORAPLANE_WARMUP_ADAPTERS`` (default 0: off): after a restart, a host loads up to that many
of the adapters its device slots held when it last ran before traffic arrives
(``backend.serving.warmup``).

Timing settings (:func:`check_timing_settings`, called first thing when ``serve`` starts and
whenever a gateway's cached routing view reads them). The product promises that an API key
revocation, a grant removal, an alias revocation and a signing key retirement take effect at
every gateway within 1 s (``IN_FORCE_WITHIN_S``). On that path a change waits for the
projection follower (it polls every ``FOLLOWER_POLL_S``), then for the gateway to read the
projection's position (every ``LORAPLANE_ROUTE_REFRESH_MS``), then for the reload
(``RELOAD_ALLOWANCE_S``, a generous allowance for reading the tables on a loaded host):

- ``LORAPLANE_ROUTE_REFRESH_MS`` (default 20): 0 to 500. 100 + 500 + 200 ms stays within 1 s;
  anything longer could keep serving a revoked key or grant past the promise.
- ``LORAPLANE_ROUTE_MAX_STALE_MS`` (default 700): how long a gateway that cannot read the
  routing tables keeps serving its last copy before it answers 503. Above the refresh interval
  (else a healthy gateway would answer 503 between two reads), and at most 700: the copy may
  lack a change made meanwhile, so 100 + 700 + 200 ms must stay within 1 s too.
- ``LORAPLANE_SEAL_INTERVAL_S`` (default 60): how often ``serve`` signs an audit checkpoint, 1
  to 3600 s (not a 1 s promise: it bounds how long the newest events stay unsealed, so at most
  an hour; below a second the sealer would only poll the event store for nothing).

A value out of its bounds is a :class:`ConfigError` naming the variable, the bound and why.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from control.contracts.wire import MODEL

DEFAULT_TICKET_TTL_S = 300
DEFAULT_TICKET_MAX_TTL_S = 300
# Tickets live minutes (design): even an operator cannot raise the cap past an hour.
CEILING_TICKET_MAX_TTL_S = 3600
DEFAULT_SESSION_TTL_S = 3600
# A pin outliving a week is a release nobody re-resolves: cap it like the ticket lifetime.
CEILING_SESSION_TTL_S = 7 * 24 * 3600
DEFAULT_MAX_RANK = 64
DEFAULT_ADAPTER_SLOTS = 64
DEFAULT_RESIDENT_SHARE = 0.5
DEFAULT_WARMUP_ADAPTERS = 0  # opt-in: a restarted host then preloads what it held
TICKET_TTL_ENV = "LORAPLANE_TICKET_TTL_S"
TICKET_MAX_TTL_ENV = "LORAPLANE_TICKET_MAX_TTL_S"
SESSION_TTL_ENV = "LORAPLANE_SESSION_TTL_S"
MAX_RANK_ENV = "LORAPLANE_MAX_RANK"
ADAPTER_BYTES_ENV = "LORAPLANE_ADAPTER_BYTES"
ADAPTER_SLOTS_ENV = "LORAPLANE_ADAPTER_SLOTS"
RESIDENT_SHARE_ENV = "LORAPLANE_TENANT_RESIDENT_SHARE"
WARMUP_ENV = "LORAPLANE_WARMUP_ADAPTERS"
# What a Triton host serves and how its ledger rows name it; ``serve`` sets them, the backend
# reads them (here, not in the backend, so starting a host does not import the engine).
BASE_DIGEST_ENV = "LORAPLANE_BASE_DIGEST"
HOST_ID_ENV = "LORAPLANE_HOST_ID"  # the ledger's host column (default: the hostname)
HOST_DB_URL_ENV = "LORAPLANE_HOST_DB_URL"  # a Triton host's own database credential
GATEWAY_DB_URL_ENV = "LORAPLANE_GATEWAY_DB_URL"  # the gateway's read-mostly credential
# Where a Triton host sits: its pool (``shared``, or a tenant's dedicated pool) and region. A host
# refuses any ticket that does not name its pool and allow its region (control.contracts.tickets).
HOST_POOL_ENV = "LORAPLANE_HOST_POOL"
HOST_REGION_ENV = "LORAPLANE_HOST_REGION"
SHARED_POOL = "shared"
DEFAULT_REGION = "local"
PLACEMENT_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_BYTE_UNITS = {"": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_BYTES_RE = re.compile(r"^(\d+)\s*(KiB|MiB|GiB|TiB)?$")


class ConfigError(ValueError):
    """A setting is missing its form or its range; the message names the variable."""


# -- timing settings and the 1 s promises (see the module notes) ------------------------------

IN_FORCE_WITHIN_S = 1.0  # key/grant/alias revocation, key retirement: at every gateway
# projections.follower.ProjectionFollower.run's interval, as ``serve`` runs it (a test checks
# that the follower's default is no longer).
FOLLOWER_POLL_S = 0.1
RELOAD_ALLOWANCE_S = 0.2  # reading the position and reloading the routing snapshot
ROUTE_REFRESH_ENV = "LORAPLANE_ROUTE_REFRESH_MS"
ROUTE_MAX_STALE_ENV = "LORAPLANE_ROUTE_MAX_STALE_MS"
SEAL_INTERVAL_ENV = "LORAPLANE_SEAL_INTERVAL_S"
DEFAULT_ROUTE_REFRESH_MS = 20.0
ROUTE_REFRESH_MAX_MS = 500.0
DEFAULT_ROUTE_MAX_STALE_MS = 700.0
ROUTE_MAX_STALE_MAX_MS = 700.0
DEFAULT_SEAL_INTERVAL_S = 60.0
SEAL_INTERVAL_MIN_S, SEAL_INTERVAL_MAX_S = 1.0, 3600.0


@dataclass(frozen=True)
class RouteTiming:
    """How often a gateway re-reads the routing projection, and how long it serves its last
    copy when the tables cannot be read (both in seconds)."""

    refresh_s: float = DEFAULT_ROUTE_REFRESH_MS / 1000
    max_stale_s: float = DEFAULT_ROUTE_MAX_STALE_MS / 1000


@dataclass(frozen=True)
class TimingSettings:
    route: RouteTiming
    seal_interval_s: float


def in_force_within_s(gateway_delay_s: float) -> float:
    """The longest a recorded change can take to reach a gateway's answers when the gateway
    itself adds ``gateway_delay_s`` (its refresh interval, or the staleness it allows): the
    follower's poll, that delay and the reload. The bounds above keep it within 1 s."""
    return FOLLOWER_POLL_S + gateway_delay_s + RELOAD_ALLOWANCE_S


def env_number(name: str, default: float, unit: str, *, above: float | None = None,
               at_most: float | None = None) -> float:
    """The finite number of ``unit`` that environment variable ``name`` holds (unset or blank:
    ``default``), within (``above``, ``at_most``] where given; else ConfigError naming it."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    bounds = "".join((f" above {above:g}" if above is not None else "",
                      " and" if above is not None and at_most is not None else "",
                      f" at most {at_most:g}" if at_most is not None else ""))
    if not math.isfinite(value) or (above is not None and value <= above) or (
            at_most is not None and value > at_most):
        raise ConfigError(f"{name} must be a finite number of {unit}{bounds}, not {raw!r}")
    return value


def _milliseconds(name: str, default: float) -> float:
    return env_number(name, default, "milliseconds")


def check_route_timing(refresh_s: float, max_stale_s: float) -> None:
    """Raise ConfigError unless the staleness allowed exceeds the refresh interval (both >= 0):
    a copy confirmed at one read must still serve until the next one, or a healthy gateway
    answers 503 between reads. Holds for every cached routing view, however configured."""
    if not (math.isfinite(refresh_s) and refresh_s >= 0):
        raise ConfigError(f"{ROUTE_REFRESH_ENV} must be 0 or more, not {refresh_s * 1000:g} ms")
    if not (math.isfinite(max_stale_s) and max_stale_s > refresh_s):
        raise ConfigError(
            f"{ROUTE_MAX_STALE_ENV}={max_stale_s * 1000:g} must be above "
            f"{ROUTE_REFRESH_ENV}={refresh_s * 1000:g}: the routing copy is confirmed only "
            "when the gateway re-reads the tables, so a shorter staleness allowance makes a "
            "healthy gateway answer 503 between reads")


def route_timing_from_env() -> RouteTiming:
    """``LORAPLANE_ROUTE_REFRESH_MS`` and ``LORAPLANE_ROUTE_MAX_STALE_MS``, checked against the
    1 s promises (see the module notes); ConfigError naming the variable, bound and why."""
    refresh_ms = _milliseconds(ROUTE_REFRESH_ENV, DEFAULT_ROUTE_REFRESH_MS)
    if not 0 <= refresh_ms <= ROUTE_REFRESH_MAX_MS:
        raise ConfigError(
            f"{ROUTE_REFRESH_ENV} must be between 0 and {ROUTE_REFRESH_MAX_MS:g} ms, not "
            f"{refresh_ms:g}: a revoked API key, a removed grant, a revoked alias or a retired "
            f"signing key must stop getting tickets within {IN_FORCE_WITHIN_S:g} s, and a "
            f"change waits for the projection follower ({FOLLOWER_POLL_S * 1000:g} ms), this "
            f"interval and the reload ({RELOAD_ALLOWANCE_S * 1000:g} ms)")
    stale_ms = _milliseconds(ROUTE_MAX_STALE_ENV, DEFAULT_ROUTE_MAX_STALE_MS)
    if not 0 < stale_ms <= ROUTE_MAX_STALE_MAX_MS:
        raise ConfigError(
            f"{ROUTE_MAX_STALE_ENV} must be above 0 and at most {ROUTE_MAX_STALE_MAX_MS:g} ms, "
            f"not {stale_ms:g}: a gateway that cannot read the routing tables serves its last "
            "copy this long, and that copy may lack a revocation that must be in force within "
            f"{IN_FORCE_WITHIN_S:g} s")
    timing = RouteTiming(refresh_ms / 1000, stale_ms / 1000)
    check_route_timing(timing.refresh_s, timing.max_stale_s)
    return timing


def seal_interval_from_env() -> float:
    """``LORAPLANE_SEAL_INTERVAL_S`` in seconds (default 60), between 1 and 3600."""
    raw = os.environ.get(SEAL_INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_SEAL_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{SEAL_INTERVAL_ENV} must be a number of seconds, not {raw!r}") \
            from None
    if not SEAL_INTERVAL_MIN_S <= value <= SEAL_INTERVAL_MAX_S:  # NaN fails this too
        raise ConfigError(
            f"{SEAL_INTERVAL_ENV} must be between {SEAL_INTERVAL_MIN_S:g} and "
            f"{SEAL_INTERVAL_MAX_S:g} seconds, not {raw}: it bounds how long the newest events "
            "stay without a signed audit checkpoint (at most an hour), and a shorter one would "
            "only poll the event store")
    return value


def check_timing_settings() -> TimingSettings:
    """Every timing setting the gateway and the control plane honour, read from the environment
    and checked against the promises they keep (module notes); ConfigError for the first that
    is out of bounds. Ticket and session lifetimes are checked by :class:`Settings`."""
    return TimingSettings(route=route_timing_from_env(), seal_interval_s=seal_interval_from_env())


@dataclass(frozen=True)
class Settings:
    home: Path
    db_url: str
    max_rank: int = DEFAULT_MAX_RANK
    ticket_ttl_s: int = DEFAULT_TICKET_TTL_S
    ticket_max_ttl_s: int = DEFAULT_TICKET_MAX_TTL_S
    model_name: str = MODEL  # the model name tickets are bound to
    adapter_bytes: int | None = None  # None: derived from the device's memory
    adapter_slots: int = DEFAULT_ADAPTER_SLOTS
    resident_share: float = DEFAULT_RESIDENT_SHARE
    warmup_adapters: int = DEFAULT_WARMUP_ADAPTERS  # preloaded after a restart (0: none)
    session_ttl_s: int = DEFAULT_SESSION_TTL_S  # how long a session keeps its release
    # The Triton hosts' and the gateways' own URLs (None: ``db_url``), see the module notes.
    # Out of the repr: a URL may carry its password, and settings end up in log lines.
    host_db: str | None = field(default=None, repr=False)
    gateway_db: str | None = field(default=None, repr=False)
    host_pool: str = SHARED_POOL  # this Triton host's pool and region (see HOST_POOL_ENV)
    host_region: str = DEFAULT_REGION

    def __post_init__(self) -> None:
        for name, value in ((HOST_POOL_ENV, self.host_pool), (HOST_REGION_ENV, self.host_region)):
            check_placement_name(name, value)
        check_ticket_lifetime(self.ticket_ttl_s, self.ticket_max_ttl_s)
        check_session_ttl(self.session_ttl_s)
        check_adapter_memory_settings(self.max_rank, self.adapter_bytes, self.adapter_slots,
                                      self.resident_share)
        if not isinstance(self.warmup_adapters, int) or not 0 <= self.warmup_adapters <= 4096:
            raise ConfigError(f"{WARMUP_ENV} must be a whole number from 0 to 4096, "
                              f"not {self.warmup_adapters!r}")

    @staticmethod
    def check_timing() -> TimingSettings:
        """:func:`check_timing_settings`, reachable wherever the settings are (``serve``)."""
        return check_timing_settings()

    def memory_env(self) -> dict[str, str]:
        """The adapter memory settings as environment variables, for a Triton host started from
        these settings: the plan ``serve`` checks before launch is the one the engine builds."""
        return {
            MAX_RANK_ENV: str(self.max_rank),
            ADAPTER_BYTES_ENV: "" if self.adapter_bytes is None else str(self.adapter_bytes),
            ADAPTER_SLOTS_ENV: str(self.adapter_slots),
            RESIDENT_SHARE_ENV: repr(self.resident_share),
            WARMUP_ENV: str(self.warmup_adapters),
        }

    @property
    def host_db_url(self) -> str:
        """What a Triton host connects with (``LORAPLANE_HOST_DB_URL``, else ``db_url``)."""
        return self.host_db or self.db_url

    @property
    def gateway_db_url(self) -> str:
        """What a gateway reads with (``LORAPLANE_GATEWAY_DB_URL``, else ``db_url``)."""
        return self.gateway_db or self.db_url

    @property
    def store_dir(self) -> Path:
        return self.home / "store"

    @property
    def keys_dir(self) -> Path:
        return self.home / "keys"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @classmethod
    def from_env(cls, home: Path | None = None) -> Settings:
        """Settings from the environment; ``home`` overrides ``LORAPLANE_HOME``.

        Raises ConfigError for a ticket lifetime that is malformed or above its cap, and for
        adapter memory settings that are malformed or out of range."""
        home = (home or Path(os.environ.get("LORAPLANE_HOME", ".loraplane"))).resolve()
        db_url = os.environ.get("LORAPLANE_DB_URL") or f"sqlite:///{home / 'loraplane.db'}"
        return cls(
            home=home,
            db_url=db_url,
            max_rank=_whole(MAX_RANK_ENV, DEFAULT_MAX_RANK),
            ticket_ttl_s=_seconds(TICKET_TTL_ENV, DEFAULT_TICKET_TTL_S),
            ticket_max_ttl_s=_seconds(TICKET_MAX_TTL_ENV, DEFAULT_TICKET_MAX_TTL_S),
            adapter_bytes=_bytes(ADAPTER_BYTES_ENV),
            adapter_slots=_whole(ADAPTER_SLOTS_ENV, DEFAULT_ADAPTER_SLOTS),
            resident_share=_fraction(RESIDENT_SHARE_ENV, DEFAULT_RESIDENT_SHARE),
            warmup_adapters=_whole(WARMUP_ENV, DEFAULT_WARMUP_ADAPTERS),
            session_ttl_s=_seconds(SESSION_TTL_ENV, DEFAULT_SESSION_TTL_S),
            host_db=os.environ.get(HOST_DB_URL_ENV) or None,
            gateway_db=os.environ.get(GATEWAY_DB_URL_ENV) or None,
            host_pool=os.environ.get(HOST_POOL_ENV, "").strip() or SHARED_POOL,
            host_region=os.environ.get(HOST_REGION_ENV, "").strip() or DEFAULT_REGION,
        )

    def ensure_dirs(self) -> None:
        for d in (self.home, self.store_dir, self.keys_dir, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)


def check_placement_name(what: str, value: object) -> None:
    """A pool or region name: lower-case letters, digits and dashes, at most 63 characters."""
    if not isinstance(value, str) or not PLACEMENT_NAME_RE.match(value):
        raise ConfigError(f"{what} must be lower-case letters, digits and dashes (at most 63), "
                          f"not {value!r}")


def _seconds(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number of seconds, not {raw!r}") from None


def _whole(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, not {raw!r}") from None


def _bytes(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    found = _BYTES_RE.match(raw)
    if found is None:
        raise ConfigError(f"{name} must be a whole number of bytes, optionally with a unit "
                          f"(KiB, MiB, GiB, TiB; for example 24GiB), not {raw!r}")
    return int(found.group(1)) * _BYTE_UNITS[found.group(2) or ""]


def _fraction(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number between 0 and 1, not {raw!r}") from None


def check_adapter_memory_settings(max_rank: int, adapter_bytes: int | None, adapter_slots: int,
                                  resident_share: float) -> None:
    """Raise ConfigError for adapter memory settings out of range (the plan itself, whether
    they hold one adapter on a given base and device, is ``backend.serving.memory``'s to check)."""
    if type(max_rank) is not int or max_rank < 1:
        raise ConfigError(f"{MAX_RANK_ENV} must be a positive whole number, not {max_rank!r}")
    if adapter_bytes is not None and (type(adapter_bytes) is not int or adapter_bytes < 1):
        raise ConfigError(f"{ADAPTER_BYTES_ENV} must be a positive number of bytes, "
                          f"not {adapter_bytes!r}")
    if type(adapter_slots) is not int or adapter_slots < 1:
        raise ConfigError(f"{ADAPTER_SLOTS_ENV} must be a positive whole number, "
                          f"not {adapter_slots!r}")
    if not 0.0 < resident_share <= 1.0:
        raise ConfigError(f"{RESIDENT_SHARE_ENV} must be above 0 and at most 1, "
                          f"not {resident_share!r}")


def check_session_ttl(ttl_s: int) -> None:
    """Raise ConfigError unless 0 < ttl_s <= CEILING_SESSION_TTL_S (whole seconds)."""
    if type(ttl_s) is not int or ttl_s <= 0:
        raise ConfigError(f"{SESSION_TTL_ENV} must be a positive whole number of seconds, "
                          f"not {ttl_s!r}")
    if ttl_s > CEILING_SESSION_TTL_S:
        raise ConfigError(f"{SESSION_TTL_ENV} is at most {CEILING_SESSION_TTL_S} seconds "
                          f"(7 days), not {ttl_s}")


def check_ticket_lifetime(ttl_s: int, max_ttl_s: int) -> None:
    """Raise ConfigError unless 0 < ttl_s <= max_ttl_s <= CEILING_TICKET_MAX_TTL_S."""
    for name, value in ((TICKET_TTL_ENV, ttl_s), (TICKET_MAX_TTL_ENV, max_ttl_s)):
        if type(value) is not int or value <= 0:
            raise ConfigError(f"{name} must be a positive whole number of seconds, not {value!r}")
    if max_ttl_s > CEILING_TICKET_MAX_TTL_S:
        raise ConfigError(f"{TICKET_MAX_TTL_ENV} is at most {CEILING_TICKET_MAX_TTL_S} seconds "
                          f"(tickets live minutes), not {max_ttl_s}")
    if ttl_s > max_ttl_s:
        raise ConfigError(f"{TICKET_TTL_ENV}={ttl_s} is above the ticket lifetime cap "
                          f"{TICKET_MAX_TTL_ENV}={max_ttl_s}: Triton hosts would refuse every "
                          "ticket; lower the lifetime or raise the cap")
