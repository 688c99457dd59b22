"""A release's inference defaults apply: a request that omits a sampling parameter gets the value
its release ships with, taken from the release its ticket names, and the ledger records the
values the engine generated with (in-process; the OpenAI route and Triton's generate route are
tests/integration/test_release_defaults.py).

Before, the defaults were validated, stored and projected, but no host read them: a request that
omitted ``max_tokens`` got the host's 16 whatever its release said.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.serving.service import IncomingRequest, LoraService
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.ledger import Ledger
from tests.integration.conftest import ACTOR
from tests.integration.reference import Reference
from tests.serving_home import Home, Sink, provision_home

ALIAS = "acme-defaults"
DEFAULTS = {"temperature": 0, "max_tokens": 7}


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("defaults-home")
    home = provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                          kit_dir)
    kit_adapter = home.kit_dir / "adapters" / "alpha-v2"
    digest = home.registry.register_adapter(kit_adapter, tenant="acme", alias=ALIAS,
                                            actor=ACTOR)
    home.registry.advance(digest, external=True, actor=ACTOR, inference_defaults=DEFAULTS,
                          evaluation={"suite": "smoke", "passed": True, "producer": "test"})
    home.registry.grant("acme", ALIAS, actor=ACTOR)
    home.digests["alpha-v2"] = digest
    return home


@pytest.fixture(scope="module")
def service(home: Home) -> Iterator[LoraService]:
    svc = home.service(host="defaults-host")
    try:
        yield svc
    finally:
        svc.close()


def _ask(service: LoraService, req: IncomingRequest) -> tuple[str, int, object]:
    sink = Sink()
    service.submit(req, sink)
    a = sink.wait()
    assert a.ok, a
    row = Ledger(make_engine(service.settings.db_url)).get(a.request_id)
    assert row is not None
    return a.text, int(row.tokens_out or 0), row


def test_a_request_that_omits_sampling_values_gets_its_releases(home: Home,
                                                                  service: LoraService) -> None:
    prompt = "Once upon a time"
    text, tokens, row = _ask(service, IncomingRequest(prompt.encode(),
                                                      home.ticket("acme", ALIAS)))
    reference = Reference(home.kit_dir / "base", home.kit_dir / "tokenizer")
    want = reference.generate(prompt, home.kit_dir / "adapters" / "alpha-v2", 7)
    assert text == want  # greedy (temperature 0), 7 tokens: PEFT computes the same
    assert tokens == 7
    assert (row.max_tokens, row.temperature, row.top_p, row.seed) == (7, 0.0, 1.0, None)


def test_the_requests_own_values_win(home: Home, service: LoraService) -> None:
    _text, tokens, row = _ask(service, IncomingRequest(b"Once upon a time",
                                                       home.ticket("acme", ALIAS), max_tokens=3))
    assert tokens == 3 and (row.max_tokens, row.temperature) == (3, 0.0)


def test_a_release_without_defaults_gets_the_contracts(home: Home,
                                                        service: LoraService) -> None:
    _text, _tokens, row = _ask(service, IncomingRequest(b"Hello",
                                                        home.ticket("acme", "acme-alpha")))
    assert (row.max_tokens, row.temperature, row.top_p) == (16, 0.0, 1.0)
