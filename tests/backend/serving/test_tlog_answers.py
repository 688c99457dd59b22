"""A served answer's receipt, through the real service: the host's log binds the exact text the
client got (and the digest the slot held) to the request, and the receipt verifies offline with
that text only, on the host key the control plane recorded. Before, nothing bound the answer's
text to the ledger, and an edited row left no trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.serving.service import IncomingRequest
from control.app.ledger_audit import load, receipt, sync, verify
from control.contracts.config import Settings
from control.contracts.db import make_engine
from control.contracts.receipt import trusted_keys, verify_receipt
from control.contracts.tlog import ProofError
from tests.serving_home import Home, Sink, provision_home


@pytest.fixture(scope="module")
def home(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Home:
    root = tmp_path_factory.mktemp("receipts-home")
    return provision_home(Settings(home=root, db_url=f"sqlite:///{root / 'loraplane.db'}"),
                          kit_dir)


def test_an_answers_receipt_verifies_with_its_text_and_names_its_adapter(home: Home) -> None:
    svc = home.service(host="receipt-host")
    try:
        sink = Sink()
        svc.submit(IncomingRequest(b"Once upon a time", home.ticket("acme", "acme-alpha"),
                                   max_tokens=5), sink)
        answer = sink.wait()
        refused = Sink()
        svc.submit(IncomingRequest(b"Once upon a time", {"lora_ticket": "not-a-ticket"}),
                   refused)
        assert answer.ok and not refused.wait().ok
    finally:
        svc.close()  # signs the host's checkpoint
    engine = make_engine(home.settings.db_url)
    assert sync(home.registry, engine).verified == [("receipt-host", 2)]
    text = receipt(home.registry, engine, answer.request_id)
    agg = load(home.registry, "receipt-host")
    assert agg is not None
    keys = trusted_keys("\n".join(agg.vkeys))
    checked = verify_receipt(text, answer.text.encode(), keys)
    assert (checked.entry["tenant"], checked.entry["served_digest"],
            checked.entry["base_digest"], checked.entry["outcome"]) == (
        "acme", home.digests["alpha"], home.base_digest, "ok")
    assert answer.adapter_digest == home.digests["alpha"]
    with pytest.raises(ProofError) as e:
        verify_receipt(text, (answer.text + " ").encode(), keys)
    assert e.value.check == "output"
    assert verify(home.registry, engine).ok
