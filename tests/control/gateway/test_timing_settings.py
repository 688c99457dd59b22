"""Timing settings are bounded by the promises they serve (control.contracts.config): an API key
revocation, a grant removal, an alias revocation and a key retirement are in force at every
gateway within 1 s. A setting that could break that, or that contradicts another (a staleness
allowance shorter than the refresh interval answered 503 between reads), is refused with a
ConfigError naming the variable, its bound and why: when ``serve`` starts, before anything
starts, and when a gateway's cached routing view reads the environment.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import sqlalchemy as sa

from control.contracts import config
from control.contracts.config import (
    ROUTE_MAX_STALE_ENV,
    ROUTE_REFRESH_ENV,
    SEAL_INTERVAL_ENV,
    ConfigError,
    Settings,
    check_timing_settings,
)
from projections.follower import ProjectionFollower
from projections.route_cache import CachedRoutingView

ENVS = (ROUTE_REFRESH_ENV, ROUTE_MAX_STALE_ENV, SEAL_INTERVAL_ENV)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENVS:
        monkeypatch.delenv(name, raising=False)


def test_defaults() -> None:
    t = check_timing_settings()
    assert (t.route.refresh_s, t.route.max_stale_s, t.seal_interval_s) == (0.02, 0.7, 60.0)


def test_the_bounds_keep_the_1s_promise() -> None:
    """The worst case at each bound, follower and reload included, stays within 1 s; and the
    follower ``serve`` runs polls no less often than the budget assumes."""
    for bound_ms in (config.ROUTE_REFRESH_MAX_MS, config.ROUTE_MAX_STALE_MAX_MS):
        assert config.in_force_within_s(bound_ms / 1000) <= config.IN_FORCE_WITHIN_S
    assert config.ROUTE_REFRESH_MAX_MS < config.ROUTE_MAX_STALE_MAX_MS  # both can be set
    interval = inspect.signature(ProjectionFollower.run).parameters["interval"].default
    assert interval <= config.FOLLOWER_POLL_S


ACCEPTED = [
    {ROUTE_REFRESH_ENV: "0"},
    {ROUTE_REFRESH_ENV: "500"},
    {ROUTE_REFRESH_ENV: "500", ROUTE_MAX_STALE_ENV: "501"},
    {ROUTE_MAX_STALE_ENV: "700"},
    {SEAL_INTERVAL_ENV: "1"},
    {SEAL_INTERVAL_ENV: "3600"},
    {SEAL_INTERVAL_ENV: "0.5e1"},
]

# (environment, the variable the error must name, words it must say)
REFUSED = [
    ({ROUTE_REFRESH_ENV: "10000"}, ROUTE_REFRESH_ENV, "500 ms"),  # the reviewer's setting
    ({ROUTE_REFRESH_ENV: "501"}, ROUTE_REFRESH_ENV, "1 s"),
    ({ROUTE_REFRESH_ENV: "-1"}, ROUTE_REFRESH_ENV, "between"),
    ({ROUTE_REFRESH_ENV: "soon"}, ROUTE_REFRESH_ENV, "milliseconds"),
    ({ROUTE_REFRESH_ENV: "nan"}, ROUTE_REFRESH_ENV, "finite"),
    ({ROUTE_REFRESH_ENV: "inf"}, ROUTE_REFRESH_ENV, "finite"),
    ({ROUTE_MAX_STALE_ENV: "5000"}, ROUTE_MAX_STALE_ENV, "700 ms"),
    ({ROUTE_MAX_STALE_ENV: "701"}, ROUTE_MAX_STALE_ENV, "revocation"),
    ({ROUTE_MAX_STALE_ENV: "0"}, ROUTE_MAX_STALE_ENV, "above 0"),
    ({ROUTE_MAX_STALE_ENV: "later"}, ROUTE_MAX_STALE_ENV, "milliseconds"),
    # the reviewer's case, within the new bounds: staleness not above the refresh interval
    ({ROUTE_REFRESH_ENV: "500", ROUTE_MAX_STALE_ENV: "500"}, ROUTE_MAX_STALE_ENV, "503"),
    ({ROUTE_REFRESH_ENV: "400", ROUTE_MAX_STALE_ENV: "300"}, ROUTE_REFRESH_ENV, "503"),
    ({SEAL_INTERVAL_ENV: "0"}, SEAL_INTERVAL_ENV, "between 1 and 3600"),
    ({SEAL_INTERVAL_ENV: "0.5"}, SEAL_INTERVAL_ENV, "seconds"),
    ({SEAL_INTERVAL_ENV: "86400"}, SEAL_INTERVAL_ENV, "at most an hour"),
    ({SEAL_INTERVAL_ENV: "nan"}, SEAL_INTERVAL_ENV, "between"),
    ({SEAL_INTERVAL_ENV: "often"}, SEAL_INTERVAL_ENV, "seconds"),
]


@pytest.mark.parametrize("env", ACCEPTED, ids=[repr(e) for e in ACCEPTED])
def test_values_within_the_bounds_are_accepted(env: dict[str, str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_timing_settings()


@pytest.mark.parametrize(("env", "names", "says"), REFUSED, ids=[repr(r[0]) for r in REFUSED])
def test_values_beyond_the_bounds_are_refused_saying_why(
        env: dict[str, str], names: str, says: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as refused:
        check_timing_settings()
    assert names in str(refused.value) and says in str(refused.value), str(refused.value)


def test_a_gateways_routing_view_refuses_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = sa.create_engine("sqlite://")
    monkeypatch.setenv(ROUTE_REFRESH_ENV, "10000")
    with pytest.raises(ConfigError, match=ROUTE_REFRESH_ENV):
        CachedRoutingView(engine)
    monkeypatch.setenv(ROUTE_REFRESH_ENV, "300")
    view = CachedRoutingView(engine)
    assert (view.refresh_s, view.max_stale_s) == (0.3, 0.7)
    # Given in code (tests, benchmarks), the values must still not contradict each other.
    with pytest.raises(ConfigError, match="503"):
        CachedRoutingView(engine, refresh_s=0.3, max_stale_s=0.2)
    with pytest.raises(ConfigError, match="503"):
        CachedRoutingView(engine, refresh_s=10, max_stale_s=5)


def test_serve_refuses_before_anything_starts(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from control.ops.serve import Deployment

    home = tmp_path / "home"
    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}")
    for env in ({ROUTE_REFRESH_ENV: "10000"}, {ROUTE_MAX_STALE_ENV: "5000"},
                {SEAL_INTERVAL_ENV: "0"}):
        for name in ENVS:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ConfigError, match=next(iter(env))):
            Deployment(settings).start()
        assert not home.exists()  # not even its folders were made
