"""Running tritonserver as an unprivileged user of its own when loraplane runs as root.

Triton's deployment guidance asks for least privilege, and the official Triton image runs the
server as its non-root user ``triton-server``. ``serve`` and ``triton-host`` started as root run
tritonserver, and so every Python backend stub it starts, as ``--triton-user`` (default
:data:`DEFAULT_TRITON_USER`, created with ``useradd --system`` when absent), so that code running
inside Triton cannot read what only root may: the ticket-signing private keys, the operator token
file (Triton needs the token on its command line only, never the file), the audit key.

What the user is given, through its own group and nothing wider (:func:`grant_home`): the home
(traverse), the artifact store and ``keys/public`` (read), and, for a SQLite database, the
database file and the home folder (write: SQLite puts its WAL files beside the database; the
folder is made sticky, so the user cannot rename or remove what root owns there, such as
``keys/``). Before launching, :func:`unreachable` asks the kernel, as that user, whether each
file Triton needs is readable, so that a Python installed under ``/root`` fails the start with the
path and the fix, not later inside Triton's log.
"""

from __future__ import annotations

import errno
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url

from control.contracts.config import Settings
from control.contracts.host_keys import LEDGER_KEYS_DIR

DEFAULT_TRITON_USER = "loraplane-triton"
KEEP_ROOT = "root"  # --triton-user root: Triton stays root (warned), as before this option
HOME_DIR_NAME = "triton-user-home"  # under run/: HOME and caches of the Triton user


class TritonUserError(RuntimeError):
    """The Triton user cannot be used as asked; the message says what to do."""


@dataclass(frozen=True)
class ServiceUser:
    name: str
    uid: int
    gid: int


def triton_user_for(requested: str | None) -> ServiceUser | None:
    """Who tritonserver runs as, or None for "the user running loraplane" (``requested`` None,
    or ``root``). Another user, created if absent, only as root: not root, Triton runs as the
    invoking user (already unprivileged), since only root can switch users. The CLI passes
    :data:`DEFAULT_TRITON_USER` when it runs as root and ``--triton-user`` is not given.
    """
    if requested is None or requested == KEEP_ROOT:
        return None
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid()).pw_name
        if requested != me:
            raise TritonUserError(
                f"--triton-user {requested}: only root can run Triton as another user "
                f"(this runs as {me}, and so does Triton)")
        return None
    return ensure_user(requested)


