"""Revocation of admitted work through the real tritonserver, with live gRPC streams on a busy
host (eight running rows of three adapters and the base, more queued).

- Default (drain): a request queued on the digest is refused with the generic refusal and a row
  ``rejected``/``revoked``; the streams already running finish, ``ok``.
- ``adapter revoke --immediate`` (the kill switch): every running stream on the digest ends,
  its last token delivered within 1 s of the command's start, with the generic refusal and a
  row ``revoked`` whose ``tokens_out`` counts at least what the client received; streams of other
  adapters run to their end.

The engine model is the production glue and service over an engine that never stops at eos
(tests.endless_glue), so a stream is still running when its adapter is revoked. The timings
(command to last token) are printed for the closing note and the README.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from control.contracts.db import make_engine
from control.contracts.ledger import Ledger, LedgerEntry
from control.contracts.tickets import GENERIC_REFUSAL
from control.contracts.wire import (
    ENGINE_MODEL,
    MAX_TOKENS,
    REQUEST_ID,
    STREAM,
    TEXT_INPUT,
    TEXT_OUTPUT,
    TICKET_PARAM,
)
from control.ops.clients import request_ticket
from control.ops.model_repositories import derived_repository
from tests.endless_glue import MODEL_SOURCE
from tests.integration.conftest import ACTOR, Stack, started_stack

pytestmark = pytest.mark.triton

KILL_WITHIN_S = 1.0
MAX_RUNNING = 8
LONG = 230  # tokens a stream asks for: seconds of decoding on this host


@pytest.fixture(scope="module")
def stack(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    repo = derived_repository(tmp_path_factory.mktemp("kill-repo") / "models", MODEL_SOURCE)
    before = os.environ.get("LORAPLANE_MAX_RUNNING")
    os.environ["LORAPLANE_MAX_RUNNING"] = str(MAX_RUNNING)  # the host's scheduler reads it
    try:
        with started_stack(kit_dir, tmp_path_factory, "kill-switch",
                           model_repository=repo) as s:
            yield s
    finally:
        os.environ.pop("LORAPLANE_MAX_RUNNING", None)
        if before is not None:
            os.environ["LORAPLANE_MAX_RUNNING"] = before


@dataclass
class LiveStream:
    """One gRPC stream_infer call, read on its own thread; each piece stamped on arrival."""

    url: str
    ticket: str
    stamps: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    request_id: str = ""
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> LiveStream:
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        inputs = []
        for name, value, dtype in ((TEXT_INPUT, np.array([[b"Once upon a time"]], np.object_),
                                    "BYTES"),
                                   (MAX_TOKENS, np.array([[LONG]], np.int32), "INT32"),
                                   (STREAM, np.array([[True]]), "BOOL")):
            t = grpcclient.InferInput(name, list(value.shape), dtype)
            t.set_data_from_numpy(value)
            inputs.append(t)
        try:
            client.async_stream_infer(ENGINE_MODEL, inputs,
                                      parameters={TICKET_PARAM: self.ticket},
                                      enable_empty_final_response=True)
            while True:
                result, error = answers.get(timeout=120)
                if error is not None:
                    self.error = error.message()
                    return
                if result.as_numpy(TEXT_OUTPUT) is not None:
                    self.stamps.append(time.monotonic())
                    self.pieces.append(result.as_numpy(TEXT_OUTPUT).reshape(-1)[0].decode())
                    self.request_id = result.as_numpy(REQUEST_ID).reshape(-1)[0].decode()
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    return
        finally:
            client.stop_stream()
            client.close()
            self.done.set()

    def wait(self) -> LiveStream:
        assert self.done.wait(120), "the stream did not end"
        return self


def _ticket(stack: Stack, tenant: str, alias: str) -> str:
    status, body = request_ticket(stack.deployment.gateway_url, stack.api_keys[tenant], alias)
    assert status == 200, body
    return str(body["ticket"])


def _running(streams: list[LiveStream]) -> None:
    deadline = time.monotonic() + 60
    while not all(len(s.pieces) >= 2 for s in streams):
        failed = [s.error for s in streams if s.done.is_set() and len(s.pieces) < 2]
        assert not failed, failed
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.01)


def _rows(stack: Stack, digest: str) -> dict[str, LedgerEntry]:
    return {r.request_id: r for r in Ledger(make_engine(stack.settings.db_url)).query(
        adapter=digest)}


def _busy_host(stack: Stack, victim: tuple[str, str]) -> tuple[list[LiveStream],
                                                              list[LiveStream],
                                                              list[LiveStream]]:
    """Eight running streams (four on the victim alias, two on gamma, two on the base), then
    two more on the victim that wait in the host's queue. Returns (victim's running, others,
    victim's queued)."""
    victims = [LiveStream(stack.grpc, _ticket(stack, *victim)).start() for _ in range(4)]
    others = [LiveStream(stack.grpc, _ticket(stack, "globex", "globex-gamma")).start()
              for _ in range(2)]
    others += [LiveStream(stack.grpc, _ticket(stack, "acme", "base")).start() for _ in range(2)]
    _running(victims + others)
    queued = [LiveStream(stack.grpc, _ticket(stack, *victim)).start() for _ in range(2)]
    time.sleep(0.3)  # admitted and queued behind the eight running rows
    assert all(not q.pieces for q in queued)
    return victims, others, queued


