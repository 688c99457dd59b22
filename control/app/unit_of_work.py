"""The registry's public surface as its desks see it: :class:`UnitOfWork`, and what a command
reads of the projections and raises when they lag.

The desks the registry is built from (``control.app.tenants``, ``signing_keys``,
``catalogue``, ``lifecycle``, ``revocation``, ``aliases``) are typed against
:class:`UnitOfWork`, not against ``control.app.registry.Registry``: the registry imports them,
so they must not import it back (not even for the type checker), and mypy then refuses any
desk that reaches for something the surface does not offer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar
from uuid import UUID

import sqlalchemy as sa
from eventsourcing.domain import Aggregate
from eventsourcing.persistence import Recording

from control.contracts.config import Settings
from control.contracts.store import ArtifactStore
from control.domain import Adapter, Alias, BaseModel, Release, ReleaseManifest, Tenant

TAggregate = TypeVar("TAggregate", bound=Aggregate)

# How long a revoking command waits for the tables hosts read to show its change.
VISIBLE_WITHIN_S = 5.0
VISIBLE_POLL_S = 0.05


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


class ReleaseMaker(Protocol):
    """How desks make releases (``control.app.catalogue.CatalogueDesk``)."""

    def new_release(self, manifest: ReleaseManifest, actor: str) -> Release: ...
    def new_base_release(self, base: BaseModel, actor: str) -> Release: ...


class UnitOfWork(Protocol):
    """What a desk may use of the registry (``control.app.registry.Registry`` documents each):
    load aggregates, commit what one command changed, wait for the projections to show it."""

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> ArtifactStore: ...
    @property
    def follower(self) -> ReadModel: ...
    @property
    def follows(self) -> bool: ...
    @property
    def catalogue(self) -> ReleaseMaker: ...

    def commit(self, *aggregates: Aggregate | None, what: str,
               already: str | None = None) -> int: ...
    def confirm_visible(self, position: int, visible: Callable[[RoutingReads], bool],
                        what: str, wait_s: float = VISIBLE_WITHIN_S) -> None: ...
    def load(self, cls: type[TAggregate], aggregate_id: UUID, what: str) -> TAggregate: ...
    def exists(self, aggregate_id: UUID) -> bool: ...
    def unsaved_adapters(self, tenant: str) -> int: ...
    def tenant(self, name: str) -> Tenant: ...
    def base(self, ref: str) -> BaseModel: ...
    def adapter(self, digest: str) -> Adapter: ...
    def release_manifest(self, digest: str) -> Release: ...
    def alias(self, name: str) -> Alias: ...
    def alias_or_none(self, name: str) -> Alias | None: ...
    def release_servable(self, release: Release) -> bool: ...


__all__ = ["VISIBLE_WITHIN_S", "NotYetVisible", "ReadModel", "ReleaseMaker", "RoutingReads",
           "UnitOfWork"]
