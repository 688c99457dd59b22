"""When ``serve`` and ``triton-host`` put the front door in front of Triton, and when they refuse.

Decided before anything starts: these deployments never reach their database or Triton.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import control.ops.serve as serve
from control.contracts.config import Settings
from control.ops.front_door import HaproxyUnavailable
from control.ops.serve import Deployment, Ports


def _deployment(tmp_path: Path, **kw: object) -> Deployment:
    settings = Settings(home=tmp_path / "home", db_url=f"sqlite:///{tmp_path / 'none.db'}")
    return Deployment(settings, Ports(0, 0, 0, 0), role="triton", **kw)  # type: ignore[arg-type]


@pytest.fixture
def no_haproxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve, "find_haproxy", lambda: None)


@pytest.mark.parametrize("listen", ["0.0.0.0", "::", "192.0.2.10"])
def test_serving_other_machines_without_haproxy_is_refused(tmp_path: Path, no_haproxy: None,
                                                           listen: str) -> None:
    dep = _deployment(tmp_path, bind=listen)
    with pytest.raises(HaproxyUnavailable) as refused:
        dep.start()
    assert "apt-get install haproxy" in str(refused.value)
    assert "--front-door external" in str(refused.value)
    assert dep.triton is None and dep.door is None
    assert not (tmp_path / "none.db").exists()  # refused before anything opened the database


def test_requiring_the_door_without_haproxy_is_refused(tmp_path: Path, no_haproxy: None) -> None:
    with pytest.raises(HaproxyUnavailable, match="apt-get install haproxy"):
        _deployment(tmp_path, front_door="haproxy").start()


def test_an_unknown_front_door_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="auto, haproxy, external"):
        _deployment(tmp_path, front_door="nginx").start()


@pytest.mark.parametrize(("door", "listen", "installed", "wanted"), [
    ("auto", "127.0.0.1", True, True),
    ("auto", "0.0.0.0", True, True),
    ("auto", "127.0.0.1", False, False),  # this machine only: served without the door
    ("auto", "localhost", False, False),
    ("auto", "::1", False, False),
    ("haproxy", "127.0.0.1", True, True),
    ("external", "0.0.0.0", False, False),  # another proxy is the door
    ("external", "0.0.0.0", True, False),
])
def test_when_the_door_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, door: str,
                            listen: str, installed: bool, wanted: bool) -> None:
    monkeypatch.setattr(serve, "find_haproxy",
                        lambda: "/usr/sbin/haproxy" if installed else None)
    assert serve.door_wanted(door, listen) is wanted


def test_ports_left_at_zero_are_chosen_at_start() -> None:
    given = Ports(8000, 0, 8002, 0, triton_http=18000)
    chosen = given.resolved()
    assert (chosen.http, chosen.metrics, chosen.triton_http) == (8000, 8002, 18000)
    assert 0 not in (chosen.grpc, chosen.gateway, chosen.triton_grpc)
