"""Shared pytest fixtures."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures_control import Artifacts, build_artifacts


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """A CLI verb run in-process (``serve``, ``rollout run``) installs its own root handler on
    the stderr pytest captured for that test; later tests' background threads would log into
    that closed stream. Put the root logger back as each test found it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


@pytest.fixture(scope="session")
def kit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference model kit, built once per session (under two minutes on 2 CPU cores).

    Set ``LORAPLANE_TEST_KIT`` to a directory holding a built kit (``kit.json``) to reuse it.
    """
    given = os.environ.get("LORAPLANE_TEST_KIT")
    if given and (Path(given) / "kit.json").is_file():
        return Path(given)
    from control.tools.kit import build_kit

    out = tmp_path_factory.mktemp("kit")
    build_kit(out)
    return out


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    """Tiny control-plane fixtures (bases, tokenizer, adapters, broken variants), built once."""
    return build_artifacts(tmp_path_factory.mktemp("control-artifacts"))
