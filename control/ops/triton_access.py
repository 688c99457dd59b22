"""Who may call Triton's own APIs: tenants reach health, metadata, model configuration and
inference; everything else needs the operator header.

Beside inference, Triton serves APIs that no tenant should reach: model load and unload (a model
is code), shared-memory registration (the August 2025 advisories CVE-2025-23319, -23320 and
-23334 chained the Python backend's own regions through it), trace and log settings, and
per-model statistics (one tenant would watch another's traffic). Every launch restricts them with
``--http-restricted-api`` and ``--grpc-restricted-protocol``; no setting lifts this.

The header's value is a random token kept per home in ``keys/triton-operator.token`` (mode 0600,
created on first launch, read by operator tools through :class:`OperatorAccess`). The header's
name is outside the ``x-lora-.*`` pattern that Triton forwards to the model
(``control.contracts.wire.FORWARDED_HEADERS``), so the token never reaches model code, the ledger
or a log line. Triton expects the gRPC header with the prefix ``triton-grpc-protocol-``.

Triton takes the token on its command line only, so a local user allowed to read the server's
``/proc/<pid>/cmdline`` can see it, and reach the operator APIs on Triton's loopback ports:
:func:`command_line_exposure` says when that is so (``/proc`` without ``hidepid``, outside a
container), and ``serve`` warns once. Tenants never reach Triton directly: the front door
(``control/ops/front_door.py``) forwards only their routes and drops the operator headers, so a
leaked token is of no use through it. The restriction is the second line, for whatever reaches
Triton's ports without passing the door.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

OPERATOR_HEADER = "loraplane-operator"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # Triton's own prefix for restricted gRPC headers
# Triton's API groups (tritonserver --help, "Allowed APIs"), split between the two audiences.
# model-config stays open: the gateway's OpenAI route reads the input names from it, and every
# tenant sees the same shared configuration.
TENANT_APIS = ("health", "metadata", "model-config", "inference")
OPERATOR_APIS = ("model-repository", "shared-memory", "statistics", "trace", "logging")
TOKEN_FILE = "triton-operator.token"
_TOKEN = re.compile(r"[A-Za-z0-9_-]{32,128}")  # no ':', ',' or '=': they delimit Triton's flag

Protocol = Literal["http", "grpc"]
# /proc's hidepid values that keep other users' command lines unreadable (proc(5))
_HIDDEN = {"1", "2", "4", "noaccess", "invisible", "ptraceable"}
# An init of a container's own PID namespace (docker run --init, podman, Kubernetes' pause)
_CONTAINER_INITS = {"tini", "docker-init", "dumb-init", "catatonit", "pause"}
TOKEN_EXPOSED_FIX = (
    "mount /proc with hidepid=invisible (`mount -o remount,hidepid=invisible,gid=<group "
    "allowed to see every process> /proc`, and the same options in /etc/fstab), or run Triton "
    "in its own PID namespace (a container, as docker/compose.yaml does)")


class OperatorTokenError(RuntimeError):
    """The operator token file is unusable; the message says how to fix it."""


@dataclass(frozen=True)
class OperatorAccess:
    """The operator token of one home and what Triton and operator tools do with it."""

    token: str = field(repr=False)

    @classmethod
    def for_home(cls, home: Path) -> OperatorAccess:
        """The home's token, created (mode 0600) if absent."""
        return cls(_load_or_create(home / "keys" / TOKEN_FILE))

    def flags(self) -> list[str]:
        """The tritonserver options that restrict the operator APIs to this token."""
        rule = f"{','.join(OPERATOR_APIS)}:{OPERATOR_HEADER}={self.token}"
        return [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]

    def headers(self, protocol: Protocol = "http") -> dict[str, str]:
        """The header an operator tool sends (tritonclient's ``headers=``) to unlock them."""
        if protocol == "http":
            return {OPERATOR_HEADER: self.token}
        if protocol == "grpc":
            return {GRPC_HEADER_PREFIX + OPERATOR_HEADER: self.token}
        raise ValueError(f"protocol is http or grpc, not {protocol!r}")


def _load_or_create(path: Path) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name created 0600 and linked into place, so the token never
        # exists readable by others and two hosts starting at once agree on one token.
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another launch created it meanwhile: use that one
        finally:
            os.unlink(tmp)
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise OperatorTokenError(
            f"the Triton operator token {path} is readable by other users "
            f"(mode {stat.filemode(mode)}); run `chmod 600 {path}`")
    token = path.read_text().strip()
    if not _TOKEN.fullmatch(token):
        raise OperatorTokenError(
            f"the Triton operator token {path} is not 32 to 128 characters of A-Z, a-z, 0-9, "
            "'-' or '_'; delete the file to have a new token created at the next launch")
    return token


def command_line_exposure(proc: Path = Path("/proc")) -> str | None:
    """Why other local users can read tritonserver's command line, and so the token; None when
    they cannot (``/proc`` has ``hidepid``, or this runs as the first process of its own PID
    namespace, as in a container)."""
    try:
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return None  # no /proc: nothing to read a command line from
    options: set[str] = set()
    for line in mounts:
        fields = line.split()
        if len(fields) > 4 and fields[4] == str(proc) and " - " in line:
            options = set(fields[5].split(",")) | set(line.split(" - ", 1)[1].split()[-1]
                                                      .split(","))
    hidepid = {o.split("=", 1)[1] for o in options if o.startswith("hidepid=")}
    if hidepid & _HIDDEN:
        return None
    if os.getpid() == 1:
        return None
    try:
        if (proc / "1" / "comm").read_text().strip() in _CONTAINER_INITS:
            return None
    except OSError:
        pass
    return (f"{proc} is mounted without hidepid, so every local user can read tritonserver's "
            f"command line ({proc}/<pid>/cmdline, ps), operator token included")
