"""A bare GPU host, as far as Python and the network go, for running a gpu-check bundle in CI.

The host's interpreter is this venv's, started with ``-S``: it sees none of the venv's packages,
only the standard library and an "image" folder holding what a GPU image brings (torch, numpy
and torch's own dependencies, pip; ``control.tools.bench.gpu_bundle.FROM_THE_IMAGE``), linked
from this venv. Everything else the check imports (transformers, peft, SQLAlchemy, ...) must
come from the bundle. The network is off: pip is told to use no index and no configuration,
every HTTP client a proxy that refuses, and where this machine allows it (root, Linux) the run
is in a network namespace of its own with no interface but loopback.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

IMAGE_DISTRIBUTIONS = ("torch", "numpy", "sympy", "mpmath", "networkx", "setuptools", "pip")


def fake_image(root: Path) -> Path:
    """The image folder: every top-level entry of the image's distributions, linked."""
    root.mkdir(parents=True, exist_ok=True)
    for name in IMAGE_DISTRIBUTIONS:
        dist = importlib.metadata.distribution(name)
        for f in dist.files or ():
            top = f.parts[0]
            if top in ("..", "__pycache__") or (root / top).exists():
                continue
            (root / top).symlink_to(Path(str(dist.locate_file(top))))
    return root


def device_python(root: Path, image: Path) -> Path:
    """A script standing for the host's ``python3``: this interpreter without site-packages,
    the image folder last on its path."""
    script = root / "python3"
    script.write_text("#!/bin/sh\n"
                      f'PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{image}" '
                      f'exec "{sys.executable}" -S "$@"\n')
    script.chmod(0o755)
    return script


def _isolated() -> list[str]:
    """``unshare -n`` where it works here: the command then has no network at all."""
    try:
        ok = subprocess.run(["unshare", "-n", "true"], capture_output=True,
                            timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ["unshare", "-n"] if ok else []


def run_bundle(bundle: Path, python: Path, args: list[str],
               timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], bool]:
    """``bundle/gpu-check args`` on the bare host, offline; the run and whether it ran in a
    network namespace of its own."""
    keep = ("PATH", "HOME", "LANG", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    refuse = "http://127.0.0.1:9"  # the discard port: nothing answers
    env.update(PYTHON=str(python), PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull,
               PIP_FIND_LINKS="", PIP_DISABLE_PIP_VERSION_CHECK="1", http_proxy=refuse,
               https_proxy=refuse, HTTP_PROXY=refuse, HTTPS_PROXY=refuse, no_proxy="",
               HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    prefix = _isolated()
    run = subprocess.run([*prefix, str(bundle / "gpu-check"), *args], env=env,
                         capture_output=True, text=True, timeout=timeout, check=False)
    return run, bool(prefix)
