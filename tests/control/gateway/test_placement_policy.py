"""Placement by policy (issue 25): a tenant's ``isolation`` and ``regions`` are recorded as its
policy event, projected, and bound into every ticket the office signs for it (or for anyone
using its adapters); a host of another pool or region refuses the ticket itself
(``tests/control/contracts/test_tickets.py``). SQLite and PostgreSQL."""

from __future__ import annotations

import pytest

from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.tickets import TicketSigner
from control.domain import DomainError, TenantPolicy
from control.gateway.ticket_office import NotGranted, TicketOffice
from projections.route_cache import CachedRoutingView
from projections.routing import Placement, RoutingView
from tests.fixtures_control import Artifacts, OnPostgres, OnSQLite, WithRegistry

EVAL = {"suite": "smoke", "accuracy": 0.9, "passed": True}


class PlacementContract(WithRegistry):
    @pytest.fixture
    def office(self, registry: Registry, settings: Settings,
               artifacts: Artifacts) -> TicketOffice:
        """acme owns ``chat`` (alpha) and grants it to globex and initech; ``tiny-base`` is the
        base alone, granted to all three."""
        registry.register_base(artifacts.base, artifacts.tokenizer, name="tiny", actor="op",
                               alias="tiny-base")
        for tenant in ("acme", "globex", "initech"):
            registry.create_tenant(tenant, actor="op")
        digest = registry.register_adapter(artifacts.adapters["alpha"], tenant="acme",
                                           alias="chat", actor="op")
        registry.advance(digest, evaluation=EVAL, external=True, actor="op")
        for tenant in ("acme", "globex", "initech"):
            registry.grant(tenant, "chat", actor="op")
            registry.grant(tenant, "tiny-base", actor="op")
        signer, _ = TicketSigner.load_or_create(settings.keys_dir)
        return TicketOffice(settings, CachedRoutingView(registry.follower.engine, refresh_s=0),
                            signer)

    def test_the_default_is_the_shared_pool_anywhere(self, office: TicketOffice) -> None:
        claims = office.issue("globex", "chat").claims
        assert (claims.pool, claims.regions) == ("shared", ())

    def test_the_alias_placement_value_is_signed_into_every_ticket(
            self, office: TicketOffice) -> None:
        """Issue 25: the ticket carries the affinity value the gateway's answer gives (the
        alias's, equal for its owner and every grantee), as a signed claim a host reads."""
        from control.contracts.placement import affinity_of
        from control.contracts.tickets import unverified_claims

        for tenant in ("acme", "globex"):
            issued = office.issue(tenant, "chat")
            assert issued.claims.affinity == affinity_of("chat"), tenant
            assert unverified_claims(issued.token)["affinity"] == affinity_of("chat")
        assert office.issue("globex", "tiny-base").claims.affinity == affinity_of("tiny-base")

    def test_a_dedicated_owner_keeps_its_adapter_in_its_pool_for_every_grantee(
            self, office: TicketOffice, registry: Registry) -> None:
        registry.set_policy("acme", TenantPolicy(isolation="dedicated:gold",
                                                 regions=["eu", "us"]), actor="op")
        view = RoutingView(registry.follower.engine)
        assert view.placement("acme") == Placement("gold", ("eu", "us"))
        for tenant in ("acme", "globex"):
            claims = office.issue(tenant, "chat").claims
            assert (claims.pool, claims.regions) == ("gold", ("eu", "us")), tenant
        # the base alone follows the caller's policy: globex's prompts are not acme's
        assert office.issue("globex", "tiny-base").claims.pool == "shared"
        assert office.issue("acme", "tiny-base").claims.pool == "gold"

    def test_regions_meet_and_pools_must_agree(self, office: TicketOffice,
                                               registry: Registry) -> None:
        registry.set_policy("acme", TenantPolicy(regions=["eu", "us"]), actor="op")
        registry.set_policy("globex", TenantPolicy(regions=["us", "ap"]), actor="op")
        registry.set_policy("initech", TenantPolicy(isolation="dedicated:blue",
                                                    regions=["ap"]), actor="op")
        claims = office.issue("globex", "chat").claims  # acme's adapter, globex's prompts
        assert (claims.pool, claims.regions) == ("shared", ("us",))
        # initech runs only in blue, in ap; acme's adapter only in eu or us: nowhere to run
        with pytest.raises(NotGranted):
            office.issue("initech", "chat")
        registry.set_policy("acme", TenantPolicy(isolation="dedicated:gold"), actor="op")
        with pytest.raises(NotGranted):  # two dedicated pools: nowhere to run either
            office.issue("initech", "chat")
        assert office.issue("initech", "tiny-base").claims.pool == "blue"

    def test_placement_names_are_checked(self) -> None:
        for bad in ({"isolation": "dedicated"}, {"isolation": "dedicated:Gold"},
                    {"isolation": "private"}, {"regions": ["EU"]}, {"regions": "eu"}):
            with pytest.raises(DomainError):
                TenantPolicy(**bad)  # type: ignore[arg-type]
        assert TenantPolicy(isolation="dedicated:gold").pool == "gold"
        assert TenantPolicy().pool is None


class TestPlacementSQLite(OnSQLite, PlacementContract):
    pass


class TestPlacementPostgres(OnPostgres, PlacementContract):
    pass
