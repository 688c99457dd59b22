"""CLI verbs for this area; registered on the typer apps of control.cli."""

from __future__ import annotations
