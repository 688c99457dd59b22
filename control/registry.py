"""The control plane application: commands that check the rules and record events.

``Registry`` is an eventsourcing ``Application`` persisted through eventsourcing-sqlalchemy at
the one database URL of the deployment (SQLite file or PostgreSQL). Each command loads the
aggregates it needs, lets them apply the domain rules (``control.domain``), saves every new
event in one transaction, and then brings the projection tables up to date, so that a CLI
command run without a ``serve`` process still leaves fresh routing tables behind.

Artifacts (base model, tokenizer, adapter bytes) enter the content-addressed store before their
registration event is saved; a rejected adapter leaves nothing in the store, only a
``RegistrationRejected`` event for the audit.
"""

from __future__ import annotations

import base64
import binascii
import logging
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from uuid import UUID

import sqlalchemy as sa
from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError as EventStoreIntegrityError

from control.config import Settings
from control.db import make_engine
from control.digests import DIGEST_RE, directory_digest
from control.domain import (
    STABLE,
    Adapter,
    Alias,
    AlreadyExists,
    BaseModel,
    BaseName,
    DomainError,
    NotFound,
    RegistrationRejection,
    SigningKey,
    Tenant,
    ValidationFailed,
    adapter_id,
    alias_id,
    base_id,
    base_name_id,
    check_actor,
    check_name,
    signing_key_id,
    tenant_id,
)
from control.store import ArtifactStore
from control.validation import (
    ALLOWED_FILES,
    BaseInfo,
    base_linear_shapes,
    check_files,
    validate_adapter,
)

if TYPE_CHECKING:
    from projections.follower import ProjectionFollower

log = logging.getLogger("loraplane.registry")

API_KEY_PREFIX = "lp_"
TAggregate = TypeVar("TAggregate", bound=Aggregate)


