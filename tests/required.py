"""What the suite needs from the machine, and what happens when it is missing.

Locally, a test whose tool is missing (tritonserver, PostgreSQL, docker-compose, haproxy, curl,
the package index) is skipped with a reason. In CI (``CI`` set to anything but empty, ``0``,
``false`` or ``no``; ``.ci/run`` sets ``CI=true``), it fails instead, with the same reason: CI
installs every one of them, so a missing one means the run would pass without the tests that
guard it.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

CI_ENV = "CI"


def in_ci() -> bool:
    return os.environ.get(CI_ENV, "").strip().lower() not in ("", "0", "false", "no")


def unavailable(what: str, reason: str) -> NoReturn:
    """Skip (locally) or fail (in CI) a test that needs ``what``."""
    message = f"{what} not available: {reason}"
    if in_ci():
        pytest.fail(f"{message} ({CI_ENV} is set: CI installs {what}, so this is a failure)",
                    pytrace=False)
    pytest.skip(message)
