"""What the GPU check runs on, printed before any check: the interpreter, torch and the CUDA
libraries it loaded, transformers and peft, the GPU; and the start-up self-check of those
libraries.

A torch wheel for CUDA brings its own cuDNN and cuBLAS as ``nvidia-*`` wheels and finds them
through the run path of its own shared objects. A library of the same name earlier on the
loader's path wins instead: ``LD_LIBRARY_PATH`` is searched before a run path, and
``control/ops/triton_server.py`` prepends the interpreter's ``LIBDIR`` to it for the Python
backend's stub (the stub links libpython). In an image whose interpreter lives in
``/usr/lib/x86_64-linux-gnu``, the folder where NGC images install cuDNN, that may put the
image's cuDNN under the wheel's torch. :func:`library_check` reads which files the process
actually mapped (``/proc/self/maps``) and fails, naming both paths and versions, when torch's
wheel brings a library that was not the one loaded, or when the loaded version is not the
wheel's. :func:`stub_library_check` runs the same in a child process started with the stub's
``LD_LIBRARY_PATH``.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Library file stems torch's CUDA build loads, and the wheels that ship them (CUDA 12 wheels
# carry a -cu12 suffix, CUDA 13's cuBLAS none).
LIBRARIES = {"cudart": "libcudart.so", "cudnn": "libcudnn.so", "cublas": "libcublas.so",
             "cublasLt": "libcublasLt.so"}
WHEELS = {"cudart": ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13",
                     "nvidia-cuda-runtime-cu12"),
          "cudnn": ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"),
          "cublas": ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12"),
          "cublasLt": ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12")}
PACKAGES = ("transformers", "peft", "tokenizers", "safetensors", "numpy")


@dataclass(frozen=True)
class Loaded:
    """One library as the process has it: the file mapped, and its version where readable."""

    name: str
    path: str
    version: str | None


@dataclass(frozen=True)
class Wheel:
    """A library as torch's wheel dependencies ship it."""

    name: str
    dist: str
    version: str  # the wheel's version, e.g. 9.13.0.50
    files: tuple[str, ...]  # resolved paths of its shared objects


def environment() -> dict[str, Any]:
    """The interpreter, torch, the libraries around it and the GPU, each package with the
    folder it was imported from (a bundle's own wheels must be the ones in use)."""
    out: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable,
        "platform": platform.platform(), "torch": torch.__version__,
        "torch_path": str(Path(torch.__file__).parent), "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH", ""),
    }
    for name in PACKAGES:
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
            out[f"{name}_path"] = str(Path(module.__file__ or "").parent)
        except ImportError:
            out[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                   compute_capability=f"{props.major}.{props.minor}",
                   cudnn=_cudnn_version_text(torch.backends.cudnn.version()))
        _touch_cuda()
        out["libraries"] = {lib.name: {"path": lib.path, "version": lib.version}
                            for lib in loaded_libraries()}
    return out


def _touch_cuda() -> None:
    """Make torch load cuBLAS and cuDNN (both are loaded lazily, on first use)."""
    x = torch.ones(8, 8, device="cuda")
    (x @ x).sum().item()
    if torch.backends.cudnn.is_available():
        conv = torch.nn.functional.conv2d(torch.ones(1, 1, 4, 4, device="cuda"),
                                          torch.ones(1, 1, 2, 2, device="cuda"))
        conv.sum().item()


def _cudnn_version_text(v: int | None) -> str | None:
    """cuDNN 9's integer (major * 10000 + minor * 100 + patch) as ``9.13.0``."""
    if v is None:
        return None
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 90000 else str(v)


