"""``loraplane demo``: the whole path on embedded defaults, in a few minutes on two CPU cores.

Builds the reference kit, registers a base and three adapters for two tenants, grants and
promotes, starts the gateway, the projection follower and a real tritonserver, sends a concurrent
mixed burst over HTTP and gRPC, shows a cross-tenant refusal, revokes an adapter and shows its
tickets refused, puts a degraded adapter through the real evaluation gate (refused), overrides the
gate with a recorded break-glass and rolls its canary out, which rolls itself back, then prints
the incident view for the revoked digest and the audit log.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from control.app.audit import audit_log
from control.app.registry import Registry
from control.contracts.config import Settings
from control.contracts.db import dispose_engines, make_engine
from control.contracts.digests import short
from control.contracts.ledger import Ledger
from control.domain import ValidationFailed
from control.ops.clients import TritonRefused, generate, request_ticket
from control.ops.serve import Deployment, Ports
from control.tools.kit import KitManifest, build_kit
from control.tools.rollout_demo import show_rollback
from control.tools.views import audit_table, incident_table
from projections.follower import open_registry

PROMPTS = ("Hello there", "What is the weather", "Tell me a story", "Name a colour",
           "Count to three", "Who are you")


@dataclass(frozen=True)
class Plan:
    tenant: str
    alias: str
    adapter: str | None  # kit adapter name, None for the base alias


PLANS = (
    Plan("acme", "acme-alpha", "alpha"),
    Plan("acme", "acme-beta", "beta"),
    Plan("globex", "globex-gamma", "gamma"),
    Plan("acme", "base", None),
    Plan("globex", "base", None),
)


Step = Callable[[str], None]


@dataclass
class Catalogue:
    """What the demo registered: each tenant's API key and each kit adapter's digest."""

    keys: dict[str, str]
    digests: dict[str, str]


def run_demo(work_dir: Path, *, fresh: bool = True, json_out: bool = False) -> int:
    console = Console(stderr=json_out)
    started = time.monotonic()

    def step(msg: str) -> None:
        console.print(f"[bold cyan][{time.monotonic() - started:5.1f}s][/bold cyan] {msg}")

    work_dir = work_dir.resolve()
    kit_dir, settings = _prepare(work_dir, fresh=fresh, step=step, console=console)
    kit = KitManifest.load(kit_dir)
    reg = open_registry(settings)
    actor = "demo-operator"
    cat = _register(reg, kit, kit_dir, step, actor)

    ports = Ports.free()
    dep = Deployment(settings, ports, actor=actor, progress=step)
    results: list[dict[str, Any]] = []
    rollout: dict[str, Any] = {}
    refusal = ""
    try:
        dep.start()
        tickets = _tickets(dep, cat, step)
        results = _mixed_burst(dep, tickets, step, console)
        status, body = request_ticket(dep.gateway_url, cat.keys["acme"], "globex-gamma")
        step(f"acme asks for globex's alias globex-gamma -> HTTP {status} {json.dumps(body)}")
        refusal = _revoke_gamma(reg, dep, cat, tickets[("globex", "globex-gamma")], step, actor)
        # The gate refuses a degraded adapter; a break-glass canary of it rolls itself back
        # (control/tools/rollout_demo.py).
        rollout = show_rollback(reg, dep, kit, kit_dir, cat.keys["acme"], step, console, actor)
    finally:
        step("stopping tritonserver, gateway and follower")
        dep.stop()
    return _report(reg, settings, cat, results, refusal, rollout, step, console,
                   json_out=json_out)


def _prepare(work_dir: Path, *, fresh: bool, step: Step, console: Console) -> tuple[Path, Settings]:
    """The kit (built once, reused after) and the demo's own home and database."""
    kit_dir = work_dir / "kit"
    home = work_dir / "home"
    if fresh and home.exists():
        _rmtree(home)
    if not (kit_dir / "kit.json").exists():
        step("building the reference kit (tiny Llama bases, byte tokenizer, 6 LoRA adapters)")
        build_kit(kit_dir, progress=lambda m: console.print(f"    {m}"))
    settings = Settings.from_env(home)
    if "LORAPLANE_DB_URL" in os.environ:
        # The demo keeps its own SQLite file so it never touches a shared database.
        settings = Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}")
    settings.ensure_dirs()
    return kit_dir, settings


def _register(reg: Registry, kit: KitManifest, kit_dir: Path, step: Step,
              actor: str) -> Catalogue:
    """Base, tenants, the plans' adapters released, one refused registration, the grants."""
    step("registering the base model and its tokenizer")
    reg.register_base(kit_dir / kit.base_path, kit_dir / kit.tokenizer_path, name="tiny-llama",
                      actor=actor, alias="base")
    keys = {t: reg.create_tenant(t, actor=actor) for t in ("acme", "globex")}
    step("created tenants acme and globex (API keys printed once, only hashes stored)")
    digests: dict[str, str] = {}
    for p in PLANS:
        if p.adapter is None:
            continue
        a = kit.adapters[p.adapter]
        digest = reg.register_adapter(kit_dir / a.path, tenant=p.tenant, alias=p.alias,
                                      actor=actor)
        digests[p.adapter] = digest
        # The lifecycle has guards: an evaluation report (this one written outside the gate:
        # it must say it passed and name its producer), then candidate -> canary -> stable
        # (each alias's first release: stable on its canary evidence).
        reg.advance(digest, external=True, actor=actor,
                    evaluation={"producer": "demo", "suite": "demo-smoke", "passed": True})
        step(f"registered + released {p.adapter} for {p.tenant} as {p.alias} ({short(digest)})")
    try:
        reg.register_adapter(kit_dir / kit.adapters["other-base"].path, tenant="globex",
                             alias="globex-other", actor=actor)
    except ValidationFailed as e:
        step(f"[yellow]refused as expected[/yellow]: adapter for another base -> {e}")
    for p in PLANS:
        reg.grant(p.tenant, p.alias, actor=actor)
    step("granted: acme -> acme-alpha, acme-beta, base; globex -> globex-gamma, base")
    return Catalogue(keys, digests)


