"""Release manifests and the Release aggregate, without a database."""

from __future__ import annotations

import dataclasses

from control.domain import MANIFEST_KIND, Release, ReleaseManifest, release_id
from control.domain.events import event_fields

MANIFEST = ReleaseManifest(
    tenant="acme", adapter_digest="sha256:" + "a" * 64, base_digest="sha256:" + "b" * 64,
    tokenizer_digest="sha256:" + "c" * 64, chat_template_digest=None,
    inference_defaults={"max_tokens": 64}, evaluation_report_digest="sha256:" + "e" * 64)
DIGEST = "sha256:" + "f" * 64


def test_the_release_event_stores_exactly_the_manifest_fields() -> None:
    manifest_fields = {f.name: f.type for f in dataclasses.fields(ReleaseManifest)}
    event_fields_ = {f.name: f.type for f in dataclasses.fields(Release.ReleaseCreated)}
    bookkeeping = {"originator_id", "originator_version", "timestamp", "originator_topic"}
    assert {k: v for k, v in event_fields_.items() if k not in bookkeeping} == {
        "digest": "str", **manifest_fields, "actor": "str"}


def test_a_release_is_created_from_its_manifest() -> None:
    release = Release.create(DIGEST, MANIFEST, "op")
    assert release.id == release_id(DIGEST) and release.digest == DIGEST
    assert release.manifest == MANIFEST
    assert release.tenant == "acme" and release.adapter_digest == MANIFEST.adapter_digest
    (created,) = release.collect_events()
    assert ReleaseManifest.of(created) == MANIFEST
    assert event_fields(created) == {"digest": DIGEST, **MANIFEST.as_dict(), "actor": "op"}


def test_the_manifest_document_is_its_fields_and_kind() -> None:
    assert MANIFEST.document() == {"kind": MANIFEST_KIND, **dataclasses.asdict(MANIFEST)}
    assert MANIFEST_KIND == "loraplane.release/v1"
