"""The control plane application: the one unit of work every command goes through.

``Registry`` is an eventsourcing ``Application`` persisted through eventsourcing-sqlalchemy at
the one database URL of the deployment (SQLite file or PostgreSQL). It is ONE application on
purpose: the atomic save of several aggregates, the single ordered notification log and the
audit chain sealed over it (``control.app.integrity``) all depend on it.

The commands live in desks, one module per concern, each of which does what eventsourcing's
own examples do: load the aggregates it needs, call their commands (the domain rules are in
``control.domain``), and save. Every desk goes through this small public surface and nothing
else of the registry:

- reading aggregates: :meth:`Registry.load`, :meth:`Registry.exists` and the typed readers
  (``tenant``, ``base``, ``adapter``, ``release_manifest``, ``alias``, ``alias_or_none``,
  ``release_servable``);
- saving: :meth:`Registry.commit` saves every new event of the aggregates given in ONE
  transaction and then brings the projection tables up to date (and seals the audit trail when
  due), so that a CLI command run without a ``serve`` process still leaves fresh routing tables
  behind;
- waiting: :meth:`Registry.confirm_visible`, for commands that take something away (adapter
  revocation; revoking or rotating an API key, removing a grant, retiring a signing key): they
  report success only once the projection tables that gateways and Triton hosts read show the
  change; otherwise :class:`NotYetVisible`, the change recorded but not yet in force;
- ``settings``, ``store`` (the content-addressed artifact store), ``follower`` and ``follows``
  (the projections this registry catches up), ``seal``, and eventsourcing's ``repository``.

The desks: ``tenants`` (tenants, policies, API keys), ``signing_keys`` (ticket-signing keys),
``catalogue`` (bases, adapters, release manifests), ``lifecycle`` (evaluations, promotions,
break-glass), ``revocation`` (revoke, fallback, the hosts' serving steps) and ``aliases``
(grants, pointing, canaries, rollback, session moves); they are attributes of the registry,
and its historical command names (``registry.register_adapter(...)``) delegate to them.
Rollouts, base upgrades, the gate's records and session pins have their own desks, built on a
registry by their callers (``control.app.rollouts``, ``upgrades``, ``gate_desk``,
``sessions``).

Two commands that change the same aggregate at once (two moves of one alias) collide on the
event store's unique (aggregate id, version) index: one is recorded, the other raises
``Conflict`` and records nothing.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload
from uuid import UUID

import sqlalchemy as sa
from eventsourcing.application import AggregateNotFoundError, Application
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import IntegrityError as EventStoreIntegrityError
from eventsourcing.persistence import Recording

from control.app.aliases import AliasDesk
from control.app.catalogue import CatalogueDesk
from control.app.integrity import AuditSeal
from control.app.lifecycle import DEFAULT_CANARY_PERCENT, LifecycleDesk
from control.app.revocation import RevocationDesk
from control.app.signing_keys import SigningKeyDesk
from control.app.tenants import API_KEY_PREFIX, TenantDesk
from control.app.unit_of_work import (
    VISIBLE_POLL_S,
    VISIBLE_WITHIN_S,
    NotYetVisible,
    ReadModel,
    RoutingReads,
)
from control.contracts.config import Settings
from control.contracts.digests import DIGEST_RE
from control.contracts.store import ArtifactStore
from control.domain import (
    REVOKED,
    Adapter,
    Alias,
    AlreadyExists,
    BaseModel,
    BaseName,
    Conflict,
    NotFound,
    Release,
    Tenant,
    adapter_id,
    alias_id,
    base_id,
    base_name_id,
    is_servable,
    release_id,
    tenant_id,
)

log = logging.getLogger("loraplane.registry")

TAggregate = TypeVar("TAggregate", bound=Aggregate)
P = ParamSpec("P")
R = TypeVar("R")


class Delegate(Generic[P, R]):
    """A registry method that is one desk's command: ``registry.NAME(...)`` calls
    ``registry.<desk>.NAME(...)``, with the command's own signature (for mypy too) and
    docstring. The names callers have always used keep working while the commands live in
    their desks, one line each instead of a wrapper each."""

    def __init__(self, desk: str, command: Callable[Concatenate[Any, P], R]) -> None:
        self.desk = desk
        self.name = command.__name__
        self.__doc__ = command.__doc__

    @overload
    def __get__(self, obj: None, owner: type) -> Delegate[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> Callable[P, R]: ...

    def __get__(self, obj: object | None, owner: type) -> Delegate[P, R] | Callable[P, R]:
        if obj is None:
            return self
        command: Callable[P, R] = getattr(getattr(obj, self.desk), self.name)
        return command


@dataclass
class _Batch:
    """Commands recorded by :meth:`Registry.batched` and not yet saved: their events in order,
    the aggregates as they now stand (by id), and the adapters each tenant registered."""

    flush_events: int
    events: list[Any] = field(default_factory=list)
    by_id: dict[UUID, list[Any]] = field(default_factory=dict)
    aggregates: dict[UUID, Aggregate] = field(default_factory=dict)
    adapters: Counter[str] = field(default_factory=Counter)
    creating: bool = False

    def defer(self, events: list[Any], aggregates: list[Aggregate], creating: bool) -> bool:
        """Take one command's events; True when enough are pending to save."""
        self.events.extend(events)
        for e in events:
            self.by_id.setdefault(e.originator_id, []).append(e)
        self.creating = self.creating or creating
        for agg in aggregates:
            self.aggregates[agg.id] = agg
        self.adapters.update(e.tenant for e in events if isinstance(e, Adapter.AdapterRegistered))
        return len(self.events) >= self.flush_events

    def load(self, aggregate_id: UUID, repository: Any) -> Aggregate:
        """An aggregate as the batch leaves it: its unsaved events applied; read once per flush
        (a command that failed after changing it, leaving events pending, is undone by
        rebuilding it from the store and the batch's events, as a reload would)."""
        agg = self.aggregates.get(aggregate_id)
        if agg is not None and not agg.pending_events:
            return agg
        mine = self.by_id.get(aggregate_id, [])
        rebuilt: Aggregate | None = (repository.get(aggregate_id)
                                     if not mine or mine[0].originator_version > 1 else None)
        for event in mine:
            rebuilt = event.mutate(rebuilt)
        if rebuilt is None:
            raise AggregateNotFoundError(aggregate_id)
        self.aggregates[aggregate_id] = rebuilt
        return rebuilt

    def take(self) -> tuple[list[Any], bool]:
        """The pending events (and whether they create an aggregate); nothing stays pending."""
        events, creating = self.events, self.creating
        self.events, self.creating = [], False
        self.aggregates.clear()
        self.by_id.clear()
        self.adapters.clear()
        return events, creating


