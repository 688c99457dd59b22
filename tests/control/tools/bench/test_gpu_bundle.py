"""The parts of ``make gpu-bundle`` (``control.tools.bench.gpu_bundle``) that the bundled dry run
in ``test_gpu_check.py`` does not single out: what is left to the image, the wheel tags, and a
wheel packed from an installed distribution installing as pip installs any wheel."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from control.tools.bench import gpu_bundle


def test_torch_and_its_cuda_stack_are_left_to_the_image() -> None:
    found = {"torch": "2.13.0", "nvidia-cudnn-cu13": "9.13", "cuda-bindings": "13.0",
             "numpy": "1.26.4", "transformers": "5.25.0", "SQLAlchemy": "2.0.58",
             "loraplane": "0.1.0"}
    assert gpu_bundle.bundled(found) == {"SQLAlchemy": "2.0.58", "transformers": "5.25.0"}


def test_the_default_bundle_is_for_the_gpu_images_python() -> None:
    assert gpu_bundle.PYTHON_VERSION == "3.12"
    assert all(p.endswith("x86_64") for p in gpu_bundle.PLATFORMS)


def test_a_wheel_with_several_tags_is_named_by_all_of_them() -> None:
    text = "Wheel-Version: 1.0\nTag: py2-none-any\nTag: py3-none-any\n"
    assert gpu_bundle.wheel_tag(text) == "py2.py3-none-any"
    assert gpu_bundle.wheel_tag("Tag: cp311-cp311-manylinux_2_17_x86_64\n") == (
        "cp311-cp311-manylinux_2_17_x86_64")


def test_a_packed_installed_distribution_installs_offline(tmp_path: Path) -> None:
    wheel = gpu_bundle.pack_installed("sortedcontainers", tmp_path)
    assert wheel.name == "sortedcontainers-2.4.0-py2.py3-none-any.whl"
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        record = zf.read("sortedcontainers-2.4.0.dist-info/RECORD").decode()
    assert "sortedcontainers/sortedlist.py" in names
    assert not [n for n in names if n.endswith(".pyc") or n.endswith("/INSTALLER")]
    assert "sortedcontainers/sortedlist.py,sha256=" in record
    target = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index",
                          "--no-deps", "--target", str(target), str(wheel)],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    probe = subprocess.run([sys.executable, "-S", "-c", "import sortedcontainers as s; "
                            "print(s.__file__)"], env={"PYTHONPATH": str(target)},
                           capture_output=True, text=True, check=True)
    assert probe.stdout.startswith(str(target))
