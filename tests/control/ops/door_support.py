"""What the front door's tests share: HAProxy or a clear skip (a failure where it is required)."""

from __future__ import annotations

import os

import pytest

from control.ops.front_door import HAPROXY_PACKAGE, find_haproxy
from tests.required import unavailable

# CI sets this (.ci/run): there a missing haproxy fails the tests instead of skipping them.
REQUIRE_ENV = "LORAPLANE_REQUIRE_HAPROXY"


def haproxy_or_skip() -> str:
    """The haproxy binary; else skip, or fail in CI (tests.required) or when
    ``LORAPLANE_REQUIRE_HAPROXY=1``."""
    found = find_haproxy()
    if found is not None:
        return found
    reason = (f"not installed (Debian/Ubuntu package {HAPROXY_PACKAGE}): the front door's "
              "tests need it")
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"haproxy {reason}, and {REQUIRE_ENV}=1 requires it")
    unavailable("haproxy", reason)
