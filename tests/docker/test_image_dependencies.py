"""The Triton image's Python packages install together on the image's Python and platform.

``docker/triton.Dockerfile`` installs ``docker/requirements.txt``: every package of the image,
pinned. This test has pip resolve that same file for CPython 3.12 on manylinux x86_64 up to
glibc 2.39 (Ubuntu 24.04, the base of the Triton images from 25.07 on) without Docker: a dry run
that reads each wheel's metadata and installs nothing. It fails when a pin has no wheel there,
when pins conflict, when the file lacks a package they need or holds one nothing needs, or when
it does not satisfy ``pyproject.toml``; it skips only when the package index cannot be reached.

After changing a pin of the first section, delete the second and run
``python -m tests.docker.test_image_dependencies``: it prints the file's new body (what the pins
and the project's requirements resolve to).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import REPO
from tests.required import unavailable

ROOT = REPO
REQUIREMENTS = ROOT / "docker" / "requirements.txt"
IMAGE_PYTHON = (3, 12, 3)  # Ubuntu 24.04's python3
IMAGE_GLIBC_MINOR = 39  # Ubuntu 24.04's glibc 2.39
IMAGE_EXTRAS = ("postgres",)  # what the image installs of pyproject's extras
# transformers keeps its torch floor in its "torch" extra; the engine runs it on torch, so the
# image's torch must satisfy that floor as well.
ALSO_REQUIRED = ("transformers[torch]",)
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)")


def image_platforms() -> list[str]:
    """The image's wheel platform tags, most specific first as pip ranks them there."""
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(IMAGE_GLIBC_MINOR, 4, -1):
        tags.append(f"manylinux_2_{minor}_x86_64")
        if minor in legacy:
            tags.append(f"{legacy[minor]}_x86_64")
    return tags


def image_environment(extra: str = "") -> dict[str, str]:
    """Marker values of the image's interpreter."""
    env: dict[str, str] = dict(default_environment())
    env.update(python_version="{}.{}".format(*IMAGE_PYTHON),
               python_full_version="{}.{}.{}".format(*IMAGE_PYTHON),
               implementation_name="cpython", platform_python_implementation="CPython",
               os_name="posix", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", extra=extra)
    return env


def read_pins(path: Path | None = None) -> dict[str, str]:
    """Canonical name -> version. Only ``name==version`` lines: the file is also the control
    image's constraints file, where extras, markers and options are not allowed."""
    path = path or REQUIREMENTS
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.fullmatch(line)
        if m is None:
            raise ValueError(f"{path.name}:{n}: expected name==version, found {line!r}")
        name = canonicalize_name(m.group(1))
        if name in pins:
            raise ValueError(f"{path.name}:{n}: {name} is pinned twice")
        pins[name] = m.group(2)
    return pins


def project_requirements() -> list[Requirement]:
    """What the image asks for: pyproject's dependencies, its extras, and ``ALSO_REQUIRED``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in IMAGE_EXTRAS:
        texts += project["optional-dependencies"][extra]
    reqs = [Requirement(t) for t in [*texts, *ALSO_REQUIRED]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(image_environment())]


def pip_resolve(path: Path, work: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``pip install --dry-run`` of ``path`` for the image's Python and platform, together with
    what the project requires (so extras pull in what they need, and pip checks every floor)."""
    report = work / "report.json"
    index = os.environ.get("PIP_INDEX_URL")
    argv = [
        sys.executable, "-m", "pip",
        # only what a plain `pip install` in the image reads: no local indexes, constraints or
        # wheel folders of this machine's pip configuration
        "--isolated", "install", "--dry-run", "--ignore-installed", "--no-cache-dir",
        "--only-binary=:all:", "--python-version", "{}.{}".format(*IMAGE_PYTHON[:2]),
        *[a for tag in image_platforms() for a in ("--platform", tag)],
        "--target", str(work / "target"), "--report", str(report),
        # metadata through HTTP range requests where an index serves no PEP 658 metadata
        # files: kilobytes per wheel instead of torch's and CUDA's gigabytes
        "--use-feature=fast-deps",
        "--timeout", "30", "--retries", "2", "--progress-bar", "off",
        *(["--index-url", index] if index else []),
        "-r", str(path), *[str(r) for r in project_requirements()],
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600), report


def index_unreachable(work: Path) -> str | None:
    """pip's last words when it cannot list a package the file pins, else None."""
    name = next(iter(read_pins()))
    index = os.environ.get("PIP_INDEX_URL")
    r = subprocess.run([sys.executable, "-m", "pip", "--isolated", "index", "versions", name,
                        "--timeout", "15", "--retries", "1",
                        *(["--index-url", index] if index else [])],
                       capture_output=True, text=True, timeout=120, cwd=work)
    if r.returncode == 0:
        return None
    said = (r.stderr.strip().splitlines() or ["no answer"])[-1]
    return f"`pip index versions {name}` answered: {said}"


def resolved(report: Path) -> dict[str, dict[str, Any]]:
    """Canonical name -> metadata of every distribution pip would install."""
    data = json.loads(report.read_text())
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in data["install"]}


