"""The GPU check's start-up self-check of the CUDA libraries torch loaded
(``control.tools.bench.gpu_env``), on what a process maps and what torch's wheels ship: a
library loaded from outside its wheel, or at another version, fails with both named."""

from __future__ import annotations

from control.tools.bench.gpu_env import (
    Loaded,
    Wheel,
    judge_libraries,
    loaded_libraries,
    mapped_files,
)

SITE = "/opt/venv/lib/python3.12/site-packages/nvidia"
WHEELS = [Wheel("cudnn", "nvidia-cudnn-cu13", "9.13.0.50", (f"{SITE}/cudnn/lib/libcudnn.so.9",)),
          Wheel("cublas", "nvidia-cublas", "13.1.0.3", (f"{SITE}/cu13/lib/libcublas.so.13",))]
MAPS = (
    "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    "7f01-7f02 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libcudnn.so.9.1.0\n"
    "7f02-7f03 r--p 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libcudnn.so.9.1.0\n"
    "7f03-7f04 r-xp 00000000 08:01 3 /opt/lib/libcudnn_graph.so.9\n"
    "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n"
    "7f05-7f06 rw-p 00000000 00:00 0\n")


def test_mapped_files_are_listed_once_without_anonymous_maps() -> None:
    assert mapped_files(MAPS) == ["/usr/lib/x86_64-linux-gnu/libc.so.6",
                                  "/usr/lib/x86_64-linux-gnu/libcudnn.so.9.1.0",
                                  "/opt/lib/libcudnn_graph.so.9"]


def test_only_the_libraries_themselves_are_picked_not_their_siblings() -> None:
    found = loaded_libraries(MAPS)
    assert [(lib.name, lib.path) for lib in found] == [
        ("cudnn", "/usr/lib/x86_64-linux-gnu/libcudnn.so.9.1.0")]


def test_the_wheels_own_libraries_at_their_versions_pass() -> None:
    loaded = [Loaded("cudnn", WHEELS[0].files[0], "9.13.0"),
              Loaded("cublas", WHEELS[1].files[0], "13.1.0")]
    assert judge_libraries(loaded, WHEELS) == []


def test_a_library_shadowing_the_wheels_fails_naming_both_paths() -> None:
    shadow = "/usr/lib/x86_64-linux-gnu/libcudnn.so.9"
    loaded = [Loaded("cudnn", shadow, "9.1.0"), Loaded("cublas", WHEELS[1].files[0], "13.1.0")]
    [problem] = judge_libraries(loaded, WHEELS)
    assert shadow in problem and WHEELS[0].files[0] in problem
    assert "nvidia-cudnn-cu13 9.13.0.50" in problem and "LD_LIBRARY_PATH" in problem


def test_the_wheels_file_at_another_version_fails() -> None:
    loaded = [Loaded("cudnn", WHEELS[0].files[0], "9.12.0"),
              Loaded("cublas", WHEELS[1].files[0], "13.1.7")]  # a patch level apart: same
    [problem] = judge_libraries(loaded, WHEELS)
    assert "cudnn 9.12.0" in problem and "9.13.0.50" in problem


def test_a_wheel_library_never_loaded_fails_and_no_wheel_means_nothing_to_compare() -> None:
    only_cudnn = [Loaded("cudnn", WHEELS[0].files[0], "9.13.0")]
    [problem] = judge_libraries(only_cudnn, WHEELS)
    assert "nvidia-cublas ships cublas" in problem
    # torch built against the system's libraries (no nvidia-* wheels): nothing to judge
    assert judge_libraries([Loaded("cudnn", "/usr/lib/libcudnn.so.9", "9.1.0")], []) == []
