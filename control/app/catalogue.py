"""The catalogue desk: base models, adapters and the release manifests built from them.

Artifacts (base model, tokenizer, adapter bytes, release manifests) enter the content-addressed
store before their event is saved; a rejected adapter leaves nothing in the store, only a
``RegistrationRejected`` event for the audit. See ``control.app.validation`` and
``control.app.limits`` for an adapter's checks.

:meth:`CatalogueDesk.new_release` is the one way a ``Release`` is made (the lifecycle, gate,
upgrade and alias desks all use it): the manifest is stored by digest, and the same manifest is
always the same release.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from control.app import limits
from control.app.releases import chat_template_digest, put_document, put_manifest
from control.app.unit_of_work import UnitOfWork
from control.app.validation import (
    ALLOWED_FILES,
    BaseInfo,
    base_linear_shapes,
    check_files,
    validate_adapter,
)
from control.contracts.digests import directory_digest
from control.contracts.golden import GOLDEN_FILE, GoldenSet
from control.domain import (
    Adapter,
    AdapterMetadata,
    Alias,
    AlreadyExists,
    BaseModel,
    BaseName,
    DomainError,
    NotFound,
    RegistrationRejection,
    Release,
    ReleaseManifest,
    ValidationFailed,
    adapter_id,
    alias_id,
    base_id,
    base_name_id,
    check_actor,
    check_name,
    release_id,
)


class CatalogueDesk:
    """Registers bases and adapters and makes releases on ``registry``."""

    def __init__(self, registry: UnitOfWork) -> None:
        self.registry = registry

    # -- bases ------------------------------------------------------------------------------

    def register_base(self, base_dir: Path, tokenizer_dir: Path, *, name: str, actor: str,
                      alias: str | None = None) -> str:
        """Store and register a base model with its tokenizer; return the base digest.

        ``linear_shapes`` (every Linear weight, from the safetensors headers) is recorded so
        adapters can be checked against the base without loading it. ``alias`` creates an
        operator-owned alias whose stable release is the base alone (grant it to tenants for
        base-only tickets).
        """
        reg = self.registry
        check_name("base", name)
        check_actor(actor)
        if alias is not None:
            check_name("alias", alias)
        base_dir, tokenizer_dir = Path(base_dir), Path(tokenizer_dir)
        shapes = base_linear_shapes(base_dir)
        digest = directory_digest(base_dir)
        tokenizer_digest = directory_digest(tokenizer_dir)
        if reg.exists(base_id(digest)):
            raise AlreadyExists("this base model is already registered")
        if reg.exists(base_name_id(name)):
            raise AlreadyExists(f"a base model named {name!r} is already registered")
        if alias is not None and reg.exists(alias_id(alias)):
            raise AlreadyExists(f"alias {alias!r} is already taken")
        reg.store.put(base_dir, digest)
        reg.store.put(tokenizer_dir, tokenizer_digest)
        base = BaseModel.register(name=name, digest=digest, tokenizer_digest=tokenizer_digest,
                                  linear_shapes=shapes, actor=actor)
        index = BaseName(name=name, digest=digest, actor=actor)
        release = route = None
        if alias is not None:
            release = self.new_base_release(base, actor)
            route = Alias.create(alias, owner=None, release=release.digest, actor=actor)
        reg.commit(base, index, release, route, what="base model")
        return digest

    def base_info(self, ref: str) -> BaseInfo | None:
        """What adapter validation needs of a registered base (digest or name); None if
        there is none."""
        try:
            b = self.registry.base(ref)
        except (NotFound, DomainError):
            return None
        return BaseInfo(name=b.name, digest=b.digest, tokenizer_digest=b.tokenizer_digest,
                        linear_shapes=b.linear_shapes)

    # -- releases ---------------------------------------------------------------------------

    def new_base_release(self, base: BaseModel, actor: str) -> Release:
        """The release that serves ``base`` alone (new, with pending events, or existing)."""
        return self.new_release(ReleaseManifest(
            tenant=None, adapter_digest=None, base_digest=base.digest,
            tokenizer_digest=base.tokenizer_digest,
            chat_template_digest=chat_template_digest(self.registry.store,
                                                      base.tokenizer_digest),
            inference_defaults={}, evaluation_report_digest=None), actor)

    def new_release(self, manifest: ReleaseManifest, actor: str) -> Release:
        """A release manifest stored by digest; the Release aggregate is new (unsaved: the
        caller saves it with the move that needs it) or existing."""
        reg = self.registry
        digest = put_manifest(reg.store, manifest)
        if reg.exists(release_id(digest)):
            return reg.release_manifest(digest)  # same manifest: same release, no new event
        return Release.create(digest, manifest, actor)

    # -- adapters ---------------------------------------------------------------------------

    def register_adapter(
        self,
        adapter_dir: Path,
        *,
        tenant: str,
        alias: str,
        actor: str,
        base: str | None = None,
        signature: Path | None = None,
        metadata: AdapterMetadata | None = None,
        golden: GoldenSet | None = None,
    ) -> str:
        """Validate, store and register a tenant's LoRA adapter (state ``draft``); return its
        digest. ``alias`` (created, owned by ``tenant``, if new) is where its releases will be
        routed once it reaches canary; registering does not move the alias. ``golden``: the
        golden task set the evaluation gate judges it by, stored and recorded
        (``GoldenSetRecorded``) in the same transaction.

        ``signature``: a model_signing bundle over the folder, verified against the tenant's
        trusted keys (required when the tenant's policy says so). Raises ValidationFailed (and
        records ``RegistrationRejected``, storing nothing) if a check fails; see
        ``control.app.validation`` and ``control.app.limits`` for the checks.
        """
        reg = self.registry
        check_actor(actor)
        check_name("alias", alias)
        meta = metadata or AdapterMetadata()
        policy = reg.tenant(tenant).policy  # NotFound before anything else
        try:
            with tempfile.TemporaryDirectory(prefix="lp-adapter-") as tmp:
                # Validate, digest and store one private copy, so the bytes that were checked
                # are the bytes that are stored, whatever happens to the source meanwhile.
                src = Path(adapter_dir)
                limits.check_submission(src, policy)
                check_files(src)
                staged = Path(tmp) / "adapter"
                staged.mkdir()
                for file_name in sorted(ALLOWED_FILES):
                    shutil.copyfile(src / file_name, staged / file_name)
                facts = validate_adapter(
                    staged, lookup_base=self.base_info, base=base,
                    max_rank=limits.rank_limit(policy, reg.settings.max_rank))
                limits.check_targets(policy, facts.base_digest, facts.target_modules)
                limits.check_adapter_count(  # with any of a batch's, not yet projected
                    policy, reg.follower.routing().live_adapter_count(tenant)
                    + reg.unsaved_adapters(tenant))
                verified = None
                if signature is not None:
                    # x509 and model_signing: only registrations that carry a signature load them
                    from control.app.signatures import verify_signature

                    verified = verify_signature(staged, Path(signature), policy.trusted_keys)
                elif policy.require_signature:
                    raise ValidationFailed("signature", "your tenant's policy requires a "
                                                        "model_signing signature (--signature)")
                digest = directory_digest(staged)
                route = reg.alias_or_none(alias)
                if route is not None and route.owner != tenant:
                    raise ValidationFailed(
                        "alias", f"alias {alias!r} is already taken; choose another alias")
                if reg.exists(adapter_id(digest)):
                    raise AlreadyExists("an adapter with these exact bytes is already registered")
                reg.store.put(staged, digest)
        except ValidationFailed as failure:
            # Recorded for the audit, alone: nothing of the refused adapter is stored.
            reg.commit(RegistrationRejection(check=failure.check, message=failure.message,
                                             tenant=tenant, actor=actor),
                       what="registration rejection")
            raise
        adapter = Adapter(tenant=tenant, digest=digest, base_digest=facts.base_digest,
                          tokenizer_digest=facts.tokenizer_digest, rank=facts.rank,
                          target_modules=facts.target_modules, alias=alias,
                          metadata=meta.to_json(),
                          signature=verified.to_json() if verified else None, actor=actor)
        if route is None:
            route = Alias.create(alias, owner=tenant, release=None, actor=actor)
        if golden is not None:
            golden_digest = put_document(reg.store, GOLDEN_FILE, golden.document())
            adapter.record_golden_set(golden_digest, golden.family, len(golden.tasks), actor)
        reg.commit(adapter, route, what="adapter")
        return digest


__all__ = ["CatalogueDesk"]