def needed(metadata: dict[str, dict[str, Any]],
           roots: list[Requirement]) -> tuple[set[str], list[str]]:
    """The distributions that ``roots`` need, transitively, on the image; and every requirement
    on the way that the resolved versions do not satisfy."""
    seen: set[tuple[str, str]] = set()
    names: set[str] = set()
    unmet: list[str] = []
    todo = [(r, "") for r in roots]
    while todo:
        req, extra = todo.pop()
        marker: Marker | None = req.marker
        if marker is not None and not marker.evaluate(image_environment(extra)):
            continue
        name = canonicalize_name(req.name)
        meta = metadata.get(name)
        if meta is None or not req.specifier.contains(meta["version"], prereleases=True):
            unmet.append(f"{req} (found {meta['version'] if meta else 'nothing'})")
            continue
        names.add(name)
        for want in ("", *sorted(req.extras)):
            if (name, want) in seen:
                continue
            seen.add((name, want))
            todo += [(Requirement(t), want) for t in meta.get("requires_dist", [])]
    return names, unmet


def lock_body(metadata: dict[str, dict[str, Any]]) -> str:
    """The requirements file's body for a resolution: direct dependencies, then the rest."""
    direct = {canonicalize_name(r.name) for r in project_requirements()}
    line = {n: f"{m['name']}=={m['version']}" for n, m in metadata.items()}
    first = [line[n] for n in sorted(direct & line.keys())]
    rest = [line[n] for n in sorted(line.keys() - direct)]
    return "\n".join(["# --- the project's dependencies (pyproject.toml, extra postgres) ---",
                      *first, "# --- what they pull in ---", *rest]) + "\n"


def test_the_requirements_file_holds_only_exact_pins() -> None:
    pins = read_pins()
    assert pins, "docker/requirements.txt pins nothing"
    for req in project_requirements():
        assert canonicalize_name(req.name) in pins, f"{req.name} is not pinned"


def test_the_image_dependencies_resolve_for_the_image_python_and_platform(
        tmp_path: Path) -> None:
    result, report = pip_resolve(REQUIREMENTS, tmp_path)
    if result.returncode != 0:
        unreachable = index_unreachable(tmp_path)
        if unreachable is not None:
            unavailable("the package index", f"cannot be reached: {unreachable}")
        pytest.fail(f"docker/requirements.txt does not install on CPython "
                    f"{IMAGE_PYTHON[0]}.{IMAGE_PYTHON[1]} manylinux x86_64:\n"
                    f"{result.stderr[-4000:]}")
    metadata = resolved(report)
    pins = read_pins()
    pulled = {n: m["version"] for n, m in metadata.items()}
    assert not pulled.keys() - pins.keys(), \
        f"installed but not pinned: {sorted(pulled.keys() - pins.keys())}"
    assert pulled == pins  # pip took every pin as written
    names, unmet = needed(metadata, project_requirements())
    assert not unmet, f"pins that do not satisfy what requires them: {unmet}"
    assert not pins.keys() - names, f"pinned but needed by nothing: {sorted(pins.keys() - names)}"


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        done, path = pip_resolve(REQUIREMENTS, Path(tmp))
        if done.returncode != 0:
            sys.exit(done.stderr)
        sys.stdout.write(lock_body(resolved(path)))
