"""The ``loraplane`` command. Each verb module registers its verbs on the typer apps of
``control.cli.base`` when imported; importing them here, and nowhere else, keeps the dependency
one way (verbs -> base) and every verb module free of heavy imports until its verb runs."""

from __future__ import annotations

import sys

from control.cli import (  # noqa: F401  (imported for their registrations)
    credentials,
    database,
    engine_bench,
    ops,
    registry,
    selftest,
)
from control.cli.base import app

__all__ = ["app"]

if __name__ == "__main__":
    sys.exit(app())
