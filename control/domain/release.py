"""Release manifests and the ``Release`` aggregate: what a route serves, named by its digest.

A ``ReleaseManifest`` names everything that decides what a request on a release computes:
adapter, base, tokenizer, chat template, inference defaults and the evaluation report that let
the adapter into canary. Its ``document()`` is the JSON the release digest covers (stored as
canonical JSON by ``control.app.releases``); the ``Release`` aggregate records the manifest
once, under an id derived from that digest, and never changes. Routing points at releases.

The manifest's fields are defined here once: the document, the ``Release`` aggregate, its
``ReleaseCreated`` event and the routing projection's release row all derive from them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any
from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.ids import release_id
from control.domain.names import check_actor

# The document's kind tag: part of every release digest, so it changes only with the format.
MANIFEST_KIND = "loraplane.release/v1"


@dataclass(frozen=True)
class ReleaseManifest:
    """What one release serves. ``tenant`` and ``adapter_digest`` are None for an operator's
    base-only release; ``chat_template_digest`` is None when the tokenizer has no template."""

    tenant: str | None
    adapter_digest: str | None
    base_digest: str
    tokenizer_digest: str
    chat_template_digest: str | None
    inference_defaults: dict[str, Any]
    evaluation_report_digest: str | None

    @classmethod
    def of(cls, source: Any) -> ReleaseManifest:
        """The manifest that ``source`` carries as attributes of the same names (a ``Release``,
        its ``ReleaseCreated`` event)."""
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        """The manifest's fields by name (a copy)."""
        return asdict(self)

    def document(self) -> dict[str, Any]:
        """The manifest document: what the release digest covers."""
        return {"kind": MANIFEST_KIND, **self.as_dict()}


class Release(Aggregate):
    """An immutable release manifest; its id derives from the manifest's digest."""

    class ReleaseCreated(Aggregate.Created):
        # The stored event: the digest, the manifest's fields under their own names, the actor.
        # Spelled out rather than inherited (the library builds events from annotations), so
        # that what is stored changes only here; tests hold it to ReleaseManifest's fields.
        digest: str
        tenant: str | None  # None: an operator's base-only release
        adapter_digest: str | None
        base_digest: str
        tokenizer_digest: str
        chat_template_digest: str | None
        inference_defaults: dict[str, Any]
        evaluation_report_digest: str | None
        actor: str

    @staticmethod
    def create_id(digest: str) -> UUID:
        return release_id(digest)

    @event(ReleaseCreated)
    def __init__(
        self,
        digest: str,
        tenant: str | None,
        adapter_digest: str | None,
        base_digest: str,
        tokenizer_digest: str,
        chat_template_digest: str | None,
        inference_defaults: dict[str, Any],
        evaluation_report_digest: str | None,
        actor: str,
    ) -> None:
        self.digest = digest
        self.tenant = tenant
        self.adapter_digest = adapter_digest
        self.base_digest = base_digest
        self.tokenizer_digest = tokenizer_digest
        self.chat_template_digest = chat_template_digest
        self.inference_defaults = inference_defaults
        self.evaluation_report_digest = evaluation_report_digest

    @classmethod
    def create(cls, digest: str, manifest: ReleaseManifest, actor: str) -> Release:
        """The release of ``manifest``, named by ``digest`` (the digest of its document)."""
        return cls(digest=digest, actor=check_actor(actor), **manifest.as_dict())

    @property
    def manifest(self) -> ReleaseManifest:
        """The manifest this release was created from."""
        return ReleaseManifest.of(self)