def _tickets(dep: Deployment, cat: Catalogue, step: Step) -> dict[tuple[str, str], str]:
    tickets = {}
    for p in PLANS:
        status, body = request_ticket(dep.gateway_url, cat.keys[p.tenant], p.alias)
        assert status == 200, body
        tickets[(p.tenant, p.alias)] = body["ticket"]
    step("tickets issued by the gateway (POST /v1/tickets)")
    return tickets


def _mixed_burst(dep: Deployment, tickets: dict[tuple[str, str], str], step: Step,
                 console: Console) -> list[dict[str, Any]]:
    """24 concurrent requests over HTTP and gRPC, every plan in turn, shown as a table."""
    assert dep.triton is not None
    http, grpc = dep.triton.http_url, dep.triton.grpc_url
    jobs = []
    for i in range(24):
        p = PLANS[i % len(PLANS)]
        proto = "http" if i % 2 == 0 else "grpc"
        jobs.append((p, proto, PROMPTS[i % len(PROMPTS)]))

    def call(job: tuple[Plan, str, str]) -> dict[str, Any]:
        p, proto, prompt = job
        g = generate(http if proto == "http" else grpc, prompt,
                     tickets[(p.tenant, p.alias)], protocol=proto, max_tokens=16)
        return {"tenant": p.tenant, "alias": p.alias, "protocol": proto, "prompt": prompt,
                "adapter_digest": g.adapter_digest, "output": g.text,
                "request_id": g.request_id}

    step(f"sending a concurrent mixed burst of {len(jobs)} requests over HTTP and gRPC")
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, jobs))
    t = Table(title="mixed burst: one base model, adapters chosen by signed tickets")
    for c in ("tenant", "alias", "proto", "digest", "prompt", "output"):
        t.add_column(c)
    for r in results:
        t.add_row(r["tenant"], r["alias"], r["protocol"],
                  short(r["adapter_digest"]) if r["adapter_digest"] else "(base)",
                  r["prompt"], repr(r["output"]))
    console.print(t)
    return results


def _revoke_gamma(reg: Registry, dep: Deployment, cat: Catalogue, ticket: str, step: Step,
                  actor: str) -> str:
    """Revoke gamma and time how long its issued ticket keeps working; returns Triton's refusal."""
    assert dep.triton is not None
    http = dep.triton.http_url
    gamma = cat.digests["gamma"]
    reg.revoke(gamma, reason="demo: suspected data leak", actor=actor)
    revoked_at = time.monotonic()
    step(f"revoked gamma ({short(gamma)})")
    refusal = ""
    while time.monotonic() - revoked_at < 5:
        try:
            generate(http, "Hello", ticket, max_tokens=4)
        except TritonRefused as e:
            refusal = f"{e.status} {e.message}"
            break
        time.sleep(0.05)
    step(f"globex's gamma ticket refused by Triton after "
         f"{time.monotonic() - revoked_at:.2f}s: {refusal}")
    status, _ = request_ticket(dep.gateway_url, cat.keys["globex"], "globex-gamma")
    step(f"new ticket for globex-gamma -> HTTP {status}")
    return refusal


def _report(reg: Registry, settings: Settings, cat: Catalogue, results: list[dict[str, Any]],
            refusal: str, rollout: dict[str, Any], step: Step, console: Console, *,
            json_out: bool) -> int:
    """The incident view for gamma, the audit log, and whether everything went as expected."""
    gamma = cat.digests["gamma"]
    rows = [r for r in Ledger(make_engine(settings.db_url)).query(adapter=gamma)
            if r.outcome != "rejected"]
    console.print(incident_table(rows, gamma))
    served = sum(1 for r in rows if r.outcome == "ok")
    expected = sum(1 for r in results if r["adapter_digest"] == gamma)
    step(f"incident view: gamma served {len(rows)} requests; the burst sent it {expected}")
    entries = audit_log(reg)
    console.print(audit_table(entries))
    dispose_engines()
    ok = (served == expected and bool(refusal) and bool(rollout.get("rolled_back"))
          and rollout.get("gate", {}).get("passed") is False
          and bool(rollout.get("external_report_refused")))
    if json_out:
        print(json.dumps({"ok": ok, "burst": results, "revocation_refusal": refusal,
                          "incident_rows": len(rows), "audit_events": len(entries),
                          "rollout": rollout}))
    step("demo finished" + ("" if ok else " [red]with unexpected results[/red]"))
    return 0 if ok else 1


def _rmtree(path: Path) -> None:
    # The artifact store is read-only by design; make it writable to delete a demo home.
    for p in path.rglob("*"):
        if p.is_dir() and not p.is_symlink():
            p.chmod(0o755)
    shutil.rmtree(path)
