"""Every tritonserver launch restricts the operator APIs to the home's operator token."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from control.contracts.wire import FORWARDED_HEADERS
from control.ops.triton_access import (
    GRPC_HEADER_PREFIX,
    OPERATOR_APIS,
    OPERATOR_HEADER,
    TENANT_APIS,
    TOKEN_EXPOSED_FIX,
    TOKEN_FILE,
    OperatorAccess,
    OperatorTokenError,
    command_line_exposure,
)
from control.ops.triton_server import TritonInstall, TritonProcess

INSTALL = TritonInstall(Path("/opt/tritonserver/bin/tritonserver"), Path("/opt/backends"))


def _process(home: Path, **env: str) -> TritonProcess:
    return TritonProcess(work_dir=home / "run", http_port=1, grpc_port=2, metrics_port=3,
                         env={"LORAPLANE_HOME": str(home), **env})


def _restrictions(argv: list[str], flag: str) -> list[tuple[set[str], str, str]]:
    """(APIs, header, value) of every ``flag=<apis>:<header>=<value>`` on the command line."""
    out = []
    for arg in argv:
        if arg.startswith(flag + "="):
            apis, _, rule = arg.split("=", 1)[1].partition(":")
            header, _, value = rule.partition("=")
            out.append((set(apis.split(",")), header, value))
    return out


@pytest.mark.parametrize("traces", ["off", "otlp"])
def test_every_command_line_restricts_the_operator_apis(tmp_path: Path, traces: str) -> None:
    proc = _process(tmp_path, LORAPLANE_TRACES=traces)
    argv = proc.command(INSTALL)
    token = (tmp_path / "keys" / TOKEN_FILE).read_text().strip()
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        assert _restrictions(argv, flag) == [(set(OPERATOR_APIS), OPERATOR_HEADER, token)]
    assert {"model-repository", "shared-memory", "trace", "logging", "statistics"} \
        <= set(OPERATOR_APIS)
    assert not set(OPERATOR_APIS) & set(TENANT_APIS)
    # frontends that would serve beside the restricted ports stay off; models never load later
    assert {"--allow-sagemaker=false", "--allow-vertex-ai=false",
            "--model-control-mode=none"} <= set(argv)


def test_the_operator_header_is_never_forwarded_to_the_model() -> None:
    forwarded = re.compile(FORWARDED_HEADERS, re.IGNORECASE)
    for name in OperatorAccess("t" * 43).headers("http").keys() \
            | OperatorAccess("t" * 43).headers("grpc").keys():
        assert not forwarded.search(name), name
    assert OperatorAccess("t" * 43).headers("grpc") == {
        GRPC_HEADER_PREFIX + OPERATOR_HEADER: "t" * 43}


def test_the_token_is_created_once_per_home_owner_readable_only(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    first = _process(a).operator_headers()
    assert _process(a).operator_headers() == first  # a restart keeps the token
    assert _process(b).operator_headers() != first  # another home has its own
    path = a / "keys" / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first[OPERATOR_HEADER]) >= 32
    assert first[OPERATOR_HEADER] not in repr(_process(a).operator)


def test_the_home_comes_from_the_launch_environment(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLANE_HOME", str(tmp_path / "outer"))
    TritonProcess(work_dir=tmp_path, http_port=1, grpc_port=2, metrics_port=3).command(INSTALL)
    assert (tmp_path / "outer" / "keys" / TOKEN_FILE).is_file()
    _process(tmp_path / "inner").command(INSTALL)
    assert (tmp_path / "inner" / "keys" / TOKEN_FILE).is_file()


def test_a_token_readable_by_others_is_refused(tmp_path: Path) -> None:
    OperatorAccess.for_home(tmp_path)
    path = tmp_path / "keys" / TOKEN_FILE
    os.chmod(path, 0o644)
    with pytest.raises(OperatorTokenError, match="chmod 600"):
        _process(tmp_path).command(INSTALL)


@pytest.mark.parametrize("content", ["", "short", "x" * 40 + ":y", "x" * 40 + ",trace", "é" * 40])
def test_a_malformed_token_is_refused_with_the_fix(tmp_path: Path, content: str) -> None:
    path = tmp_path / "keys" / TOKEN_FILE
    path.parent.mkdir()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(content)
    with pytest.raises(OperatorTokenError, match="delete the file"):
        _process(tmp_path).command(INSTALL)


def test_headers_name_a_known_protocol() -> None:
    with pytest.raises(ValueError, match="http or grpc"):
        OperatorAccess("t" * 43).headers("rest")  # type: ignore[arg-type]


def _fake_proc(tmp_path: Path, options: str, init: str = "systemd") -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "1").mkdir()
    (proc / "self" / "mountinfo").write_text(
        "21 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
        f"22 27 0:21 / {proc} rw,nosuid,relatime - proc proc {options}\n")
    (proc / "1" / "comm").write_text(init + "\n")
    return proc


@pytest.mark.parametrize(("options", "init", "exposed"), [
    ("rw", "systemd", True),
    ("rw,hidepid=0", "systemd", True),
    ("rw,hidepid=invisible", "systemd", False),
    ("rw,hidepid=2,gid=4", "systemd", False),
    ("rw,hidepid=noaccess", "systemd", False),
    ("rw,hidepid=ptraceable", "systemd", False),
    ("rw", "tini", False),  # a container's own PID namespace
])
def test_serve_knows_when_other_users_can_read_the_token(tmp_path: Path, options: str,
                                                         init: str, exposed: bool) -> None:
    said = command_line_exposure(_fake_proc(tmp_path, options, init))
    assert (said is not None) == exposed
    if said is not None:
        assert "hidepid" in said and "operator token" in said
    assert "hidepid=invisible" in TOKEN_EXPOSED_FIX and "PID namespace" in TOKEN_EXPOSED_FIX


def test_this_machines_proc_is_read(tmp_path: Path) -> None:
    """On Linux the real /proc answers (either way); without one, nothing is said."""
    if Path("/proc/self/mountinfo").exists():
        command_line_exposure()
    assert command_line_exposure(tmp_path / "no-proc") is None
