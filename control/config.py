"""Where loraplane keeps its state, configured by environment variables.

``LORAPLANE_HOME`` (default ``./.loraplane``) holds the SQLite database, the artifact store and the
ticket keys. ``LORAPLANE_DB_URL`` overrides the database (one URL for the event store, the
projections and the request ledger). Every process of a deployment reads the same two variables.

Ticket lifetime: ``LORAPLANE_TICKET_TTL_S`` (default 300) is what a gateway signs;
``LORAPLANE_TICKET_MAX_TTL_S`` (default 300, at most 3600) is the longest lifetime a Triton host
accepts, so neither a misconfigured gateway nor a leaked signing key can mint day-long tickets.
A lifetime above the cap, or one that is not a positive whole number of seconds, is refused when
the settings are read, before anything starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TICKET_TTL_S = 300
DEFAULT_TICKET_MAX_TTL_S = 300
# Tickets live minutes (design): even an operator cannot raise the cap past an hour.
CEILING_TICKET_MAX_TTL_S = 3600
DEFAULT_MAX_RANK = 64
MODEL_NAME = "lora_llm"
TICKET_TTL_ENV = "LORAPLANE_TICKET_TTL_S"
TICKET_MAX_TTL_ENV = "LORAPLANE_TICKET_MAX_TTL_S"


class ConfigError(ValueError):
    """A setting is missing its form or its range; the message names the variable."""


@dataclass(frozen=True)
class Settings:
    home: Path
    db_url: str
    max_rank: int = DEFAULT_MAX_RANK
    ticket_ttl_s: int = DEFAULT_TICKET_TTL_S
    ticket_max_ttl_s: int = DEFAULT_TICKET_MAX_TTL_S
    model_name: str = MODEL_NAME

    def __post_init__(self) -> None:
        check_ticket_lifetime(self.ticket_ttl_s, self.ticket_max_ttl_s)

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

        Raises ConfigError for a ticket lifetime that is malformed or above its cap."""
        home = (home or Path(os.environ.get("LORAPLANE_HOME", ".loraplane"))).resolve()
        db_url = os.environ.get("LORAPLANE_DB_URL") or f"sqlite:///{home / 'loraplane.db'}"
        return cls(
            home=home,
            db_url=db_url,
            max_rank=int(os.environ.get("LORAPLANE_MAX_RANK", DEFAULT_MAX_RANK)),
            ticket_ttl_s=_seconds(TICKET_TTL_ENV, DEFAULT_TICKET_TTL_S),
            ticket_max_ttl_s=_seconds(TICKET_MAX_TTL_ENV, DEFAULT_TICKET_MAX_TTL_S),
        )

    def ensure_dirs(self) -> None:
        for d in (self.home, self.store_dir, self.keys_dir, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)


def _seconds(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a whole number of seconds, not {raw!r}") from None


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