class Registry(Application[UUID]):
    """The unit of work: loads aggregates, saves what a desk's command changed, and keeps the
    projections caught up. The commands are the desks' (see the module notes)."""

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
        self._batch: _Batch | None = None
        self.tenants = TenantDesk(self)
        self.signing_keys = SigningKeyDesk(self)
        self.catalogue = CatalogueDesk(self)
        self.lifecycle = LifecycleDesk(self)
        self.revocation = RevocationDesk(self)
        self.aliases = AliasDesk(self)

    # -- projections ------------------------------------------------------------------------

    @property
    def follows(self) -> bool:
        """Whether this registry catches the projections up itself after each command."""
        return self._follow

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

    # -- the unit of work -------------------------------------------------------------------

    def commit(self, *aggregates: Aggregate | None, what: str,
               already: str | None = None) -> int:
        """Save all pending events of ``aggregates`` (None entries are skipped) atomically;
        return the position of the last one in the notification log.

        A lost race on a new aggregate is AlreadyExists (``already``: its message); on an
        existing one, Conflict. Either way nothing is recorded.
        """
        creating = any(e.originator_version == 1 for a in aggregates if a is not None
                       for e in a.pending_events)
        # Record the command's events in the order they happened, across aggregates (each
        # aggregate's own events keep their order): the audit log lists events by position
        # and shows their times, which must then never go backwards within one command.
        events = list(heapq.merge(*(a.collect_events() for a in aggregates if a is not None),
                                  key=lambda e: e.timestamp))
        if self._batch is not None:
            if self._batch.defer(events, [a for a in aggregates if a is not None], creating):
                self._flush()
            return 0
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

    # -- batches: many commands, one save ----------------------------------------------------

    @contextmanager
    def batched(self, flush_events: int = 5000) -> Iterator[None]:
        """Run many commands and save their events together: one ``save()`` (one transaction)
        each time ``flush_events`` events are pending, and once more at the end. Each command
        runs exactly as alone (the same desk code, checks and events, in the same order); its
        aggregates are read from the batch while their events are unsaved, and a tenant's
        unsaved registrations count against its adapter limit. What differs is only when the
        events are saved: a lost race (a duplicate, a concurrent change) refuses the whole
        pending part of the batch, as one command's would be, and nothing of it is recorded.
        Commands that wait for the projections (:meth:`confirm_visible`) are refused inside.
        Aggregates a command only reads (a tenant's policy) are read once per flush, so a change
        another process records meanwhile is seen at the next flush, not at the next command.
        For bulk registrations (``control.tools.bench_registry``)."""
        if self._batch is not None:
            raise RuntimeError("batches do not nest")
        self._batch = _Batch(flush_events)
        try:
            yield
        finally:
            try:  # what the commands before a failed one recorded is saved, as one by one
                self._flush()
            finally:
                self._batch = None

    def unsaved_adapters(self, tenant: str) -> int:
        """Adapters ``tenant`` registered in the running batch whose events are not saved yet
        (0 outside a batch): the projections cannot count them."""
        return 0 if self._batch is None else self._batch.adapters[tenant]

    def _flush(self) -> None:
        if self._batch is None or not self._batch.events:
            return
        events, creating = self._batch.take()  # a failed save leaves nothing pending
        try:
            recordings = self.save(*events)
        except (EventStoreIntegrityError, sa.exc.IntegrityError):
            if creating:
                raise AlreadyExists("something this batch creates already exists (or was "
                                    "created concurrently); nothing of it was recorded") from None
            raise Conflict("something this batch changes was changed concurrently by another "
                           "command; nothing of it was recorded, retry") from None
        self._after_command(recordings)

    def confirm_visible(self, position: int, visible: Callable[[RoutingReads], bool],
                        what: str, wait_s: float = VISIBLE_WITHIN_S) -> None:
        """Return once the projection tables have applied the log up to ``position`` (the
        command's own events) and ``visible`` holds on them, else raise NotYetVisible after
        ``wait_s`` seconds. Catches the projections up meanwhile when this registry follows (a
        catch-up that failed after the save is retried here, not swallowed).

        The position matters for changes that remove rows: a projection that has not yet
        applied the grant would also "show" its removal, and then apply the grant alone."""
        if self._batch is not None:
            raise RuntimeError("a command that waits for the projections cannot run in a batch")
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
            time.sleep(VISIBLE_POLL_S)

    def load(self, cls: type[TAggregate], aggregate_id: UUID, what: str) -> TAggregate:
        """The aggregate ``aggregate_id``, which must be a ``cls``; NotFound ("``what`` not
        found") otherwise."""
        try:
            agg: Aggregate = (self.repository.get(aggregate_id) if self._batch is None
                              else self._batch.load(aggregate_id, self.repository))
        except AggregateNotFoundError:
            raise NotFound(f"{what} not found") from None
        if not isinstance(agg, cls):
            raise NotFound(f"{what} not found")
        return agg

    def exists(self, aggregate_id: UUID) -> bool:
        """Whether any aggregate has the id ``aggregate_id``."""
        if self._batch is not None and aggregate_id in self._batch.aggregates:
            return True
        return aggregate_id in self.repository

    # -- typed readers ----------------------------------------------------------------------

    def tenant(self, name: str) -> Tenant:
        """The tenant called ``name``; NotFound if none."""
        return self.load(Tenant, tenant_id(name), "tenant")

    def base(self, ref: str) -> BaseModel:
        """A registered base model by digest or by name; NotFound if none."""
        if DIGEST_RE.match(ref):
            return self.load(BaseModel, base_id(ref), "base model")
        index = self.load(BaseName, base_name_id(ref), "base model")
        return self.load(BaseModel, base_id(index.digest), "base model")

    def adapter(self, digest: str) -> Adapter:
        """A registered adapter by digest; NotFound if none."""
        return self.load(Adapter, adapter_id(digest), "adapter")

    def release_manifest(self, digest: str) -> Release:
        """A release by its manifest digest; NotFound if none."""
        return self.load(Release, release_id(digest), "release")

    def alias(self, name: str) -> Alias:
        """An alias by name; NotFound if none."""
        return self.load(Alias, alias_id(name), "alias")

    def alias_or_none(self, name: str) -> Alias | None:
        """An alias by name, or None."""
        try:
            return self.alias(name)
        except NotFound:
            return None

    def release_servable(self, release: Release) -> bool:
        """Whether ``release`` may be served now: a base-only release always, an adapter's
        while its adapter is canary or stable."""
        if release.adapter_digest is None:
            return True
        return is_servable(self.adapter(release.adapter_digest).state)

    # -- the desks' commands under their historical names -------------------------------------

    create_tenant = Delegate("tenants", TenantDesk.create_tenant)
    set_policy = Delegate("tenants", TenantDesk.set_policy)
    rotate_api_key = Delegate("tenants", TenantDesk.rotate_api_key)
    revoke_api_keys = Delegate("tenants", TenantDesk.revoke_api_keys)

    record_signing_key = Delegate("signing_keys", SigningKeyDesk.record_signing_key)
    rotate_signing_key = Delegate("signing_keys", SigningKeyDesk.rotate_signing_key)
    retire_signing_key = Delegate("signing_keys", SigningKeyDesk.retire_signing_key)

    register_base = Delegate("catalogue", CatalogueDesk.register_base)
    register_adapter = Delegate("catalogue", CatalogueDesk.register_adapter)

    record_evaluation = Delegate("lifecycle", LifecycleDesk.record_evaluation)
    promote = Delegate("lifecycle", LifecycleDesk.promote)
    advance = Delegate("lifecycle", LifecycleDesk.advance)
    break_glass = Delegate("lifecycle", LifecycleDesk.break_glass)
    stable_basis = Delegate("lifecycle", LifecycleDesk.stable_basis)
    canary_combination = Delegate("lifecycle", LifecycleDesk.canary_combination)

    revoke = Delegate("revocation", RevocationDesk.revoke)
    record_serving_step = Delegate("revocation", RevocationDesk.record_serving_step)

    grant = Delegate("aliases", AliasDesk.grant)
    remove_grant = Delegate("aliases", AliasDesk.remove_grant)
    point_alias = Delegate("aliases", AliasDesk.point_alias)
    set_canary = Delegate("aliases", AliasDesk.set_canary)
    clear_canary = Delegate("aliases", AliasDesk.clear_canary)
    set_fallback = Delegate("aliases", AliasDesk.set_fallback)
    rollback = Delegate("aliases", AliasDesk.rollback)
    repin_sessions = Delegate("aliases", AliasDesk.repin_sessions)
    drain_sessions = Delegate("aliases", AliasDesk.drain_sessions)

    def __repr__(self) -> str:
        return f"Registry(home={self.settings.home!s})"


__all__ = ["API_KEY_PREFIX", "DEFAULT_CANARY_PERCENT", "REVOKED", "VISIBLE_WITHIN_S",
           "Delegate", "NotYetVisible", "ReadModel", "Registry", "RoutingReads"]
