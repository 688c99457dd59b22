"""The control plane application: commands that check the rules and record events.

``Registry`` is an eventsourcing ``Application`` persisted through eventsourcing-sqlalchemy at
the one database URL of the deployment (SQLite file or PostgreSQL). Each command loads the
aggregates it needs, lets them apply the domain rules (``control.domain``), saves every new
event in one transaction, and then brings the projection tables up to date, so that a CLI
command run without a ``serve`` process still leaves fresh routing tables behind.

Two commands that change the same aggregate at once (two moves of one alias) collide on the
event store's unique (aggregate id, version) index: one is recorded, the other raises
``Conflict`` and records nothing.

Artifacts (base model, tokenizer, adapter bytes, release manifests, evaluation reports) enter
the content-addressed store before their event is saved; a rejected adapter leaves nothing in
the store, only a ``RegistrationRejected`` event for the audit.

Operators walk an adapter through its lifecycle one step at a time (``promote``) or with
``advance`` (evaluation report -> candidate -> canary -> stable, each step its own event). What
each move needs is ``control.domain.evidence``: an external report says it passed and names its
producer, and never overrides a failing gate report; stable needs a completed rollout, the
alias's first release, or a break-glass (``break_glass``: an operator's recorded override, in
the same transaction as the move it allows).

Commands that take something away (adapter revocation; revoking or rotating an API key, removing
a grant, retiring a signing key) report success only once the projection tables that gateways
and Triton hosts read show the change; otherwise they raise :class:`NotYetVisible`, saying that
the change is recorded but not yet in force. A registry that follows drives the catch-up itself
(and retries it) while it waits; one that does not waits for a follower elsewhere.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import logging
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from uuid import UUID

import sqlalchemy as sa
from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError as EventStoreIntegrityError
from eventsourcing.persistence import Recording

from control.app import evidence, key_ring, limits
from control.app.integrity import AuditSeal
from control.app.releases import (
    REPORT_FILE,
    chat_template_digest,
    chat_template_name,
    check_report,
    parse_defaults,
    put_document,
    put_manifest,
    report_summary,
)
from control.app.validation import (
    ALLOWED_FILES,
    BaseInfo,
    base_linear_shapes,
    check_files,
    validate_adapter,
)
from control.contracts.config import Settings
from control.contracts.digests import DIGEST_RE, directory_digest
from control.contracts.golden import GOLDEN_FILE, GoldenSet
from control.contracts.store import ArtifactStore
from control.domain import (
    CANARY,
    CANDIDATE,
    DEPRECATED,
    DRAFT,
    REVOKED,
    STABLE,
    Adapter,
    AdapterMetadata,
    Alias,
    AlreadyExists,
    BaseModel,
    BaseName,
    Combination,
    Conflict,
    DomainError,
    IllegalTransition,
    NotFound,
    RegistrationRejection,
    Release,
    ReleaseManifest,
    SigningKey,
    Tenant,
    TenantPolicy,
    ValidationFailed,
    adapter_id,
    alias_id,
    base_id,
    base_name_id,
    check_actor,
    check_name,
    fall_back,
    is_servable,
    lifecycle_guard,
    next_state,
    release_id,
    signing_key_id,
    tenant_id,
)
from control.domain.evidence import StableBasis, external_report

if TYPE_CHECKING:
    from control.app.integrity import AuditSeal
    from control.contracts.tickets import TicketSigner

log = logging.getLogger("loraplane.registry")

API_KEY_PREFIX = "lp_"
DEFAULT_CANARY_PERCENT = 10
# How long a revoking command waits for the tables hosts read to show its change.
VISIBLE_WITHIN_S = 5.0
_VISIBLE_POLL_S = 0.05
TAggregate = TypeVar("TAggregate", bound=Aggregate)


class NotYetVisible(RuntimeError):
    """The command is recorded in the event store, but the projection tables that gateways and
    hosts read do not show it yet, so it is not in force yet.

    ``result``: what the command would have returned (a rotated API key must still reach its
    owner: it is recorded, and shown nowhere else).
    """

    def __init__(self, message: str, result: object = None) -> None:
        super().__init__(message)
        self.result = result


class RoutingReads(Protocol):
    """The routing projection's reads a command checks (``projections.routing.RoutingView``)."""

    def tenant_for_api_key(self, api_key: str) -> str | None: ...
    def api_key_count(self, tenant: str) -> int: ...
    def is_granted(self, tenant: str, alias: str) -> bool: ...
    def is_revoked(self, digest: str, *, immediate: bool = False) -> bool: ...
    def signing_keys(self) -> dict[str, str]: ...
    def retired_key_ids(self) -> frozenset[str]: ...
    def live_adapter_count(self, tenant: str) -> int: ...
    def aliases_using_adapter(self, digest: str) -> list[str]: ...


