"""Where loraplane keeps its state, configured by environment variables.

``LORAPLANE_HOME`` (default ``./.loraplane``) holds the SQLite database, the artifact store and the
ticket keys. ``LORAPLANE_DB_URL`` overrides the database (one URL for the event store, the
projections and the request ledger). Every process of a deployment reads the same two variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TICKET_TTL_S = 300
DEFAULT_MAX_RANK = 64
MODEL_NAME = "lora_llm"


@dataclass(frozen=True)
class Settings:
    home: Path
    db_url: str
    max_rank: int = DEFAULT_MAX_RANK
    ticket_ttl_s: int = DEFAULT_TICKET_TTL_S
    model_name: str = MODEL_NAME

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
        """Settings from the environment; ``home`` overrides ``LORAPLANE_HOME``."""
        home = (home or Path(os.environ.get("LORAPLANE_HOME", ".loraplane"))).resolve()
        db_url = os.environ.get("LORAPLANE_DB_URL") or f"sqlite:///{home / 'loraplane.db'}"
        return cls(
            home=home,
            db_url=db_url,
            max_rank=int(os.environ.get("LORAPLANE_MAX_RANK", DEFAULT_MAX_RANK)),
            ticket_ttl_s=int(os.environ.get("LORAPLANE_TICKET_TTL_S", DEFAULT_TICKET_TTL_S)),
        )

    def ensure_dirs(self) -> None:
        for d in (self.home, self.store_dir, self.keys_dir, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)
