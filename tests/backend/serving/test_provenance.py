"""Provenance does not rest on one check: with the generation check removed, a slot reloaded
under a live row still fails that row closed as ``identity_mismatch``, never ``ok``.

The generation check (``Engine.stale_rows``: the row's slot still holds the load it was admitted
on) used to be the only thing between a reloaded slot and another tenant's answer recorded as
``ok`` under this tenant's digest. Here it is disabled outright (a mutant engine whose
``stale_rows`` finds nothing, which also disables the forward pass's backstop), the old bug is
reproduced by hand (alpha's pin dropped, alpha unloaded, gamma placed in the same slot while
alpha's row is live), and the row must still fail closed, because every forward pass reads the
digest the slot's banks hold at compute time (``Sequence.observed``). The text that was computed
with gamma's weights must never reach the client, streamed or not.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from backend.serving.engine import Engine
from backend.serving.engine import Sequence as EngineSequence
from backend.serving.service import IncomingRequest, LoraService
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from tests.integration.reference import Reference
from tests.serving_home import Home, Sink, provision_home


class NoGenerationCheck(Engine):
    """The real engine with its generation check removed (a mutant): no row is ever stale."""

    def stale_rows(self, seqs: Sequence[EngineSequence]) -> list[int]:
        return []


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("provenance-home")
    return provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                          kit_dir)


@pytest.fixture
def service(home: Home) -> Iterator[LoraService]:
    engine = NoGenerationCheck(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                               max_rank=home.settings.max_rank, max_adapters=2)
    svc = home.service(engine=engine, prefix_cache_bytes=0)
    try:
        yield svc
    finally:
        svc.close()


class HoldAt(Sink):
    """A sink whose ``cancelled()``, which the scheduler calls between decode steps, holds the
    scheduler at its ``n``-th call until released: the row has run a few passes by then."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n, self.calls = n, 0
        self.release = threading.Event()

    def cancelled(self) -> bool:
        self.calls += 1
        if self.calls == self.n:
            self.held.set()
            assert self.release.wait(30)
        return False


def _swap_alpha_for_gamma(home: Home, svc: LoraService) -> None:
    """The old bug, by hand: alpha's pin count drifts to zero under its live row, alpha is
    unloaded and gamma takes its slot."""
    eng = svc.engine
    alpha, gamma = home.digests["alpha"], home.digests["gamma"]
    slot = eng.slot_of(alpha)
    with eng._lock:
        eng._active.pop(slot)
    eng.unload_adapter(alpha)
    eng.place(gamma, eng.read_adapter(svc.store.read_verified(gamma)))
    assert eng.slot_of(gamma) == slot


@pytest.mark.parametrize("stream", [False, True])
def test_a_reloaded_slot_fails_the_row_closed_without_the_generation_check(
        home: Home, service: LoraService, stream: bool) -> None:
    sink = HoldAt(3)  # the row runs two steps, then the scheduler waits while we swap
    prompt = "Once upon a time"
    service.submit(IncomingRequest(prompt.encode(), home.ticket("acme", "acme-alpha"),
                                   max_tokens=40, stream=stream), sink)
    assert sink.held.wait(30)
    assert not sink.done.is_set()
    _swap_alpha_for_gamma(home, service)
    sink.release.set()
    answer = sink.wait()

    assert not answer.ok and answer.outcome == "identity_mismatch", answer
    assert answer.text == ""
    row = Ledger(make_engine(home.settings.db_url)).get(answer.request_id)
    assert row is not None
    assert (row.outcome, row.reason) == ("identity_mismatch", "slot_digest")
    assert row.adapter_digest == home.digests["alpha"]
    # The weights that computed the failing pass, read from the banks: gamma's.
    assert row.served_digest == home.digests["gamma"]
    # Every piece the client got was computed with alpha's weights and says so; nothing
    # computed with gamma's reached it.
    assert sink.piece_digests <= {home.digests["alpha"]}
    reference = Reference(home.kit_dir / "base", home.kit_dir / "tokenizer")
    want = reference.generate(prompt, home.kit_dir / "adapters" / "alpha", 40)
    assert want.startswith("".join(sink.pieces))


def test_a_row_whose_banks_held_the_right_adapter_is_served_and_says_so(
        home: Home, service: LoraService) -> None:
    # The control case: same mutant engine, no swap, the row is served by alpha.
    sink = Sink()
    service.submit(IncomingRequest(b"Hello", home.ticket("acme", "acme-alpha"), max_tokens=8),
                   sink)
    answer = sink.wait()
    assert answer.ok and answer.adapter_digest == home.digests["alpha"]
    reference = Reference(home.kit_dir / "base", home.kit_dir / "tokenizer")
    assert answer.text == reference.generate("Hello", home.kit_dir / "adapters" / "alpha", 8)


def test_a_prefix_cache_hit_carries_the_digest_that_computed_it(home: Home) -> None:
    # A row restored from the prompt cache skips its prefill pass: the digest it reports must
    # still come from a computation (the one that filled the entry), so a one-token answer has
    # a served digest, the right one.
    engine = Engine(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                    max_rank=home.settings.max_rank, max_adapters=2)
    svc = home.service(engine=engine, prefix_cache_bytes=64 * 2**20)
    try:
        answers = []
        for _ in range(2):
            sink = Sink()
            svc.submit(IncomingRequest(b"Hello", home.ticket("acme", "acme-beta"),
                                       max_tokens=1), sink)
            answers.append(sink.wait())
        assert svc.prefix_cache.stats.hits >= 1
        for a in answers:
            assert a.ok and a.adapter_digest == home.digests["beta"], a
    finally:
        svc.close()


def test_weights_changed_under_a_live_row_fail_it_closed(home: Home) -> None:
    # Neither the slot table nor the banks' digest changes: only the weights do (a stray write
    # into the slot). The sampled weight fingerprint, taken here on every pass, catches it.
    engine = Engine(home.kit_dir / "base", home.kit_dir / "tokenizer", device="cpu",
                    max_rank=home.settings.max_rank, max_adapters=2)
    engine.fingerprint_every = 1
    svc = home.service(engine=engine, prefix_cache_bytes=0)
    try:
        clean = Sink()  # the check itself never fails a row whose weights are intact
        svc.submit(IncomingRequest(b"Hello", home.ticket("acme", "acme-alpha"), max_tokens=8),
                   clean)
        assert clean.wait().ok
        sink = HoldAt(3)
        svc.submit(IncomingRequest(b"Once upon a time", home.ticket("acme", "acme-alpha"),
                                   max_tokens=40, stream=True), sink)
        assert sink.held.wait(30)
        slot = engine.slot_of(home.digests["alpha"])
        assert slot is not None
        a, _b = next(iter(engine._slotted.values())).banks()
        a[slot, 0, 0] += 0.5  # one weight of one module, nothing else
        sink.release.set()
        answer = sink.wait()
        assert not answer.ok and answer.outcome == "identity_mismatch"
        row = Ledger(make_engine(home.settings.db_url)).get(answer.request_id)
        assert row is not None and (row.outcome, row.reason) == ("identity_mismatch",
                                                                 "slot_digest")
        assert row.served_digest == "weights_changed"
        assert engine.violations.snapshot()["slot_weights"] >= 1
    finally:
        svc.close()