class ReadModel(Protocol):
    """The projections as the registry uses them (``projections.follower.ProjectionFollower``).

    Injected (``projections.follower.open_registry``) rather than imported: the projections
    read the registry's events, so the dependency points projections -> app, never back."""

    engine: sa.Engine

    def catch_up(self, recorded: Sequence[Recording[Any]] = ()) -> int: ...
    def position(self) -> int: ...
    def routing(self) -> RoutingReads: ...


class Registry(Application[UUID]):
    """Registers bases, adapters, releases, tenants, aliases, grants and keys as events."""

    name = "Registry"  # event table: registry_events

    def __init__(self, settings: Settings | None = None, *, follow: bool = True,
                 read_model: Callable[[Registry], ReadModel] | None = None) -> None:
        """``follow``: catch the projection tables up after each successful command.
        ``read_model``: opens the projections this registry catches up and checks commands
        against (``projections.follower.open_registry`` passes it). Without one, a command
        that needs the projections raises; recording events still works (a host's steps)."""
        self.settings = settings or Settings.from_env()
        self.settings.ensure_dirs()
        super().__init__(env={
            # eventsourcing-sqlalchemy, each event chained as it is recorded
            "PERSISTENCE_MODULE": "control.app.chain:ChainedFactory",
            "SQLALCHEMY_URL": self.settings.db_url,
        })
        self.store = ArtifactStore(self.settings.store_dir)
        self._follow = follow
        self._open_read_model = read_model
        self._follower: ReadModel | None = None
        self._seal: AuditSeal | None = None

    # -- projections ------------------------------------------------------------------------

    @property
    def follower(self) -> ReadModel:
        """This process's follower of the routing projection (opened on first use)."""
        if self._follower is None:
            if self._open_read_model is None:
                raise RuntimeError("this registry was opened without its projections: open it "
                                   "with projections.follower.open_registry")
            self._follower = self._open_read_model(self)
        return self._follower

    @property
    def seal(self) -> AuditSeal:
        """This process's writer of signed audit checkpoints (created on first use)."""
        if self._seal is None:
            self._seal = AuditSeal.for_registry(self)
        return self._seal

    def _after_command(self, recordings: list[Recording[UUID]]) -> None:
        """Catch the projections up and seal the audit trail when due, after ``recordings``
        (what the command's save recorded) were committed."""
        if not self._follow:
            return
        try:
            self.follower.catch_up(recordings)
        except Exception:
            # The command is recorded; a running follower (or the next command) catches up.
            log.warning("projection catch-up after command failed", exc_info=True)
        try:
            self.seal.seal_if_due(upto=max((r.notification.id for r in recordings), default=0))
        except Exception:
            log.warning("audit checkpoint after command failed", exc_info=True)

    def _save(self, *aggregates: Aggregate | None, what: str,
              already: str | None = None) -> int:
        """Save all pending events of ``aggregates`` atomically; return the position of the
        last one in the notification log.

        A lost race on a new aggregate is AlreadyExists (``already``: its message); on an
        existing one, Conflict.
        """
        creating = any(e.originator_version == 1 for a in aggregates if a is not None
                       for e in a.pending_events)
        # Record the command's events in the order they happened, across aggregates (each
        # aggregate's own events keep their order): the audit log lists events by position
        # and shows their times, which must then never go backwards within one command.
        events = list(heapq.merge(*(a.collect_events() for a in aggregates if a is not None),
                                  key=lambda e: e.timestamp))
        try:
            recordings = self.save(*events)
        except (EventStoreIntegrityError, sa.exc.IntegrityError):
            if creating:
                raise AlreadyExists(already or f"{what} already exists (or was created "
                                    "concurrently)") from None
            raise Conflict(f"{what} was changed concurrently by another command; nothing was "
                           "recorded, retry") from None
        self._after_command(recordings)
        return max((r.notification.id for r in recordings), default=0)

    def _confirm_visible(self, position: int, visible: Callable[[RoutingReads], bool],
                         what: str, wait_s: float) -> None:
        """Return once the projection tables have applied the log up to ``position`` (the
        command's own events) and ``visible`` holds on them, else raise NotYetVisible after
        ``wait_s`` seconds. Catches the projections up meanwhile when this registry follows (a
        catch-up that failed after the save is retried here, not swallowed).

        The position matters for changes that remove rows: a projection that has not yet
        applied the grant would also "show" its removal, and then apply the grant alone."""
        view = self.follower.routing()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if self.follower.position() >= position and visible(view):
                    return
            except sa.exc.SQLAlchemyError:
                log.warning("reading the projection tables failed", exc_info=True)
            if time.monotonic() >= deadline:
                raise NotYetVisible(
                    f"{what} is recorded but not yet visible to gateways and Triton hosts: the "
                    f"projection tables did not show it within {wait_s:g} s, so it is not in "
                    "force yet. Check the projection follower (the control plane's log); it "
                    "takes effect once the follower catches up")
            if self._follow:
                try:
                    self.follower.catch_up()
                except Exception:
                    log.warning("projection catch-up failed; retrying", exc_info=True)
            time.sleep(_VISIBLE_POLL_S)

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

    def base(self, ref: str) -> BaseModel:
        """A registered base model by digest or by name; NotFound if none."""
        if DIGEST_RE.match(ref):
            return self._get(BaseModel, base_id(ref), "base model")
        index = self._get(BaseName, base_name_id(ref), "base model")
        return self._get(BaseModel, base_id(index.digest), "base model")

    def adapter(self, digest: str) -> Adapter:
        """A registered adapter by digest; NotFound if none."""
        return self._get(Adapter, adapter_id(digest), "adapter")

    def release_manifest(self, digest: str) -> Release:
        """A release by its manifest digest; NotFound if none."""
        return self._get(Release, release_id(digest), "release")

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

    def _release_servable(self, release: Release) -> bool:
        if release.adapter_digest is None:
            return True
        return is_servable(self.adapter(release.adapter_digest).state)

    # -- tenants ----------------------------------------------------------------------------

    def create_tenant(self, name: str, *, actor: str,
                      policy: TenantPolicy | None = None) -> str:
        """Create a tenant (with ``policy``, in the same transaction) and return its API key;
        only the key's SHA-256 is recorded. The key is shown once."""
        check_name("tenant", name)
        check_actor(actor)
        # No existence read first: the event store's unique (id, version 1) index refuses a
        # second tenant of the same name in the same transaction that would record it.
        api_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
        tenant = Tenant.create(name, api_key, actor)
        if policy is not None:
            tenant.set_policy(policy, actor)
        self._save(tenant, what="tenant", already=f"tenant {name!r} already exists")
        return api_key

    def set_policy(self, tenant: str, policy: TenantPolicy, *, actor: str) -> None:
        """Replace a tenant's policy (limits, signature requirement, trusted keys)."""
        t = self.tenant(tenant)
        t.set_policy(policy, actor)
        self._save(t, what="tenant policy")

    def rotate_api_key(self, tenant: str, *, actor: str,
                       wait_s: float = VISIBLE_WITHIN_S) -> str:
        """Give ``tenant`` a new API key and return it (shown once; only its hash is kept).
        Every earlier key stops working: this returns once gateways refuse them."""
        t = self.tenant(tenant)
        api_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
        t.rotate_api_key(api_key, actor)
        position = self._save(t, what="tenant")
        try:
            self._confirm_visible(position, lambda v: v.tenant_for_api_key(api_key) == tenant,
                                  "the API key rotation", wait_s)
        except NotYetVisible as e:
            raise NotYetVisible(str(e), result=api_key) from None
        return api_key

    def revoke_api_keys(self, tenant: str, *, actor: str, reason: str = "",
                        wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Withdraw every API key of ``tenant``; it holds no working key until a rotation.
        Returns once gateways refuse them."""
        t = self.tenant(tenant)
        t.revoke_api_keys(reason, actor)
        position = self._save(t, what="tenant")
        self._confirm_visible(position, lambda v: v.api_key_count(tenant) == 0,
                              "the API key revocation", wait_s)

    # -- bases ------------------------------------------------------------------------------

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
        operator-owned alias whose stable release is the base alone (grant it to tenants for
        base-only tickets).
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
        release = route = None
        if alias is not None:
            release = self._new_base_release(base, actor)
            route = Alias.create(alias, owner=None, release=release.digest, actor=actor)
        self._save(base, index, release, route, what="base model")
        return digest

    def _new_base_release(self, base: BaseModel, actor: str) -> Release:
        return self._new_release(ReleaseManifest(
            tenant=None, adapter_digest=None, base_digest=base.digest,
            tokenizer_digest=base.tokenizer_digest,
            chat_template_digest=chat_template_digest(self.store, base.tokenizer_digest),
            inference_defaults={}, evaluation_report_digest=None), actor)

    def _new_release(self, manifest: ReleaseManifest, actor: str) -> Release:
        """A release manifest stored by digest; the Release aggregate is new or existing."""
        digest = put_manifest(self.store, manifest)
        if self._exists(release_id(digest)):
            return self.release_manifest(digest)  # same manifest: same release, no new event
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
        check_actor(actor)
        check_name("alias", alias)
        meta = metadata or AdapterMetadata()
        policy = self.tenant(tenant).policy  # NotFound before anything else
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
                    staged, lookup_base=self._base_info, base=base,
                    max_rank=limits.rank_limit(policy, self.settings.max_rank))
                limits.check_targets(policy, facts.base_digest, facts.target_modules)
                limits.check_adapter_count(policy, self._live_adapters(tenant))
                verified = None
                if signature is not None:
                    # x509 and model_signing: only registrations that carry a signature load them
                    from control.app.signatures import verify_signature

                    verified = verify_signature(staged, Path(signature), policy.trusted_keys)
                elif policy.require_signature:
                    raise ValidationFailed("signature", "your tenant's policy requires a "
                                                        "model_signing signature (--signature)")
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
                          target_modules=facts.target_modules, alias=alias,
                          metadata=meta.to_json(),
                          signature=verified.to_json() if verified else None, actor=actor)
        if route is None:
            route = Alias.create(alias, owner=tenant, release=None, actor=actor)
        if golden is not None:
            golden_digest = put_document(self.store, GOLDEN_FILE, golden.document())
            adapter.record_golden_set(golden_digest, golden.family, len(golden.tasks), actor)
        self._save(adapter, route, what="adapter")
        return digest

    def _live_adapters(self, tenant: str) -> int:
        return self.follower.routing().live_adapter_count(tenant)

    def _alias_or_none(self, name: str) -> Alias | None:
        try:
            return self.alias(name)
        except NotFound:
            return None

    def _reject(self, failure: ValidationFailed, *, tenant: str, actor: str) -> None:
        rejection = RegistrationRejection(check=failure.check, message=failure.message,
                                          tenant=tenant, actor=actor)
        recordings = self.save(rejection)
        self._after_command(recordings)

    def record_evaluation(self, digest: str, report: dict[str, Any], *, actor: str,
                          external: bool = False) -> str:
        """Store an evaluation report written outside the gate (content-addressed JSON) for an
        adapter; return its digest. Accepted only with ``external=True``, and recorded as
        external (the gate records its own reports: ``control.app.gate_desk``).

        Without a passing gate report, the latest external report is the one a canary release
        names.
        """
        _external_only(external)  # refused before anything is stored
        summary = external_summary(report)
        adapter = self.adapter(digest)
        report_digest = put_document(self.store, REPORT_FILE, check_report(report))
        adapter.record_evaluation(report_digest, summary, actor, external=external)
        self._save(adapter, what="adapter")
        return report_digest

    def promote(
        self,
        digest: str,
        to: str | None = None,
        *,
        actor: str,
        canary_percent: int = DEFAULT_CANARY_PERCENT,
        inference_defaults: dict[str, Any] | None = None,
    ) -> str:
        """Move an adapter one step along its lifecycle (``to``: default the next state); return
        the new state. IllegalTransition, recording nothing, if the move or its guard fails.

        Entering canary creates the release manifest and sends ``canary_percent`` per cent of
        the sessions of the adapter's alias to it; entering stable makes it the alias's stable
        release (the previous one stays in the alias history for rollback).
        """
        adapter = self.adapter(digest)
        changed = self._step(adapter, to or next_state(adapter.state), actor=actor,
                             canary_percent=canary_percent, defaults=inference_defaults)
        self._save(adapter, *changed, what="adapter")
        return adapter.state

    def advance(
        self,
        digest: str,
        *,
        actor: str,
        evaluation: dict[str, Any] | None = None,
        to: str = STABLE,
        canary_percent: int = DEFAULT_CANARY_PERCENT,
        inference_defaults: dict[str, Any] | None = None,
        external: bool = False,
    ) -> str:
        """Walk an adapter from where it stands up to ``to`` (canary or stable), recording each
        step as its own event, all in one transaction; return the final state.

        ``evaluation``: a report written outside the gate to record first, accepted only with
        ``external=True`` (recorded as external). Canary needs it unless a passing gate report
        for the canary's base, tokenizer and chat template, or an external report, is recorded.
        """
        if to not in (CANARY, STABLE):
            raise DomainError("release walks up to canary or stable")
        summary = None
        if evaluation is not None:
            _external_only(external)
            summary = external_summary(evaluation)
        adapter = self.adapter(digest)
        changed: dict[UUID, Aggregate] = {}
        if evaluation is not None and summary is not None:
            report_digest = put_document(self.store, REPORT_FILE, check_report(evaluation))
            adapter.record_evaluation(report_digest, summary, actor, external=external)
        order = (CANDIDATE, CANARY, STABLE)
        if adapter.state not in (DRAFT, *order):
            raise IllegalTransition(
                f"an adapter in state {adapter.state.value!r} cannot be released")
        while adapter.state != to:
            if adapter.state == STABLE:
                raise IllegalTransition("the adapter is already stable")
            for agg in self._step(adapter, next_state(adapter.state), actor=actor,
                                  canary_percent=canary_percent, defaults=inference_defaults,
                                  cache=changed):
                changed[agg.id] = agg
        self._save(adapter, *changed.values(), what="adapter")
        return adapter.state

    def _step(self, adapter: Adapter, to: str, *, actor: str, canary_percent: int,
              defaults: dict[str, Any] | None,
              cache: dict[UUID, Aggregate] | None = None) -> list[Aggregate]:
        """Apply one lifecycle move to ``adapter`` (and its release/alias); return the other
        aggregates that changed. Nothing is saved here."""
        policy = self.tenant(adapter.tenant).policy
        route = self._cached_alias(adapter.alias, cache)
        if to != CANARY:
            if to == STABLE and adapter.state == CANARY:
                self.stable_basis(adapter, route)  # IllegalTransition when it has none
            adapter.promote(to, actor, policy)
            if to == STABLE and route is not None and adapter.release is not None:
                release = self._cached_release(adapter.release, cache)
                if route.stable != release.digest:
                    route.point(release, True, actor)
                return [route]
            if to == DEPRECATED and route is not None and route.canary == adapter.release:
                route.clear_canary(actor)
                return [route]
            return []
        # Entering canary: build the release manifest; the guard checks that a passing gate
        # report vouches for exactly this base + tokenizer + chat template (or that an
        # external report was recorded), before any manifest or template is written.
        combination = self.canary_combination(adapter)
        if adapter.state == CANDIDATE:
            adapter.check_canary(combination)  # an external report never overrides the gate
        lifecycle_guard(adapter, CANARY, policy, combination)
        inference_defaults = parse_defaults(defaults)  # refused before the template is stored
        release = self._new_release(ReleaseManifest(
            tenant=adapter.tenant, adapter_digest=adapter.digest,
            base_digest=adapter.base_digest, tokenizer_digest=adapter.tokenizer_digest,
            chat_template_digest=chat_template_digest(self.store, adapter.tokenizer_digest),
            inference_defaults=inference_defaults,
            evaluation_report_digest=adapter.canary_evidence(combination)), actor)
        adapter.promote(to, actor, policy, release=release.digest, combination=combination)
        out: list[Aggregate] = [release]
        if route is not None:
            if route.stable is None:
                route.point(release, True, actor)  # a first release: nothing to split with
            else:
                route.set_canary(release, canary_percent, True, actor)
            out.append(route)
        if cache is not None:
            cache[release.id] = release
        return out

    def stable_basis(self, adapter: Adapter, route: Alias | None) -> StableBasis:
        """On what basis the canary ``adapter`` may become stable now (``route``: its alias);
        IllegalTransition when on none (``control.app.evidence``)."""
        return evidence.stable_basis_of(self, adapter, route)

    def break_glass(self, digest: str, *, to: str, reason: str, actor: str,
                    canary_percent: int = DEFAULT_CANARY_PERCENT,
                    inference_defaults: dict[str, Any] | None = None) -> str:
        """An operator's recorded override: move ``digest`` to ``to`` (canary or stable)
        although the evidence that move needs is missing, ``BreakGlassUsed`` and the move in
        one transaction; return the new state. See ``control.app.evidence.break_glass``."""
        adapter = self.adapter(digest)
        evidence.break_glass(self, adapter, to=to, reason=reason, actor=actor)
        changed = self._step(adapter, to, actor=actor, canary_percent=canary_percent,
                             defaults=inference_defaults)
        self._save(adapter, *changed, what="adapter")
        return adapter.state

    def canary_combination(self, adapter: Adapter) -> Combination:
        """The base, tokenizer and chat template a canary release of ``adapter`` is built on:
        what its gate report must name (the template's digest is computed, not stored)."""
        return Combination(adapter.base_digest, adapter.tokenizer_digest,
                           chat_template_name(self.store, adapter.tokenizer_digest))

    def _cached_alias(self, name: str, cache: dict[UUID, Aggregate] | None) -> Alias | None:
        if cache is not None and alias_id(name) in cache:
            return cache[alias_id(name)]  # type: ignore[return-value]
        route = self._alias_or_none(name)
        if route is not None and cache is not None:
            cache[route.id] = route
        return route

    def _cached_release(self, digest: str, cache: dict[UUID, Aggregate] | None) -> Release:
        if cache is not None and release_id(digest) in cache:
            return cache[release_id(digest)]  # type: ignore[return-value]
        return self.release_manifest(digest)

    def revoke(self, digest: str, reason: str, *, actor: str, immediate: bool = False,
               wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Revoke an adapter, from any state: no new resolution from the next projection
        update on; queued requests on it are refused; running ones drain, or, with
        ``immediate`` (the kill switch, for security and licence events), end at once. The
        serving side then reports drained, purged, unloaded per host. ``immediate`` on an
        adapter that is already revoked escalates its revocation.

        Returns only once the revocation set that Triton hosts read holds ``digest`` (and its
        kill switch, if asked); else NotYetVisible after ``wait_s`` seconds (the revocation
        stays recorded).
        """
        for attempt in range(5):
            adapter = self.adapter(digest)
            escalation = adapter.revoked
            adapter.revoke(reason, actor, immediate=immediate)
            # Every alias routed to the adapter applies its fallback policy in this same
            # transaction: no projection ever shows the revocation without the fallback. (An
            # escalation applied it with the first revocation.)
            fallen = [] if escalation else self._fall_back(adapter, actor)
            try:
                position = self._save(adapter, *fallen, what="adapter")
                break
            except Conflict:
                if attempt == 4:  # an alias kept moving under the revocation
                    raise
        self._confirm_visible(position, lambda v: v.is_revoked(digest, immediate=immediate),
                              "the revocation", wait_s)

    def _fall_back(self, adapter: Adapter, actor: str) -> list[Aggregate]:
        """Apply the fallback policy of every alias whose stable or canary release uses
        ``adapter`` (just revoked, not saved); return the aggregates that changed (aliases, and
        a base-only release a ``base`` policy created). See ``control.domain.fallback``."""
        names = {adapter.alias}
        try:
            if self._follow:
                self.follower.catch_up()  # the aliases pointed at it a moment ago count too
            names.update(self.follower.routing().aliases_using_adapter(adapter.digest))
        except Exception:
            # Never let the lookup block the revocation: an alias missed here still serves
            # nothing of the revoked adapter (resolution skips releases that are not servable).
            log.warning("finding the aliases routed to a revoked adapter failed; falling back "
                        "only on its own alias", exc_info=True)
        releases: dict[str, Release] = {}

        def release(digest: str) -> Release:
            if digest not in releases:
                releases[digest] = self.release_manifest(digest)
            return releases[digest]

        def servable(digest: str) -> bool:
            r = release(digest)
            return r.adapter_digest != adapter.digest and self._release_servable(r)

        changed: list[Aggregate] = []
        for name in sorted(names):
            route = self._alias_or_none(name)
            if route is None:
                continue
            revoked_stable = route.stable

            def base_release(stable: str | None = revoked_stable) -> str:
                assert stable is not None  # asked only when the stable release was revoked
                made = self._new_base_release(self.base(release(stable).base_digest), actor)
                releases.setdefault(made.digest, made)
                return made.digest

            outcome = fall_back(
                route.fallback, stable=route.stable, canary=route.canary,
                history=route.history,
                revoked=lambda d: release(d).adapter_digest == adapter.digest,
                servable=servable, base_release=base_release)
            if outcome is None:
                continue
            route.fall_back(adapter.digest, outcome, actor)
            changed.append(route)
        changed.extend(r for r in releases.values() if r.pending_events)
        return changed

    def record_serving_step(self, digest: str, host: str, step: str, *, actor: str) -> None:
        """Record one step of the serving side's revocation work on ``host``:
        ``drained`` (references at zero), ``purged`` (every cache entry of the digest gone),
        ``unloaded`` (no longer resident). Steps come in that order, once each per host.

        The backend calls this (or ``loraplane adapter serving-step``) after each step; a lost
        race with another host's report on the same adapter is retried here.
        """
        for attempt in range(5):
            adapter = self.adapter(digest)
            adapter.record_serving_step(host, step, actor)
            try:
                self._save(adapter, what="adapter")
                return
            except Conflict:
                if attempt == 4:
                    raise

    # -- aliases ----------------------------------------------------------------------------

    def grant(self, tenant: str, alias: str, *, actor: str) -> None:
        """Allow ``tenant`` to resolve ``alias`` (both must exist)."""
        self.tenant(tenant)
        route = self.alias(alias)
        route.grant(tenant, actor)
        self._save(route, what="grant")

    def remove_grant(self, tenant: str, alias: str, *, actor: str,
                     wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Stop ``tenant`` resolving ``alias``; returns once gateways refuse it."""
        route = self.alias(alias)
        route.remove_grant(tenant, actor)
        position = self._save(route, what="grant")
        self._confirm_visible(position, lambda v: not v.is_granted(tenant, alias),
                              "the grant removal", wait_s)

    def _target_release(self, target: str, actor: str) -> Release:
        """A release by manifest digest, by adapter digest (its release), or by base digest (a
        base-only release, created if new: then it has pending events).

        An adapter's release on another base or tokenizer than the adapter was registered on
        (a base upgrade's) is a target only while a passing gate report vouches for exactly its
        combination: the unit an alias moves to is always a verified one."""
        if self._exists(release_id(target)):
            release = self.release_manifest(target)
        elif self._exists(adapter_id(target)):
            adapter = self.adapter(target)
            if adapter.release is None:
                raise IllegalTransition("that adapter has no release yet: promote it to canary "
                                        "first")
            release = self.release_manifest(adapter.release)
        elif self._exists(base_id(target)):
            return self._new_base_release(self.base(target), actor)
        else:
            raise NotFound("no release, adapter or base model with that digest")
        if release.adapter_digest is not None and not self.adapter(
                release.adapter_digest).verified_on(Combination(
                    release.base_digest, release.tokenizer_digest,
                    release.chat_template_digest)):
            raise IllegalTransition(
                "that release serves its adapter on a base, tokenizer and chat template no "
                "passing gate report vouches for: gate it there first (loraplane base upgrade "
                "plan NEW_BASE)")
        return release

    def point_alias(self, alias: str, target: str, *, actor: str) -> str:
        """Make ``target`` (release, adapter or base digest) the alias's stable release; return
        the release digest. The previous stable release goes to the alias history."""
        route = self.alias(alias)
        release = self._target_release(target, actor)
        route.point(release, self._release_servable(release), actor)
        self._save(route, release if release.pending_events else None, what="alias")
        return release.digest

    def set_canary(self, alias: str, target: str, percent: int, *, actor: str) -> str:
        """Send ``percent`` per cent of sessions (hash of tenant and session id) to ``target``."""
        route = self.alias(alias)
        release = self._target_release(target, actor)
        route.set_canary(release, percent, self._release_servable(release), actor)
        self._save(route, release if release.pending_events else None, what="alias")
        return release.digest

    def clear_canary(self, alias: str, *, actor: str) -> None:
        """End an alias's canary split."""
        route = self.alias(alias)
        route.clear_canary(actor)
        self._save(route, what="alias")

    def set_fallback(self, alias: str, policy: str, *, actor: str) -> str:
        """Set what ``alias`` serves after its stable release's adapter is revoked: ``stable``
        (its most recent servable earlier release), ``base`` (the base alone) or ``none``
        (refuse). Returns the policy."""
        route = self.alias(alias)
        route.set_fallback(policy, actor)
        self._save(route, what="alias")
        return route.fallback.value

    def repin_sessions(self, alias: str, from_release: str, to_release: str, *, reason: str,
                       actor: str) -> int:
        """Move every session pinned to ``from_release`` on ``alias`` to ``to_release`` (a
        release of the alias's owner, or a base release, that is servable): ONE event,
        ``AliasSessionsRepinned``, which the routing projection applies to each pin. For a
        rollout's rollback that re-pins rather than drains. Returns the event's position.

        To record it in the rollback's own transaction, call ``Alias.repin_sessions`` on the
        alias aggregate being rolled back and save both events together instead."""
        route = self.alias(alias)
        to = self.release_manifest(to_release)
        route.repin_sessions(from_release, to, self._release_servable(to), reason, actor)
        return self._save(route, what="alias")

    def drain_sessions(self, alias: str, release: str, *, reason: str, actor: str) -> int:
        """Record that sessions pinned to ``release`` on ``alias`` keep it until they end or
        expire (``AliasSessionsDrained``; nothing moves). Returns the event's position."""
        route = self.alias(alias)
        route.drain_sessions(release, reason, actor)
        return self._save(route, what="alias")

    def rollback(self, alias: str, *, actor: str) -> str:
        """Point ``alias`` back at its previous stable release (recorded as AliasRolledBack);
        return that release's digest."""
        route = self.alias(alias)
        if not route.history:
            raise IllegalTransition("the alias has no previous release to roll back to")
        previous = self.release_manifest(route.history[-1])
        route.rollback(self._release_servable(previous), actor)
        self._save(route, what="alias")
        return previous.digest

    # -- keys -------------------------------------------------------------------------------

    def record_signing_key(self, kid: str, public_key_b64: str, *, actor: str) -> int:
        """Record a ticket-signing public key (raw Ed25519, base64); a rotation adds a key.
        Returns the event's position in the notification log."""
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
        return self._save(SigningKey(kid=kid, public_key_b64=public_key_b64, actor=actor),
                          what="signing key")

    def rotate_signing_key(self, *, actor: str,
                           wait_s: float = VISIBLE_WITHIN_S) -> tuple[str, str | None]:
        """Make a new ticket-signing key this home's active one; returns (new kid, previous
        kid). Retire the previous one afterwards.

        The key becomes active only once its public half is recorded and visible in the
        tables hosts copy their trusted keys from; else NotYetVisible, and the active key
        stays as it was (the recorded key is never used: retire it).
        """
        check_actor(actor)

        def record(signer: TicketSigner) -> None:
            position = self.record_signing_key(signer.kid, signer.public_b64, actor=actor)
            self._confirm_visible(position, lambda v: signer.kid in v.signing_keys(),
                                  "the new signing key", wait_s)

        try:
            signer, previous = key_ring.rotate(self.settings.keys_dir, record)
        except NotYetVisible as e:
            raise NotYetVisible(f"{e}. The new key was NOT made active here (the active key "
                                "is unchanged): rotate again once it has caught up") from None
        return signer.kid, previous

    def retire_signing_key(self, kid: str, *, actor: str, reason: str = "",
                           force: bool = False, wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Retire a ticket-signing key: gateways stop signing with it, hosts stop trusting it.

        Refused, unless ``force``, for this home's active key and for the last unretired key
        (either leaves gateways nothing to sign with: rotate first). Returns once the
        retirement shows in the tables gateways and hosts read.
        """
        key = self._get(SigningKey, signing_key_id(check_name("key id", kid)), "signing key")
        if not force and not key.retired:
            self._check_retirable(kid)
        key.retire(reason, actor)
        position = self._save(key, what="signing key")
        self._confirm_visible(position, lambda v: kid in v.retired_key_ids(),
                              "the signing key retirement", wait_s)

    def _check_retirable(self, kid: str) -> None:
        active = key_ring.active_signer(self.settings.keys_dir)
        if active is not None and active.kid == kid:
            raise IllegalTransition(
                f"{kid!r} is the active signing key here: run `loraplane key rotate` first, "
                "then retire it (or pass --force: gateways answer 503 until a new key exists)")
        view = self.follower.routing()
        unretired = set(view.signing_keys()) - view.retired_key_ids()
        if unretired <= {kid}:
            raise IllegalTransition(
                f"{kid!r} is the last unretired signing key: run `loraplane key rotate` first "
                "(or pass --force: no gateway can issue tickets until a new key exists)")

    def __repr__(self) -> str:
        return f"Registry(home={self.settings.home!s})"


def external_summary(report: Any) -> dict[str, Any]:
    """The event summary of an external report: its scalar fields and who produced it;
    DomainError (nothing stored) when it does not say it passed or names no producer."""
    claims = external_report(check_report(report))
    return {**report_summary(report), "producer": claims.producer}


def _external_only(external: bool) -> None:
    """A report written outside the gate is accepted only when the caller says so."""
    if not external:
        raise IllegalTransition(
            "a report written outside the gate is accepted only as external: pass --external "
            "(external=True), and it is recorded as external; or let the gate write one "
            "(loraplane adapter gate DIGEST)")


__all__ = ["DEFAULT_CANARY_PERCENT", "REVOKED", "NotYetVisible", "Registry"]