def test_drain_refuses_queued_work_and_lets_running_streams_finish(stack: Stack) -> None:
    beta = stack.digests["beta"]
    victims, others, queued = _busy_host(stack, ("acme", "acme-beta"))
    t0 = time.monotonic()
    stack.registry.revoke(beta, "test: drain through Triton", actor=ACTOR)
    for q in queued:
        assert q.wait().error == GENERIC_REFUSAL and not q.pieces
    refused_after = time.monotonic() - t0
    pieces_after = [sum(1 for t in s.stamps if t > t0) for s in victims]
    for s in victims + others:
        assert s.wait().error is None, s.error
    rows = _rows(stack, beta)
    # Admitted and running: each ran to its end, all of its tokens.
    assert [(rows[s.request_id].outcome, rows[s.request_id].tokens_out)
            for s in victims] == [("ok", LONG)] * 4
    print(f"\ndrain through Triton: queued requests refused {refused_after:.3f} s after the "
          f"command started; running streams went on to their end ({pieces_after} pieces "
          "after it)")
    refused = [r for r in rows.values() if r.reason == "revoked"]
    assert len(refused) == 2 and {r.outcome for r in refused} == {"rejected"}


def test_the_kill_switch_ends_running_streams_within_a_second(stack: Stack) -> None:
    alpha = stack.digests["alpha"]
    victims, others, queued = _busy_host(stack, ("acme", "acme-alpha"))
    t0 = time.monotonic()
    stack.registry.revoke(alpha, "test: licence withdrawn", actor=ACTOR, immediate=True)
    returned = time.monotonic() - t0
    for q in queued:
        assert q.wait().error == GENERIC_REFUSAL and not q.pieces
    last = []
    for s in victims:
        assert s.wait().error == GENERIC_REFUSAL, s.error
        last.append(max(s.stamps) - t0)
    print(f"\nkill switch through Triton: revoke() returned after {returned:.3f} s; last "
          f"token of each killed stream {', '.join(f'{t:.3f}' for t in last)} s after the "
          "command started")
    assert max(last) < KILL_WITHIN_S, f"a token arrived {max(last):.2f} s after the command"
    rows = _rows(stack, alpha)
    for s in victims:
        row = rows[s.request_id]
        assert (row.outcome, row.reason) == ("revoked", "immediate")
        # what the client had received (a piece holds one token or more), and no more than that
        assert row.tokens_out is not None and len(s.pieces) <= row.tokens_out < LONG
    ledger = Ledger(make_engine(stack.settings.db_url))
    for s in others:  # other tenants and the base ran to their end
        assert s.wait().error is None, s.error
        row = ledger.get(s.request_id)
        assert row is not None and (row.outcome, row.tokens_out) == ("ok", LONG)
