"""The ``loraplane`` command. Each verb module registers its verbs on the typer apps of
``control.cli.base`` when imported; importing them here, and nowhere else, keeps the dependency
one way (verbs -> base) and every verb module free of heavy imports until its verb runs.

The verb modules keep their annotations as objects (no ``from __future__ import annotations``):
typer builds every verb from its annotations at each start, and string annotations would cost
it an ``eval`` each, tens of milliseconds of every command.

:func:`run` is the program (the ``loraplane`` script, ``python -m control.cli.main``); ``app``
is the typer app itself, for tests to invoke in their own process. A command's process also
ends quickly: see :func:`finish_at_exit`, which only :func:`run` installs.
"""

from __future__ import annotations

import atexit
import gc
import sys

# typer lists the verbs of a group in `--help` in the order they were registered: `tenants`
# first puts `tenant create` and `grant` at the head of their lists.
from control.cli import tenants  # noqa: F401  # isort: skip
from control.cli import (  # noqa: F401  (imported for their registrations)
    adapters,
    aliases,
    audit,
    benches,
    cache,
    console,
    credentials,
    database,
    gate,
    hosts,
    ops,
    receipts,
    rollouts,
    root_keys,
    selftest,
    upgrades,
)
from control.cli.base import app

__all__ = ["app", "run"]


def finish_at_exit() -> None:
    """Run at exit: close what the verb left open, then spare the interpreter's shutdown its
    garbage collections.

    A verb that opened the registry leaves some 800 modules behind, and the collections Python
    runs while tearing them down took a third of a second on two busy cores (0.17 s after
    ``adapter list``), after the verb's work was done. Here the verb's garbage is collected once
    and the database connections are closed, as the shutdown would have done; ``gc.freeze``
    then leaves the remaining objects to the end of the process, as the operating system ends
    any process."""
    db = sys.modules.get("control.contracts.db")
    if db is not None:  # only a verb that opened a database holds connections
        db.dispose_engines()
    gc.collect()
    gc.freeze()


def run() -> None:
    """The ``loraplane`` program: run one command, then end the process quickly.

    The exit hook is installed here, not when this module is imported: a test process that
    invokes ``app`` keeps its own shutdown, garbage collections and all."""
    atexit.register(finish_at_exit)
    app()


if __name__ == "__main__":
    run()
