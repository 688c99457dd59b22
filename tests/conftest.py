"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures_control import Artifacts, build_artifacts


@pytest.fixture(scope="session")
def kit_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference model kit, built once per session (about half a minute on 2 CPU cores).

    Set ``LORAPLANE_TEST_KIT`` to a directory holding a built kit (``kit.json``) to reuse it.
    """
    given = os.environ.get("LORAPLANE_TEST_KIT")
    if given and (Path(given) / "kit.json").is_file():
        return Path(given)
    from control.ops.kit import build_kit

    out = tmp_path_factory.mktemp("kit")
    build_kit(out)
    return out


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    """Tiny control-plane fixtures (bases, tokenizer, adapters, broken variants), built once."""
    return build_artifacts(tmp_path_factory.mktemp("control-artifacts"))