def mapped_files(maps: str | None = None) -> list[str]:
    """The files this process has mapped (``/proc/self/maps``), each once, in order."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    seen: dict[str, None] = {}
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            seen.setdefault(parts[5], None)
    return list(seen)


def _stem_matches(path: str, stem: str) -> bool:
    base = os.path.basename(path)
    return base == stem or base.startswith(stem + ".")


def loaded_libraries(maps: str | None = None) -> list[Loaded]:
    """The CUDA runtime, cuDNN and cuBLAS files this process mapped, with their versions."""
    files = mapped_files(maps)
    out = []
    for name, stem in LIBRARIES.items():
        for path in files:
            if _stem_matches(path, stem):
                out.append(Loaded(name, path, _library_version(name, path)))
    return out


def _library_version(name: str, path: str) -> str | None:
    """The version the library itself reports (cuDNN: torch's reading; the CUDA runtime,
    cuBLAS and cuBLASLt: their own version entry points), or None where it cannot be read."""
    if name == "cudnn":
        return _cudnn_version_text(torch.backends.cudnn.version())
    try:
        lib = ctypes.CDLL(path)  # already mapped: this opens the same copy
        if name == "cudart":
            out = ctypes.c_int()
            if lib.cudaRuntimeGetVersion(ctypes.byref(out)) != 0:
                return None
            return f"{out.value // 1000}.{out.value % 1000 // 10}"  # 13000 -> 13.0
        if name == "cublasLt":
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            v = int(lib.cublasLtGetVersion())
        else:
            # cublasGetProperty needs no handle: 0, 1, 2 are major, minor and patch level
            parts = []
            for prop in range(3):
                out = ctypes.c_int()
                if lib.cublasGetProperty(prop, ctypes.byref(out)) != 0:
                    return None
                parts.append(out.value)
            return ".".join(map(str, parts))
    except (OSError, AttributeError):
        return None
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"  # 130100 -> 13.1.0


def wheel_libraries() -> list[Wheel]:
    """The CUDA runtime, cuDNN and cuBLAS shared objects installed by ``nvidia-*`` wheels."""
    out = []
    for name, dists in WHEELS.items():
        for dist_name in dists:
            try:
                dist = importlib.metadata.distribution(dist_name)
            except importlib.metadata.PackageNotFoundError:
                continue
            stem = LIBRARIES[name]
            files = tuple(str(Path(str(dist.locate_file(f))).resolve())
                          for f in dist.files or () if _stem_matches(str(f), stem))
            if files:
                out.append(Wheel(name, dist_name, dist.version, files))
                break
    return out


def judge_libraries(loaded: list[Loaded], wheels: list[Wheel]) -> list[str]:
    """The problems: a library torch's wheels ship that was loaded from elsewhere, or whose
    loaded version is not the wheel's (compared on major.minor: a wheel's version has a build
    number the library does not report)."""
    problems = []
    by_name = {w.name: w for w in wheels}
    for lib in loaded:
        wheel = by_name.get(lib.name)
        if wheel is None:
            continue  # torch built against the system's libraries: nothing to compare with
        if str(Path(lib.path).resolve()) not in wheel.files:
            problems.append(
                f"torch loaded {lib.name} from {lib.path}, not from its wheel {wheel.dist} "
                f"{wheel.version} ({wheel.files[0]}): a folder earlier on the loader's path "
                f"shadows it (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')!r})")
        elif lib.version is not None and not _same_minor(lib.version, wheel.version):
            problems.append(f"{lib.name} {lib.version} was loaded from {lib.path}, but its "
                            f"wheel {wheel.dist} is {wheel.version}")
    names = {lib.name for lib in loaded}
    problems += [f"torch's wheel {w.dist} ships {w.name}, but no {w.name} library was loaded "
                 "after a CUDA matrix product and convolution" for w in wheels
                 if w.name not in names]
    return problems


def _same_minor(a: str, b: str) -> bool:
    def minor(v: str) -> tuple[str, ...]:
        return tuple(re.split(r"[.+]", v)[:2])
    return minor(a) == minor(b)


def library_check() -> dict[str, Any]:
    """The libraries this process loaded against torch's wheels: ``pass``, ``fail`` with the
    problems, or ``not available`` without CUDA."""
    if not torch.cuda.is_available():
        return {"status": "not available", "reason": "no CUDA device: torch loads no cuDNN "
                                                     "or cuBLAS"}
    _touch_cuda()
    loaded, wheels = loaded_libraries(), wheel_libraries()
    problems = judge_libraries(loaded, wheels)
    return {"status": "fail" if problems else "pass", "problems": problems,
            "cuda_build": torch.version.cuda,
            "cudnn": _cudnn_version_text(torch.backends.cudnn.version()),
            "loaded": [vars(lib) for lib in loaded],
            "wheels": [{"name": w.name, "dist": w.dist, "version": w.version} for w in wheels]}


def stub_library_check() -> dict[str, Any]:
    """:func:`library_check` in a child process with the ``LD_LIBRARY_PATH`` Triton's Python
    stub gets (``control/ops/triton_server.py``: the interpreter's ``LIBDIR`` first)."""
    if not torch.cuda.is_available():
        return {"status": "not available", "reason": "no CUDA device"}
    env = dict(os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p)
    root = str(Path(__file__).resolve().parents[3])  # where ``control`` is importable from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    code = ("import json; from control.tools.bench.gpu_env import library_check; "
            "print(json.dumps(library_check()))")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    if run.returncode != 0:
        return {"status": "fail", "problems": [f"the child process failed: {run.stderr[-2000:]}"],
                "ld_library_path": env["LD_LIBRARY_PATH"]}
    out: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return {**out, "ld_library_path": env["LD_LIBRARY_PATH"]}
