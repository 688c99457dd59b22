"""Release manifests as stored documents: the digest of a known manifest never changes.

A release is named by the digest of its manifest document; routes, tickets and ledgers carry
that digest, so the document's bytes (canonical JSON of the fields and the kind tag) are pinned.
"""

from __future__ import annotations

from pathlib import Path

from control.app.releases import MANIFEST_FILE, canonical_json, get_document, put_manifest
from control.contracts.store import ArtifactStore
from control.domain import ReleaseManifest

ADAPTER_RELEASE = ReleaseManifest(
    tenant="acme", adapter_digest="sha256:" + "a" * 64, base_digest="sha256:" + "b" * 64,
    tokenizer_digest="sha256:" + "c" * 64, chat_template_digest="sha256:" + "d" * 64,
    inference_defaults={"max_tokens": 64, "temperature": 0.5, "stop": ["\n\n"]},
    evaluation_report_digest="sha256:" + "e" * 64)
BASE_RELEASE = ReleaseManifest(
    tenant=None, adapter_digest=None, base_digest="sha256:" + "b" * 64,
    tokenizer_digest="sha256:" + "c" * 64, chat_template_digest=None, inference_defaults={},
    evaluation_report_digest=None)


def test_the_digest_of_a_known_manifest_is_pinned(tmp_path: Path) -> None:
    store = ArtifactStore(tmp_path / "store")
    # Computed by the manifest code before the domain was split (issue 11); never changes.
    assert put_manifest(store, ADAPTER_RELEASE) == (
        "sha256:3645d6d4dc8ed0d457162b6679cc3486b6ec6e95727e7818642e40ac3d06ea44")
    assert put_manifest(store, BASE_RELEASE) == (
        "sha256:b2a20e7fd86dacab6a293e36956c3dba9facc427209c00da4ffe95655532ad09")


def test_the_manifest_document_is_canonical_json_of_its_fields(tmp_path: Path) -> None:
    assert canonical_json(BASE_RELEASE.document()) == (
        b'{"adapter_digest":null,"base_digest":"sha256:' + b"b" * 64
        + b'","chat_template_digest":null,"evaluation_report_digest":null,'
        b'"inference_defaults":{},"kind":"loraplane.release/v1","tenant":null,'
        b'"tokenizer_digest":"sha256:' + b"c" * 64 + b'"}')
    store = ArtifactStore(tmp_path / "store")
    digest = put_manifest(store, ADAPTER_RELEASE)
    stored = get_document(store, MANIFEST_FILE, digest)
    assert stored == ADAPTER_RELEASE.document()
    assert ReleaseManifest(**{k: v for k, v in stored.items() if k != "kind"}) == ADAPTER_RELEASE
