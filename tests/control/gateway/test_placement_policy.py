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
            self, office: TicketOffice, registry: Registry) -> None:
        """Issue 25: the ticket carries the affinity value the gateway's answer gives, as a
        signed claim a host reads. An owner that bounds no replicas: each tenant's own value
        for the alias, so a shared alias spreads over the hosts by tenant. Once the owner
        bounds its adapters' replicas: the alias's alone, equal for the owner and every
        grantee, so their requests go where the owner's do. A base alias: the caller's."""
        from control.contracts.placement import affinity_of
        from control.contracts.tickets import unverified_claims

        values = {}
        for tenant in ("acme", "globex", "initech"):
            issued = office.issue(tenant, "chat")
            values[tenant] = issued.claims.affinity
            assert issued.claims.affinity == affinity_of("chat", tenant), tenant
            assert unverified_claims(issued.token)["affinity"] == issued.claims.affinity
        assert len(set(values.values())) == 3 and affinity_of("chat") not in values.values()
        registry.set_policy("acme", TenantPolicy(max_replicas=2), actor="op")
        for tenant in ("acme", "globex", "initech"):
            assert office.issue(tenant, "chat").claims.affinity == affinity_of("chat"), tenant
        # a tenant's own bound changes nothing for an alias it does not own
        registry.set_policy("globex", TenantPolicy(max_replicas=1), actor="op")
        assert office.issue("globex", "tiny-base").claims.affinity == \
            affinity_of("tiny-base", "globex")

    def test_a_shared_alias_spreads_over_the_hosts_by_tenant_unless_bounded(
            self, office: TicketOffice, registry: Registry) -> None:
        """One alias granted to twelve tenants: their tickets' values place them on several
        hosts (each tenant on one), where one value for all put every tenant's traffic on the
        one host it hashed to; once the owner bounds replicas, all of them on one host."""
        from control.contracts.placement import parse_host_urls, place

        hosts = parse_host_urls(["h1:8000", "h2:8000", "h3:8000"])
        tenants = ["acme", "globex", "initech", *(f"t{i}" for i in range(9))]
        for tenant in tenants[3:]:
            registry.create_tenant(tenant, actor="op")
            registry.grant(tenant, "chat", actor="op")

        def first_hosts() -> set[str]:
            return {place(hosts, "shared", str(office.issue(t, "chat").claims.affinity))[0]
                    for t in tenants}

        assert len(first_hosts()) >= 2
        registry.set_policy("acme", TenantPolicy(max_replicas=1), actor="op")
        assert len(first_hosts()) == 1

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
