"""Model repositories derived from ``model_repository/`` for test and benchmark deployments.

``loraplane serve`` and ``triton-host`` always launch the project's own ``model_repository/``:
nothing a production process reads (option, variable, file) can point Triton elsewhere. A test
that injects faults into the engine, or a benchmark that measures an ungoverned peer, builds its
own repository here: the same two models and configurations, with the engine model's
``model.py`` replaced by source the caller supplies.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from control.contracts.wire import ENGINE_MODEL
from control.ops.triton_server import MODEL_REPOSITORY


def derived_repository(dest: Path, engine_model_source: str) -> Path:
    """Copy ``model_repository/`` to ``dest`` with ``lora_llm_stream/1/model.py`` replaced by
    ``engine_model_source``; returns ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(MODEL_REPOSITORY, dest, ignore=shutil.ignore_patterns("__pycache__"))
    (dest / ENGINE_MODEL / "1" / "model.py").write_text(engine_model_source)
    return dest
