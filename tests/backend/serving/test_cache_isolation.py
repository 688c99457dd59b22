"""Tenant-private caches (issue 23): the prefix cache's key carries a salt the host derives from
the verified ticket's tenant, so no tenant gets a hit from another's prompt, on the base model or
on an adapter granted to both, while each tenant's own repeated prompts still hit. The
tokenizer's word cache, which cannot be salted, is off.

Through the real service (engine, scheduler, ledger, governance) without tritonserver; the paired
timing test through Triton is ``tests/integration/test_cache_isolation.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backend.serving import engine as engine_module
from backend.serving.engine import Engine
from backend.serving.prefix_cache import PrefixKey, TenantSalts, uncached_tokenizer
from backend.serving.service import IncomingRequest, LoraService
from control.contracts.config import Settings
from control.gateway.ticket_office import NotGranted
from tests.integration.conftest import ACTOR
from tests.serving_home import Home, Sink, provision_home, wait_for

SHARED = "acme-alpha"  # acme's adapter, granted to globex as well (below)
# (what the two tenants share, alias each one asks for)
SHARED_ROUTES = {"base model": "base", "adapter granted to both": SHARED}


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("cache-isolation-home")
    h = provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                       kit_dir)
    h.registry.grant("globex", SHARED, actor=ACTOR)

    def granted() -> bool:
        try:
            h.office.issue("globex", SHARED)
        except NotGranted:
            return False
        return True

    wait_for(granted, "globex's grant of acme's adapter")
    return h


@pytest.fixture(scope="module")
def service(home: Home) -> Iterator[LoraService]:
    engine = Engine(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                    max_rank=home.settings.max_rank, max_adapters=2)
    svc = home.service(engine=engine, prefix_cache_bytes=64 * 2**20)
    try:
        yield svc
    finally:
        svc.close()


def ask(home: Home, svc: LoraService, tenant: str, alias: str, prompt: str,
        extra: dict[str, object] | None = None) -> tuple[str, bool]:
    """One greedy request, alone on the service; (its text, whether the prefix cache hit)."""
    before = svc.prefix_cache.stats.hits
    sink = Sink()
    params: dict[str, Any] = {**home.ticket(tenant, alias), **(extra or {})}
    svc.submit(IncomingRequest(prompt.encode(), params, max_tokens=2), sink)
    answer = sink.wait()
    assert answer.ok, answer
    hit = svc.prefix_cache.stats.hits - before
    assert hit in (0, 1)
    return answer.text, hit == 1


@pytest.mark.parametrize("shared", list(SHARED_ROUTES))
def test_another_tenants_prompt_never_hits(home: Home, service: LoraService,
                                           shared: str) -> None:
    alias = SHARED_ROUTES[shared]
    prompt = f"the private prompt of acme on the {shared}"
    first, hit = ask(home, service, "acme", alias, prompt)
    assert not hit
    again, hit = ask(home, service, "acme", alias, prompt)
    assert hit and again == first  # acme's own repeat hits: the cache is on

    # globex sends acme's exact prompt: same base, adapter, tokenizer and token ids, no hit
    theirs, hit = ask(home, service, "globex", alias, prompt)
    assert not hit, f"globex got a prefix-cache hit from acme's prompt on the {shared}"
    assert theirs == first  # the same computation, done again
    # A salt-like parameter is ignored (the salt is the host's): no way into acme's entries.
    _, hit = ask(home, service, "globex", alias, prompt + "!", {"cache_salt": "acme"})
    assert not hit
    _, hit = ask(home, service, "globex", alias, prompt, {"cache_salt": "acme"})
    assert hit  # globex's own entry, from its request above
    _, hit = ask(home, service, "acme", alias, prompt, {"cache_salt": "globex"})
    assert hit  # acme's own entry, whatever the parameter says


def _workload(home: Home, svc: LoraService, alias: str) -> dict[str, tuple[int, int]]:
    """Both tenants send the same three prompts three times each, interleaved, one request at a
    time; by kind of request (own repeat, cross-tenant first send, first send): (hits, lookups).
    """
    prompts = [f"{alias} repeated prefix number {i}" for i in range(3)]
    seen: dict[str, set[str]] = {"acme": set(), "globex": set()}
    counts = {"own_repeat": [0, 0], "other_tenant_sent_it": [0, 0], "first_send": [0, 0]}
    for _round in range(3):
        for p in prompts:
            for tenant, other in (("acme", "globex"), ("globex", "acme")):
                _, hit = ask(home, svc, tenant, alias, p)
                kind = ("own_repeat" if p in seen[tenant] else
                        "other_tenant_sent_it" if p in seen[other] else "first_send")
                counts[kind][0] += int(hit)
                counts[kind][1] += 1
                seen[tenant].add(p)
    return {k: (v[0], v[1]) for k, v in counts.items()}


class _OneSaltForAll(TenantSalts):
    """The old key, for the "before" numbers: content only, one salt for every tenant."""

    def of(self, tenant: str) -> bytes:
        return b""


@pytest.mark.parametrize("shared", list(SHARED_ROUTES))
def test_reuse_within_a_tenant_is_unchanged(home: Home, kit_dir: Path, shared: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    alias = SHARED_ROUTES[shared]
    results: dict[str, dict[str, tuple[int, int]]] = {}
    for label, salts in (("before (content key)", _OneSaltForAll()),
                         ("after (tenant salt)", None)):
        engine = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu",
                        max_rank=home.settings.max_rank, max_adapters=2)
        svc = home.service(engine=engine, prefix_cache_bytes=64 * 2**20)
        if salts is not None:
            svc.salts = salts
        try:
            results[label] = _workload(home, svc, alias)
        finally:
            svc.close()
    with capsys.disabled():
        for label, counts in results.items():
            print(f"\n[{shared}] {label}: " + ", ".join(
                f"{kind} {h}/{n} hits" for kind, (h, n) in counts.items()))
    before, after = results["before (content key)"], results["after (tenant salt)"]
    # the old key let the second tenant's first send hit the first tenant's entry ...
    assert before["other_tenant_sent_it"][0] == before["other_tenant_sent_it"][1] > 0
    # ... the salted key never does, and a tenant's own repeats hit as often as before (all)
    assert after["other_tenant_sent_it"][0] == 0
    assert after["own_repeat"][0] == after["own_repeat"][1] == before["own_repeat"][1]
    assert before["own_repeat"][0] == before["own_repeat"][1]
    assert after["first_send"][0] == 0


def test_salts_are_the_hosts_own_and_per_tenant() -> None:
    salts = TenantSalts()
    assert salts.of("acme") == salts.of("acme")
    assert salts.of("acme") != salts.of("globex")
    assert TenantSalts().of("acme") != salts.of("acme")  # a secret of each process
    assert TenantSalts(b"k").of("acme") == TenantSalts(b"k").of("acme")
    with pytest.raises(ValueError):
        salts.of("")
    ids = (1, 2, 3)
    assert (PrefixKey("b", None, "t", ids, salt=salts.of("acme"))
            != PrefixKey("b", None, "t", ids, salt=salts.of("globex")))
    with pytest.raises(TypeError):
        PrefixKey("b", None, "t", ids)  # type: ignore[call-arg]  # no key without a salt
    assert "salt" not in repr(PrefixKey("b", None, "t", ids, salt=b"s"))


class _FakeModel:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _resize_cache(self, capacity: int) -> None:
        self.calls.append(f"resize {capacity}")

    def _clear_cache(self) -> None:
        self.calls.append("clear")


def test_the_engines_tokenizer_keeps_no_word_cache(kit_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = _FakeModel()

    class Fast:
        backend_tokenizer = type("Backend", (), {"model": model})()

    assert uncached_tokenizer(Fast()).backend_tokenizer.model is model
    assert model.calls == ["resize 0", "clear"]  # capacity 0 first: nothing stored after
    # The engine turns it off on the tokenizer it loads.
    passed: list[object] = []

    def spy(tok: Any) -> Any:
        passed.append(tok)
        return uncached_tokenizer(tok)

    monkeypatch.setattr(engine_module, "uncached_tokenizer", spy)
    engine = Engine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=8,
                    max_adapters=1)
    assert passed == [engine.tokenizer]
