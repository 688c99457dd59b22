"""``make gpu-bundle``: a folder from which ``gpu-check`` runs on a GPU host with no network.

    python -m control.tools.bench.gpu_bundle                 # wheels from PyPI, for Python 3.12
    python -m control.tools.bench.gpu_bundle --from-env      # offline: this venv's own packages

A lent GPU host reaches no package index, and its image has its own torch and CUDA libraries
(the ones the check is for) but not what the engine needs beside them: transformers 5.24 (the
engine passes ``cache=``), SQLAlchemy, and others. The bundle holds:

- ``src/``: this project's packages and ``pyproject.toml``;
- ``wheels/``: one wheel per distribution the check imports, at the version this venv has
  (so the device runs what CI tested), except the ones the image must bring itself: torch, its
  CUDA libraries and the compiled packages built against it (:data:`FROM_THE_IMAGE`);
- ``gpu-check``: the run script. It installs the wheels with ``pip --no-index --no-deps
  --target site`` on its first run, then runs ``python -m control.tools.bench.gpu_check`` with
  ``site`` and ``src`` ahead of the image's packages on ``PYTHONPATH``;
- ``bundle.json``: what was bundled, and for which Python and platform.

By default the wheels are downloaded from the package index for CPython :data:`PYTHON_VERSION`
on manylinux x86_64 (:data:`PLATFORMS`): the GPU image's interpreter. ``--from-env`` instead
packs the wheels from the installed distributions of this interpreter, with no network: a
bundle for a host with this interpreter's Python version (what CI runs).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import json
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("control", "backend", "projections")  # what pyproject.toml installs
PYTHON_VERSION = "3.12"  # the GPU image's interpreter (python3 there is CPython 3.12)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# Left to the image: torch and its CUDA stack are what the check measures, and numpy is compiled
# against by the image's other packages; the project itself travels as source.
FROM_THE_IMAGE = frozenset({"torch", "triton", "numpy", "sympy", "mpmath", "networkx",
                            "setuptools", "pip", "loraplane"})
FROM_THE_IMAGE_PREFIXES = ("nvidia-", "cuda-")
# Imported in a child process to find the distributions the check needs (its lazy imports too).
CHECK_MODULES = ("control.tools.bench.gpu_check", "control.tools.bench.gpu_env",
                 "control.tools.bench.gpu_shapes", "peft", "transformers.models.llama")
RUN_SCRIPT = """#!/bin/sh
# gpu-check from this bundle, with no network: ./gpu-check [options of gpu_check]
#   ./gpu-check                  # on the GPU
#   ./gpu-check --device cpu     # dry run, toy sizes
# PYTHON: the interpreter that has torch (default python3).
set -eu
export PIP_ROOT_USER_ACTION=ignore  # the host runs us as root; pip need not say so
here=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
if [ ! -f "$here/site/.installed" ]; then
  rm -rf "$here/site"
  "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile \\
    --disable-pip-version-check --target "$here/site" "$here"/wheels/*.whl
  touch "$here/site/.installed"
fi
# the bundle's packages first: the image's older transformers must not be the one imported
PYTHONPATH="$here/site:$here/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH PYTHONNOUSERSITE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$here/src"
exec "$PYTHON" -m control.tools.bench.gpu_check "$@"
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def from_the_image(name: str) -> bool:
    n = _normal(name)
    return n in FROM_THE_IMAGE or n.startswith(FROM_THE_IMAGE_PREFIXES)


def imported_distributions(python: str = sys.executable) -> dict[str, str]:
    """Every installed distribution whose modules the check imports, with its version, read
    in a child process of ``python`` (this process may have imported more)."""
    code = (
        "import importlib, importlib.metadata as md, json, sys\n"
        f"for m in {CHECK_MODULES!r}: importlib.import_module(m)\n"
        "pd = md.packages_distributions()\n"
        "names = {d for m in list(sys.modules) for d in pd.get(m.split('.')[0], [])}\n"
        "print(json.dumps({n: md.version(n) for n in sorted(names)}))\n")
    run = subprocess.run([python, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                         check=True, timeout=600)
    found: dict[str, str] = json.loads(run.stdout.strip().splitlines()[-1])
    return found


def bundled(found: dict[str, str]) -> dict[str, str]:
    """The distributions the bundle ships: what the check imports less what the image brings."""
    return {n: v for n, v in sorted(found.items()) if not from_the_image(n)}


def download(pins: dict[str, str], dest: Path, python_version: str,
             platforms: tuple[str, ...]) -> None:
    """Binary wheels of exactly ``pins`` for CPython ``python_version`` on ``platforms``."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
           "--dest", str(dest)]
    for p in platforms:
        cmd += ["--platform", p]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in pins.items()], check=True)


def wheel_tag(wheel_file: str) -> str:
    """The compressed tag set of a WHEEL file's ``Tag:`` lines (``py2.py3-none-any``): a wheel
    named with only its first tag would claim Python 2 alone, and pip would refuse it."""
    tags = [line.split(":", 1)[1].strip().split("-") for line in wheel_file.splitlines()
            if line.startswith("Tag:")]
    return "-".join(".".join(sorted({t[i] for t in tags})) for i in range(3))


def pack_installed(name: str, dest: Path) -> Path:
    """A wheel of the installed distribution ``name``, made from the files its RECORD lists
    (scripts and other files outside site-packages left out: the check runs none)."""
    dist = importlib.metadata.distribution(name)
    info = next((Path(str(dist.locate_file(f))).parent for f in dist.files or ()
                 if f.name == "METADATA"), None)
    if info is None:
        raise SystemExit(f"gpu-bundle: {name} {dist.version} is installed without a RECORD of "
                         "its files, so it cannot be packed; build the bundle from the package "
                         "index instead (without --from-env)")
    site = info.parent
    tag = wheel_tag((info / "WHEEL").read_text())
    stem = f"{re.sub(r'[-.]+', '_', dist.metadata['Name'])}-{dist.version}"
    out = dest / f"{stem}-{tag}.whl"
    record_name = f"{info.name}/RECORD"
    rows = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for f in dist.files or ():
            rel = f.as_posix()
            if (rel.startswith("..") or "__pycache__" in rel or rel == record_name
                    or rel.endswith((".pyc", "/INSTALLER", "/REQUESTED", "/direct_url.json"))):
                continue
            path = site / rel
            if not path.is_file():
                continue
            data = path.read_bytes()
            zf.writestr(rel, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{rel},sha256={digest.decode()},{len(data)}")
        zf.writestr(record_name, "\n".join([*rows, f"{record_name},,"]) + "\n")
    return out


def copy_source(dest: Path) -> None:
    """The project's packages (no caches) and ``pyproject.toml``."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pkg in PACKAGES:
        shutil.copytree(REPO_ROOT / pkg, dest / pkg, ignore=ignore)
    shutil.copy2(REPO_ROOT / "pyproject.toml", dest / "pyproject.toml")


def _source() -> str:
    """Which source the bundle holds: the working tree, at which commit, changed or not."""
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             check=False)
        return run.stdout.strip()

    commit = git("rev-parse", "HEAD") or "no commit"
    changed = git("status", "--porcelain", "--untracked-files=no", "--", *PACKAGES)
    return f"the working tree at {commit}" + (" with uncommitted changes" if changed else "")


def build(out: Path, *, from_env: bool, python_version: str = PYTHON_VERSION,
          platforms: tuple[str, ...] = PLATFORMS) -> dict[str, object]:
    """Write the bundle to ``out`` (replacing it); its manifest."""
    if out.exists():
        shutil.rmtree(out)
    wheels = out / "wheels"
    wheels.mkdir(parents=True)
    pins = bundled(imported_distributions())
    if from_env:
        python_version = ".".join(platform.python_version_tuple()[:2])
        platforms = (f"this machine's ({platform.machine()})",)
        for name in pins:
            pack_installed(name, wheels)
    else:
        download(pins, wheels, python_version, platforms)
    copy_source(out / "src")
    script = out / "gpu-check"
    script.write_text(RUN_SCRIPT)
    script.chmod(0o755)
    manifest: dict[str, object] = {
        "python": python_version, "platforms": list(platforms),
        "wheels_from": "installed distributions" if from_env else "the package index",
        "bundled": pins, "from_the_image": sorted(FROM_THE_IMAGE) + [
            f"{p}*" for p in FROM_THE_IMAGE_PREFIXES],
        "source": _source(), "wheel_files": sorted(p.name for p in wheels.iterdir())}
    (out / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m control.tools.bench.gpu_bundle",
        description="Write a folder from which gpu-check runs with no network: the project's "
                    "source, the wheels a GPU image lacks, and a run script.")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "gpu-bundle")
    parser.add_argument("--from-env", action="store_true",
                        help="pack the wheels from this interpreter's installed packages "
                             "(offline; for a host with this Python version)")
    parser.add_argument("--python-version", default=PYTHON_VERSION,
                        help=f"the GPU host's Python (default {PYTHON_VERSION})")
    args = parser.parse_args(argv)
    manifest = build(args.out, from_env=args.from_env, python_version=args.python_version)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    wheels = len(manifest["wheel_files"])  # type: ignore[arg-type]
    print(f"gpu-bundle: {args.out} ({size / 2**20:.0f} MiB, {wheels} wheels for Python "
          f"{manifest['python']}, {manifest['source']}); copy the folder to the GPU host and "
          f"run its gpu-check there", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