class Registry(Application[UUID]):
    """Registers bases, adapters, tenants, aliases, grants and signing keys as events."""

    name = "Registry"  # event table: registry_events

    def __init__(self, settings: Settings | None = None, *, follow: bool = True) -> None:
        """``follow``: catch the projection tables up after each successful command."""
        self.settings = settings or Settings.from_env()
        self.settings.ensure_dirs()
        super().__init__(env={
            "PERSISTENCE_MODULE": "eventsourcing_sqlalchemy",
            "SQLALCHEMY_URL": self.settings.db_url,
        })
        self.store = ArtifactStore(self.settings.store_dir)
        self._follow = follow
        self._follower: ProjectionFollower | None = None

    # -- projections ------------------------------------------------------------------------

    @property
    def follower(self) -> ProjectionFollower:
        """This process's follower of the routing projection (created on first use)."""
        if self._follower is None:
            from projections.follower import ProjectionFollower

            self._follower = ProjectionFollower(self, make_engine(self.settings.db_url))
        return self._follower

    def _after_command(self) -> None:
        if not self._follow:
            return
        try:
            self.follower.catch_up()
        except Exception:
            # The command is recorded; a running follower (or the next command) catches up.
            log.warning("projection catch-up after command failed", exc_info=True)

    def _save(self, *aggregates: Aggregate | None, what: str) -> None:
        """Save all pending events of ``aggregates`` atomically; a lost race is AlreadyExists."""
        try:
            self.save(*aggregates)
        except (EventStoreIntegrityError, sa.exc.IntegrityError):
            raise AlreadyExists(f"{what} changed concurrently or already exists; retry") from None
        self._after_command()

    # -- reading aggregates -----------------------------------------------------------------

    def _get(self, cls: type[TAggregate], aggregate_id: UUID, what: str) -> TAggregate:
        try:
            agg: Aggregate = self.repository.get(aggregate_id)
        except AggregateNotFoundError:
            raise NotFound(f"{what} not found") from None
        if not isinstance(agg, cls):
            raise NotFound(f"{what} not found")
        return agg

    def _exists(self, aggregate_id: UUID) -> bool:
        return aggregate_id in self.repository

    def tenant(self, name: str) -> Tenant:
        """The tenant called ``name``; NotFound if none."""
        return self._get(Tenant, tenant_id(name), "tenant")

    def tenant_exists(self, name: str) -> bool:
        return self._exists(tenant_id(name))

    def base(self, ref: str) -> BaseModel:
        """A registered base model by digest or by name; NotFound if none."""
        if DIGEST_RE.match(ref):
            return self._get(BaseModel, base_id(ref), "base model")
        index = self._get(BaseName, base_name_id(ref), "base model")
        return self._get(BaseModel, base_id(index.digest), "base model")

    def adapter(self, digest: str) -> Adapter:
        """A registered adapter by digest; NotFound if none."""
        return self._get(Adapter, adapter_id(digest), "adapter")

    def alias(self, name: str) -> Alias:
        """An alias by name; NotFound if none."""
        return self._get(Alias, alias_id(name), "alias")

    def _base_info(self, ref: str) -> BaseInfo | None:
        try:
            b = self.base(ref)
        except (NotFound, DomainError):
            return None
        return BaseInfo(name=b.name, digest=b.digest, tokenizer_digest=b.tokenizer_digest,
                        linear_shapes=b.linear_shapes)

    # -- commands ---------------------------------------------------------------------------

    def create_tenant(self, name: str, *, actor: str) -> str:
        """Create a tenant and return its API key; only the key's SHA-256 is recorded.

        The key is shown once: it cannot be recovered from the event history.
        """
        check_name("tenant", name)
        check_actor(actor)
        if self.tenant_exists(name):
            raise AlreadyExists(f"tenant {name!r} already exists")
        api_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
        self._save(Tenant.create(name, api_key, actor), what="tenant")
        return api_key

    def register_base(
        self,
        base_dir: Path,
        tokenizer_dir: Path,
        *,
        name: str,
        actor: str,
        alias: str | None = None,
    ) -> str:
        """Store and register a base model with its tokenizer; return the base digest.

        ``linear_shapes`` (every Linear weight, from the safetensors headers) is recorded so
        adapters can be checked against the base without loading it. ``alias`` creates an
        operator-owned alias that points at the base alone (grant it to tenants for base-only
        tickets).
        """
        check_name("base", name)
        check_actor(actor)
        if alias is not None:
            check_name("alias", alias)
        base_dir, tokenizer_dir = Path(base_dir), Path(tokenizer_dir)
        shapes = base_linear_shapes(base_dir)
        digest = directory_digest(base_dir)
        tokenizer_digest = directory_digest(tokenizer_dir)
        if self._exists(base_id(digest)):
            raise AlreadyExists("this base model is already registered")
        if self._exists(base_name_id(name)):
            raise AlreadyExists(f"a base model named {name!r} is already registered")
        if alias is not None and self._exists(alias_id(alias)):
            raise AlreadyExists(f"alias {alias!r} is already taken")
        self.store.put(base_dir, digest)
        self.store.put(tokenizer_dir, tokenizer_digest)
        base = BaseModel.register(name=name, digest=digest, tokenizer_digest=tokenizer_digest,
                                  linear_shapes=shapes, actor=actor)
        index = BaseName(name=name, digest=digest, actor=actor)
        route = None
        if alias is not None:
            route = Alias.create(alias, owner=None, base_digest=digest, adapter_digest=None,
                                 tokenizer_digest=tokenizer_digest, actor=actor)
        self._save(base, index, route, what="base model")
        return digest

    def register_adapter(
        self,
        adapter_dir: Path,
        *,
        tenant: str,
        alias: str,
        actor: str,
        base: str | None = None,
    ) -> str:
        """Validate, store and register a tenant's LoRA adapter (state ``draft``); return its
        digest. ``alias`` is pointed at it (created, owned by ``tenant``, if new).

        Raises ValidationFailed (and records ``RegistrationRejected``, storing nothing) if a
        check fails; see ``control.validation`` for the checks.
        """
        check_actor(actor)
        check_name("alias", alias)
        self.tenant(tenant)  # NotFound before anything else
        try:
            with tempfile.TemporaryDirectory(prefix="lp-adapter-") as tmp:
                # Validate, digest and store one private copy, so the bytes that were checked
                # are the bytes that are stored, whatever happens to the source meanwhile.
                src = Path(adapter_dir)
                check_files(src)
                staged = Path(tmp) / "adapter"
                staged.mkdir()
                for file_name in sorted(ALLOWED_FILES):
                    shutil.copyfile(src / file_name, staged / file_name)
                facts = validate_adapter(staged, lookup_base=self._base_info,
                                         max_rank=self.settings.max_rank, base=base)
                digest = directory_digest(staged)
                route = self._alias_or_none(alias)
                if route is not None and route.owner != tenant:
                    raise ValidationFailed(
                        "alias", f"alias {alias!r} is already taken; choose another alias")
                if self._exists(adapter_id(digest)):
                    raise AlreadyExists("an adapter with these exact bytes is already registered")
                self.store.put(staged, digest)
        except ValidationFailed as failure:
            self._reject(failure, tenant=tenant, actor=actor)
            raise
        adapter = Adapter(tenant=tenant, digest=digest, base_digest=facts.base_digest,
                          tokenizer_digest=facts.tokenizer_digest, rank=facts.rank,
                          target_modules=facts.target_modules, alias=alias, actor=actor)
        if route is None:
            route = Alias.create(alias, owner=tenant, base_digest=facts.base_digest,
                                 adapter_digest=digest, tokenizer_digest=facts.tokenizer_digest,
                                 actor=actor)
        else:
            route.point_to_adapter(adapter, actor)
        self._save(adapter, route, what="adapter")
        return digest

    def _alias_or_none(self, name: str) -> Alias | None:
        try:
            return self.alias(name)
        except NotFound:
            return None

    def _reject(self, failure: ValidationFailed, *, tenant: str, actor: str) -> None:
        rejection = RegistrationRejection(check=failure.check, message=failure.message,
                                          tenant=tenant, actor=actor)
        self.save(rejection)
        self._after_command()

    def promote(self, digest: str, to: str = STABLE, *, actor: str) -> None:
        """Move an adapter along its lifecycle (issue 2: draft -> stable).

        IllegalTransition (nothing recorded) if the lifecycle does not allow it.
        """
        adapter = self.adapter(digest)
        adapter.promote(to, actor)
        self._save(adapter, what="adapter")

    def revoke(self, digest: str, reason: str, *, actor: str) -> None:
        """Revoke an adapter, from any state; its routes stop being servable."""
        adapter = self.adapter(digest)
        adapter.revoke(reason, actor)
        self._save(adapter, what="adapter")

    def grant(self, tenant: str, alias: str, *, actor: str) -> None:
        """Allow ``tenant`` to resolve ``alias`` (both must exist)."""
        self.tenant(tenant)
        route = self.alias(alias)
        route.grant(tenant, actor)
        self._save(route, what="grant")

    def point_alias(self, alias: str, digest: str, *, actor: str) -> None:
        """Point ``alias`` at an adapter of its owner, or at a registered base alone."""
        route = self.alias(alias)
        if self._exists(adapter_id(digest)):
            route.point_to_adapter(self.adapter(digest), actor)
        elif self._exists(base_id(digest)):
            route.point_to_base(self.base(digest), actor)
        else:
            raise NotFound("no adapter or base model with that digest")
        self._save(route, what="alias")

    def record_signing_key(self, kid: str, public_key_b64: str, *, actor: str) -> None:
        """Record a ticket-signing public key (raw Ed25519, base64); a rotation adds a key."""
        check_name("key id", kid)
        check_actor(actor)
        try:
            raw = base64.b64decode(public_key_b64, validate=True)
        except (binascii.Error, ValueError):
            raise DomainError("public key must be base64") from None
        if len(raw) != 32:
            raise DomainError("public key must be a raw 32-byte Ed25519 key")
        if self._exists(signing_key_id(kid)):
            raise AlreadyExists(f"signing key {kid!r} is already recorded")
        self._save(SigningKey(kid=kid, public_key_b64=public_key_b64, actor=actor),
                   what="signing key")

    def __repr__(self) -> str:
        return f"Registry(home={self.settings.home!s})"
