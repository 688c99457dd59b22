"""Release manifests, evaluation and gate reports, golden task sets and chat templates as
content-addressed documents.

Each document is stored in the artifact store as a directory holding one canonical JSON file
(sorted keys, no whitespace), so it is named by the one digest rule of
``control.contracts.digests`` and
can be fetched back by digest. A release manifest names everything that decides what a request
on that release computes: adapter, base, tokenizer, chat template, inference defaults and the
evaluation report that let it into canary; its fields and its document are defined once, by
``control.domain.ReleaseManifest``.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from control.contracts.digests import directory_digest
from control.contracts.documents import canonical_json, document_digest
from control.contracts.sampling import InvalidParameter, check_defaults
from control.contracts.store import ArtifactStore
from control.domain import DomainError, ReleaseManifest

MANIFEST_FILE = "release.json"
REPORT_FILE = "evaluation.json"  # a report written outside the gate (recorded as external)
GATE_REPORT_FILE = "gate_report.json"  # a report the evaluation gate wrote
TEMPLATE_FILE = "chat_template.json"
MAX_REPORT_BYTES = 1 << 20
MAX_SUMMARY_KEYS = 32


def put_document(store: ArtifactStore, file_name: str, data: Any) -> str:
    """Store ``data`` as canonical JSON under its digest; return the digest."""
    with tempfile.TemporaryDirectory(prefix="lp-doc-") as tmp:
        d = Path(tmp) / "doc"
        d.mkdir()
        (d / file_name).write_bytes(canonical_json(data))
        digest = directory_digest(d)
        store.put(d, digest)
    return digest


def get_document(store: ArtifactStore, file_name: str, digest: str) -> Any:
    """The JSON document stored under ``digest`` (bytes checked against the digest)."""
    return json.loads((store.verify(digest) / file_name).read_text(encoding="utf-8"))


def parse_defaults(data: dict[str, Any] | None) -> dict[str, Any]:
    """A release's inference defaults (what a request that omits a sampling parameter gets, on
    every route), checked against the one sampling contract; returned without unset fields."""
    if data is not None and not isinstance(data, dict):
        raise DomainError("invalid inference defaults: expected an object")
    try:
        return dict(check_defaults(data or {}))
    except InvalidParameter as e:
        raise DomainError(f"invalid inference defaults: {e}") from None


def load_report(path: Path) -> dict[str, Any]:
    """Read an evaluation report: a JSON object of at most 1 MiB, no NaN or infinity."""
    if not path.is_file() or path.stat().st_size > MAX_REPORT_BYTES:
        raise DomainError(f"evaluation report must be a JSON file of at most {MAX_REPORT_BYTES} "
                          "bytes")
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError):
        raise DomainError("evaluation report is not valid JSON") from None
    return check_report(data)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def check_report(data: Any) -> dict[str, Any]:
    """An evaluation report is a non-empty JSON object."""
    if not isinstance(data, dict) or not data:
        raise DomainError("evaluation report must be a non-empty JSON object")
    try:
        canonical_json(data)
    except ValueError:
        raise DomainError("evaluation report must not hold NaN or infinity") from None
    return data


def report_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The report's top-level scalar fields (numbers, booleans, short strings) for the event."""
    out: dict[str, Any] = {}
    for key in sorted(report)[:MAX_SUMMARY_KEYS]:
        v = report[key]
        number = isinstance(v, (int, float)) and math.isfinite(v)
        if number or isinstance(v, bool) or (isinstance(v, str) and len(v) <= 64):
            out[str(key)[:64]] = v
    return out


def put_manifest(store: ArtifactStore, manifest: ReleaseManifest) -> str:
    """Store a release manifest's document; return its digest, which names the release."""
    return put_document(store, MANIFEST_FILE, manifest.document())


def chat_template_document(store: ArtifactStore, tokenizer_digest: str) -> dict[str, Any] | None:
    """The tokenizer's chat template as the document it is stored as; None if it has none."""
    try:
        config = json.loads((store.path(tokenizer_digest) / "tokenizer_config.json")
                            .read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError):
        return None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if not template:
        return None
    return {"chat_template": template}


def chat_template_name(store: ArtifactStore, tokenizer_digest: str) -> str | None:
    """The digest the tokenizer's chat template is (or would be) stored under, storing nothing:
    what a gate report names, and what a command checks before it stores anything."""
    doc = chat_template_document(store, tokenizer_digest)
    return None if doc is None else document_digest(TEMPLATE_FILE, doc)


def chat_template_digest(store: ArtifactStore, tokenizer_digest: str) -> str | None:
    """The digest of the tokenizer's chat template, stored as a document; None if it has none."""
    doc = chat_template_document(store, tokenizer_digest)
    return None if doc is None else put_document(store, TEMPLATE_FILE, doc)
