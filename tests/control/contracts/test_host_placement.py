"""Where the control plane places its own calls to Triton hosts (issue 25): ``POOL=host:port``
entries, and rendezvous hashing on the affinity value within the ticket's pool."""

from __future__ import annotations

import re

import pytest

from control.contracts.config import ConfigError
from control.contracts.placement import HostUrl, affinity_of, parse_host_urls, place

HOSTS = parse_host_urls(["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000",
                         "gold=10.0.1.1:8000", " gold = 10.0.1.2:8000 ", ""])
ROUTES = [affinity_of(f"chat{i}") for i in range(300)]


def test_entries_name_their_pool_or_the_shared_one() -> None:
    assert HOSTS[0] == HostUrl("10.0.0.1:8000", "shared")
    assert [h.pool for h in HOSTS] == ["shared"] * 3 + ["gold"] * 2
    assert HOSTS[4] == HostUrl("10.0.1.2:8000", "gold")  # spaces around either side
    assert [h.spec() for h in HOSTS[2:4]] == ["10.0.0.3:8000", "gold=10.0.1.1:8000"]
    assert parse_host_urls(h.spec() for h in HOSTS) == HOSTS


@pytest.mark.parametrize("bad", ["Gold=10.0.0.1:8000", "=10.0.0.1:8000", "a b=10.0.0.1:8000"])
def test_a_bad_pool_name_is_refused_naming_the_url(bad: str) -> None:
    with pytest.raises(ConfigError, match=re.escape("10.0.0.1:8000")):
        parse_host_urls([bad])


def test_a_request_is_placed_only_on_its_pools_hosts() -> None:
    for route in ROUTES[:20]:
        assert set(place(HOSTS, "shared", route)) == {"10.0.0.1:8000", "10.0.0.2:8000",
                                                     "10.0.0.3:8000"}
        assert set(place(HOSTS, "gold", route)) == {"10.0.1.1:8000", "10.0.1.2:8000"}
        assert place(HOSTS, "silver", route) == []  # no host listed: nowhere


def test_routes_spread_and_a_lost_host_moves_only_its_own_routes() -> None:
    first = {r: place(HOSTS, "shared", r)[0] for r in ROUTES}
    counts = {u: list(first.values()).count(u) for u in set(first.values())}
    assert len(counts) == 3 and min(counts.values()) >= 60, counts  # 100 each on average
    assert first == {r: place(HOSTS, "shared", r)[0] for r in ROUTES}  # the same every time
    lost = "10.0.0.2:8000"
    rest = [h for h in HOSTS if h.url != lost]
    for route, url in first.items():
        now = place(rest, "shared", route)[0]
        if url != lost:
            assert now == url, "a route on a live host moved"
        else:
            assert now == place(HOSTS, "shared", route)[1]  # its next choice takes it
