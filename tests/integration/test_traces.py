"""OpenTelemetry spans across gateway -> Triton -> backend, exported to a file.

A deployment of its own with ``LORAPLANE_TRACES=file:...`` (tracing is off by default): one
OpenAI-compatible request gives a gateway span and a backend span in one trace, the backend's a
child of the gateway's, both carrying the request id and the adapter digest.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from control.contracts.config import Settings
from control.ops.serve import Deployment, Ports
from control.ops.triton_server import TritonUnavailable, find_triton
from control.tools.kit import KitManifest
from projections.follower import open_registry
from tests.required import unavailable

ACTOR = "trace-test"


@pytest.fixture(scope="module")
def traced(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Deployment, str, str, Path]]:
    home = tmp_path_factory.mktemp("traced")
    try:
        find_triton(home)
    except TritonUnavailable as e:
        unavailable("the real tritonserver", str(e))
    spans = home / "spans.jsonl"
    mp = pytest.MonkeyPatch()
    mp.setenv("LORAPLANE_TRACES", f"file:{spans}")  # read by the gateway and the Triton stub
    settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}")
    settings.ensure_dirs()
    kit = KitManifest.load(kit_dir)
    reg = open_registry(settings)
    reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path, name="tiny-llama",
                      actor=ACTOR)
    key = reg.create_tenant("acme", actor=ACTOR)
    digest = reg.register_adapter(kit_dir / kit.adapters["alpha"].path, tenant="acme",
                                  alias="acme-alpha", actor=ACTOR)
    reg.advance(digest, external=True, evaluation={"suite": "smoke", "passed": True}, actor=ACTOR)
    reg.grant("acme", "acme-alpha", actor=ACTOR)
    dep = Deployment(settings, Ports.free(),
                     actor=ACTOR)
    try:
        dep.start()
        yield dep, key, digest, spans
    finally:
        dep.stop()
        mp.undo()


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gateway_and_backend_spans_share_one_trace(
        traced: tuple[Deployment, str, str, Path]) -> None:
    dep, key, digest, path = traced
    client = openai.OpenAI(base_url=dep.gateway_url + "/v1", api_key=key, max_retries=0)
    out = client.completions.create(model="acme-alpha", prompt="trace me", max_tokens=4)
    request_id = out.id.removeprefix("cmpl-")
    # The backend's span ends (and is exported) in the engine process, possibly just after the
    # answer left: wait for both spans rather than racing the exporter.
    deadline = time.monotonic() + 15
    while True:
        by_rid = [s for s in _spans(path)
                  if s["attributes"].get("loraplane.request_id") == request_id]
        names = {s["name"] for s in by_rid}
        if "backend.lora_llm" in names and any(n.startswith("gateway.") for n in names):
            break
        assert time.monotonic() < deadline, f"spans for the request: {sorted(names)}"
        time.sleep(0.1)
    gateway = next(s for s in by_rid if s["name"].startswith("gateway."))
    backend = next(s for s in by_rid if s["name"] == "backend.lora_llm")
    assert gateway["context"]["trace_id"] == backend["context"]["trace_id"]
    assert backend["parent_id"] == gateway["context"]["span_id"]
    for s in (gateway, backend):
        assert s["attributes"]["loraplane.adapter_digest"] == digest
    assert gateway["resource"]["attributes"]["service.name"] == "loraplane-gateway"
    assert backend["resource"]["attributes"]["service.name"] == "loraplane-backend"
