"""What a row-only writer returns: ``[(table, row), ...]`` to insert."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

# Events whose whole effect is new rows: ``event -> [(table, row), ...]``. ``apply`` inserts
# them one event at a time; ``apply_all`` gathers a run of them into one executemany per table
# (statement building, not the database, is what a replay spends its time on).
Rows = list[tuple[sa.Table, dict[str, Any]]]