def ensure_user(name: str) -> ServiceUser:
    """The system user ``name``, created (``useradd --system``, no login, no home) if absent."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        useradd = shutil.which("useradd", path=os.pathsep.join(
            [os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
        cmd = [useradd or "useradd", "--system", "--user-group", "--no-create-home",
               "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        except OSError as e:
            done = subprocess.CompletedProcess(cmd, 1, "", str(e))
        if done.returncode != 0:
            raise TritonUserError(
                f"cannot create the Triton user {name!r} ({done.stderr.strip()}): create it "
                f"(`useradd --system --user-group {name}`), name another with --triton-user, "
                "or pass --triton-user root to keep Triton as root") from None
        pw = pwd.getpwnam(name)
    if pw.pw_uid == 0:
        raise TritonUserError(f"the Triton user {name!r} has uid 0: that is root")
    return ServiceUser(name, pw.pw_uid, pw.pw_gid)


def sqlite_path(db_url: str) -> Path | None:
    """The database file of a SQLite URL, else None (an in-memory SQLite database: None)."""
    url = make_url(db_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    return Path(url.database).resolve()


def _chgrp(path: Path, gid: int, add: int, remove: int = 0) -> None:
    """Give ``path`` to group ``gid``, adding and removing mode bits (no symlink followed). A
    read-only mount (the compose file's store) is left as it is: whether the user can read it
    anyway is checked before launch (:func:`check_reachable`)."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return
    try:
        os.chown(path, st.st_uid, gid)
        os.chmod(path, (stat.S_IMODE(st.st_mode) | add) & ~remove)
    except OSError as e:
        if e.errno != errno.EROFS:
            raise


def grant_home(settings: Settings, user: ServiceUser) -> Path:
    """Let ``user`` read what Triton reads in the home and write the SQLite database, and
    nothing of the secrets; returns the folder to use as its HOME (created, its own)."""
    gid = user.gid
    _chgrp(settings.home, gid, stat.S_IXGRP | stat.S_IRGRP)
    # keys/: traverse only, to reach public/; private/, the operator token and the audit key
    # stay root's alone (their modes are 0700 and 0600, and nothing here widens them).
    _chgrp(settings.keys_dir, gid, stat.S_IXGRP, remove=stat.S_IRWXO)
    public = settings.keys_dir / "public"
    public.mkdir(parents=True, exist_ok=True)
    _chgrp(public, gid, stat.S_IRGRP | stat.S_IXGRP)
    # keys/ledger/: the host's ledger checkpoint key, which the engine inside Triton signs
    # with (control.contracts.host_keys); the Triton user's own folder, so root's keys stay root's.
    ledger_keys = settings.keys_dir / LEDGER_KEYS_DIR
    ledger_keys.mkdir(exist_ok=True)
    for path in (ledger_keys, *ledger_keys.iterdir()):
        if not path.is_symlink():
            os.chown(path, user.uid, gid)
    os.chmod(ledger_keys, 0o700)
    _chgrp(settings.store_dir, gid, stat.S_IRGRP | stat.S_IXGRP)
    _chgrp(settings.run_dir, gid, stat.S_IRGRP | stat.S_IXGRP)
    db = sqlite_path(settings.db_url)
    if db is not None:
        # SQLite creates its -wal and -shm files beside the database with the database's mode
        # and owner: the folder must take new files from the group, and is made sticky so that
        # the group can remove only its own.
        _chgrp(db.parent, gid, stat.S_IRGRP | stat.S_IWGRP | stat.S_IXGRP | stat.S_ISVTX)
        for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
            if path.exists():
                _chgrp(path, gid, stat.S_IRGRP | stat.S_IWGRP)
    home = settings.run_dir / HOME_DIR_NAME
    home.mkdir(exist_ok=True)
    os.chown(home, user.uid, gid)
    os.chmod(home, 0o700)
    return home


def needed_paths(binary: Path, backend_dir: Path, model_repository: Path, repo_root: Path,
                 settings: Settings) -> dict[Path, str]:
    """Every file or folder tritonserver and its Python stubs open, with the access they need
    (``r``, ``w``, ``x``): the binary, the backend and stub, this Python (its shared library,
    standard library and packages), the project, the model repository, the store, the public
    keys, a SQLite database."""
    python = backend_dir / "python"
    paths = {
        binary: "x",
        python / "libtriton_python.so": "r",
        python / "triton_python_backend_stub": "x",
        Path(sysconfig.get_config_var("LIBDIR") or sys.base_prefix)
        / str(sysconfig.get_config_var("INSTSONAME") or ""): "r",
        Path(sysconfig.get_paths()["stdlib"]) / "os.py": "r",
        Path(sysconfig.get_paths()["purelib"]): "rx",
        repo_root / "control" / "__init__.py": "r",
        model_repository: "rx",
        settings.store_dir: "rx",
        settings.keys_dir / "public": "rx",
    }
    db = sqlite_path(settings.db_url)
    if db is not None:
        paths[db] = "rw"
        paths[db.parent] = "wx"
    return paths


def unreachable(user: ServiceUser, paths: dict[Path, str]) -> list[str]:
    """Those of ``paths`` that ``user`` cannot use as asked, each with the first folder on the
    way that it cannot enter; asked of the kernel by a shell running as ``user`` (so ACLs and
    groups count)."""
    script = ('for p in "$@"; do m=${p%%:*}; f=${p#*:}; ok=1; '
              'case $m in *r*) [ -r "$f" ] || ok=0;; esac; '
              'case $m in *w*) [ -w "$f" ] || ok=0;; esac; '
              'case $m in *x*) [ -x "$f" ] || ok=0;; esac; '
              '[ $ok = 1 ] || echo "$f"; done')
    args = [f"{mode}:{p}" for p, mode in paths.items()]
    done = subprocess.run(["/bin/sh", "-c", script, "sh", *args], capture_output=True,
                          text=True, timeout=30, user=user.uid, group=user.gid, extra_groups=[],
                          cwd="/")
    problems = []
    for line in done.stdout.splitlines():
        path = Path(line)
        problems.append(f"{path} ({paths[path]}){_blocked_at(user, path)}")
    return problems


def _blocked_at(user: ServiceUser, path: Path) -> str:
    for folder in reversed(path.parents):
        done = subprocess.run(["/bin/sh", "-c", '[ -x "$1" ]', "sh", str(folder)],
                              user=user.uid, group=user.gid, extra_groups=[], cwd="/",
                              timeout=10)
        if done.returncode != 0:
            return f": {user.name} cannot enter {folder}"
    return ""


def check_reachable(user: ServiceUser, paths: dict[Path, str]) -> None:
    """Raise :class:`TritonUserError`, listing what and the fixes, unless ``user`` reaches every
    one of ``paths``."""
    problems = unreachable(user, paths)
    if problems:
        raise TritonUserError(
            f"tritonserver runs as {user.name}, which cannot use: " + "; ".join(problems)
            + f". Give {user.name} access (for example `setfacl -m u:{user.name}:x FOLDER` for a "
            "folder it must cross, or install Python and the virtual environment where other "
            "users can read them), name another user with --triton-user, or keep Triton as "
            "root with --triton-user root (or LORAPLANE_TRITON_USER=root)")

