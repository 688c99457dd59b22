"""Canonical JSON documents: one byte string per JSON value, named by the one digest rule.

Release manifests, evaluation and gate reports, chat templates and golden task sets are stored
in the artifact store as a directory holding one canonical JSON file (sorted keys, compact
separators, UTF-8, no NaN or infinity), so that a document is named by
``control.contracts.digests`` like any other artifact. Defined here, below both the registry
(which stores documents) and the kit and gate (which name them before storing), so that both
compute the same digest for the same document.
"""

from __future__ import annotations

import json
from typing import Any

from control.contracts.digests import files_digest


def canonical_json(data: Any) -> bytes:
    """Sorted keys, compact separators, UTF-8: one byte string per JSON value."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def document_digest(file_name: str, data: Any) -> str:
    """The digest ``data`` is stored under as ``file_name`` (what ``put_document`` returns)."""
    return files_digest({file_name: canonical_json(data)})
