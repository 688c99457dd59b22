"""CLI verbs of the artifacts: the reference kit, base models, and adapters through their
lifecycle (register, evaluate, promote or release, revoke, serving steps after a revocation).

``loraplane kit build``                   the reference kit
``loraplane base register`` / ``list``    base models
``loraplane adapter ...``                 register, promote, revoke, list, evaluate, release,
                                          break-glass, show, serving-step (the gate's verbs:
                                          control.cli.gate)
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from control.cli.base import (
    adapter_app,
    as_dict,
    base_app,
    console,
    digest_arg,
    emit,
    err_console,
    errors,
    kit_app,
    print_fields,
    print_table,
    registry,
    routing,
    state,
)
from control.contracts.digests import short

# --- kit --------------------------------------------------------------------------------------

@kit_app.command("build")
def kit_build(
    out_dir: Path,
    seed: Annotated[int, typer.Option(help="Seed: same seed, same digests.")] = 1234,
) -> None:
    """Build the reference kit: a small Llama base, a tokenizer, and LoRA adapters."""
    # ~5 ms to import (torch only later, inside build_kit): only `kit build` pays for it
    from control.tools.kit import build_kit

    with errors():
        manifest = build_kit(out_dir, seed=seed,
                             progress=None if state.json else lambda m: err_console.print(m))
    data = json.loads((out_dir / "kit.json").read_text())
    emit(data, lambda: console.print_json(json.dumps(data)) if manifest else None)


# --- base -------------------------------------------------------------------------------------

@base_app.command("register")
def base_register(
    base_dir: Path,
    tokenizer: Annotated[Path | None, typer.Option(
        help="Tokenizer folder (default: ../tokenizer beside the base, or the base itself).")
    ] = None,
    name: Annotated[str | None, typer.Option(help="Base name (default: folder name).")] = None,
    alias: Annotated[str | None, typer.Option(
        help="Also create an alias for base-only tickets.")] = None,
) -> None:
    """Register a base model (and its tokenizer) by digest."""
    tok = tokenizer or (base_dir.parent / "tokenizer"
                        if (base_dir.parent / "tokenizer").is_dir() else base_dir)
    base_name = name or base_dir.name
    with errors():
        digest = registry().register_base(base_dir, tok, name=base_name,
                                          actor=state.actor, alias=alias)
    emit({"name": base_name, "digest": digest, "alias": alias}, lambda: console.print(
        f"registered base [bold]{base_name}[/bold] {digest}"))


@base_app.command("list")
def base_list() -> None:
    """Registered base models."""
    rows = [as_dict(b) for b in routing().bases()]
    emit(rows, lambda: print_table(["name", "digest", "tokenizer_digest"], rows))


# --- adapters ---------------------------------------------------------------------------------

@adapter_app.command("register")
def adapter_register(
    adapter_dir: Path,
    tenant: Annotated[str, typer.Option(help="Owning tenant.")],
    alias: Annotated[str, typer.Option(help="Alias to point at this adapter.")],
    base: Annotated[str | None, typer.Option(
        help="Base digest or name (default: from adapter_config.json).")] = None,
    signature: Annotated[Path | None, typer.Option(
        help="model_signing signature bundle over the folder.")] = None,
    owner: Annotated[str, typer.Option(help="Owner (team or person).")] = "",
    training_data_version: Annotated[str, typer.Option(help="Training data version.")] = "",
    task: Annotated[list[str] | None, typer.Option(help="An allowed task (repeatable).")] = None,
    licence: Annotated[str, typer.Option(help="Licence.")] = "",
    golden: Annotated[Path | None, typer.Option(
        help="Golden task set JSON the evaluation gate judges it by (recorded with it).")
    ] = None,
) -> None:
    """Validate and register a PEFT LoRA adapter (safetensors only); state: draft."""
    from control.contracts.golden import GoldenSet  # jsonschema, when a set holds a schema
    from control.domain import AdapterMetadata  # domain (eventsourcing): only when a verb runs

    with errors():
        meta = AdapterMetadata(owner=owner, training_data_version=training_data_version,
                               allowed_tasks=list(task or []), licence=licence)
        tasks = GoldenSet.load(golden) if golden is not None else None  # checked first
        digest = registry().register_adapter(adapter_dir, tenant=tenant, alias=alias,
                                             actor=state.actor, base=base,
                                             signature=signature, metadata=meta, golden=tasks)
    emit({"digest": digest, "tenant": tenant, "alias": alias, "state": "draft",
          "golden_digest": tasks.digest() if tasks is not None else None},
         lambda: console.print(
             f"registered adapter {digest} for {tenant} as [bold]{alias}[/bold] (draft)"))


@adapter_app.command("promote")
def adapter_promote(
    digest: str,
    to: Annotated[str | None, typer.Option(
        "--to", help="Target state (default: the next one).")] = None,
    canary_percent: Annotated[int, typer.Option(
        help="Share of sessions a new canary gets.")] = 10,
) -> None:
    """One lifecycle step: draft -> candidate -> canary -> stable -> deprecated."""
    d = digest_arg(digest)
    with errors():
        to = registry().promote(d, to=to, actor=state.actor, canary_percent=canary_percent)
    emit({"digest": d, "state": to}, lambda: console.print(f"{short(d)} -> {to}"))


@adapter_app.command("revoke")
def adapter_revoke(
    digest: str,
    reason: Annotated[str, typer.Option(help="Why (recorded in the audit log).")],
    immediate: Annotated[bool, typer.Option(
        "--immediate",
        help="Kill switch for security and licence events: also end the requests and "
             "streams already running on it, within a second (default: let them finish). "
             "May follow a revocation that is draining.")] = False,
    wait: Annotated[float, typer.Option(
        "--wait", min=0.0,
        help="Seconds to wait for the revocation set hosts read to show it.")] = 5.0,
) -> None:
    """Revoke an adapter everywhere: no new tickets, Triton refuses it within a second, and
    its queued requests are refused; running ones finish (or end now with --immediate).
    Succeeds only once the revocation set Triton hosts read holds the digest."""
    d = digest_arg(digest)
    with errors():
        registry().revoke(d, reason=reason, actor=state.actor, immediate=immediate,
                          wait_s=wait)
    emit({"digest": d, "state": "revoked", "immediate": immediate},
         lambda: console.print(f"{short(d)} revoked" + (
             ": running requests end now" if immediate else "")))


@adapter_app.command("list")
def adapter_list(tenant: Annotated[str | None, typer.Option()] = None) -> None:
    """The adapter catalogue."""
    rows = [as_dict(a) for a in routing().adapters(tenant)]
    emit(rows, lambda: print_table(["tenant", "alias", "digest", "state", "rank"], rows))


_EXTERNAL_HELP = ("The report was written outside the evaluation gate: accept it, recorded as "
                  "external (without a passing gate report, canary needs one). It must say "
                  "\"passed\": true and name its \"producer\" (or \"suite\"), and it never "
                  "overrides a failing gate report.")


@adapter_app.command("evaluate")
def adapter_evaluate(
    digest: str,
    report: Path,
    external: Annotated[bool, typer.Option("--external", help=_EXTERNAL_HELP)] = False,
) -> None:
    """Record an evaluation report (JSON) written outside the gate; needs --external.

    Canary needs a passing gate report (`loraplane adapter gate DIGEST`) or such a report."""
    from control.app.releases import load_report  # eventsourcing: only when a verb runs

    d = digest_arg(digest)
    with errors():
        report_digest = registry().record_evaluation(d, load_report(report), actor=state.actor,
                                                     external=external)
    emit({"digest": d, "report_digest": report_digest, "external": True},
         lambda: console.print(f"{short(d)}: external evaluation report {report_digest}"))


@adapter_app.command("release")
def adapter_release(
    digest: str,
    evaluation: Annotated[Path | None, typer.Option(
        help="Evaluation report JSON (written outside the gate) to record first; needs "
             "--external.")] = None,
    external: Annotated[bool, typer.Option("--external", help=_EXTERNAL_HELP)] = False,
    to: Annotated[str, typer.Option(help="canary or stable.")] = "stable",
    canary_percent: Annotated[int, typer.Option(
        help="Share of sessions the canary gets while the alias has a stable release.")] = 10,
    defaults: Annotated[str | None, typer.Option(
        help='Inference defaults, JSON, e.g. \'{"max_tokens": 64}\'.')] = None,
) -> None:
    """Walk an adapter candidate -> canary -> stable (each step its own event). Canary needs a
    passing gate report, or an external report (--evaluation FILE --external); stable needs a
    completed rollout, the alias's first release, or a break-glass (adapter break-glass)."""
    from control.app.releases import load_report  # eventsourcing: only when a verb runs

    d = digest_arg(digest)
    with errors():
        report = load_report(evaluation) if evaluation is not None else None
        reg = registry()
        final = reg.advance(d, actor=state.actor, evaluation=report, to=to,
                            canary_percent=canary_percent, external=external,
                            inference_defaults=_json_object_arg(defaults, "--defaults"))
        release = reg.adapter(d).release
    emit({"digest": d, "state": final, "release": release},
         lambda: console.print(f"{short(d)} -> {final} (release {release})"))


@adapter_app.command("break-glass")
def adapter_break_glass(
    digest: str,
    reason: Annotated[str, typer.Option(help="Why (recorded with your actor name).")],
    to: Annotated[str, typer.Option(
        help="canary: override the failing gate report; stable: override the missing "
             "rollout.")] = "canary",
    canary_percent: Annotated[int, typer.Option(
        help="Share of sessions the canary gets while the alias has a stable release.")] = 10,
) -> None:
    """An operator's override, recorded as BreakGlassUsed (who, why, what it overrides) in the
    same transaction as the move it allows: into canary despite a failing gate report, or into
    stable without a completed rollout. Refused where there is nothing to override."""
    d = digest_arg(digest)
    with errors():
        reg = registry()
        final = reg.break_glass(d, to=to, reason=reason, actor=state.actor,
                                canary_percent=canary_percent)
        release = reg.adapter(d).release
    emit({"digest": d, "state": final, "release": release, "break_glass": True,
          "reason": reason},
         lambda: console.print(f"{short(d)} -> {final} by break-glass (release {release})"))


def _json_object_arg(value: str | None, what: str) -> dict[str, Any] | None:
    if value is None:
        return None
    try:
        data = json.loads(value)
    except ValueError:
        raise typer.BadParameter(f"{what} must be a JSON object") from None
    if not isinstance(data, dict):
        raise typer.BadParameter(f"{what} must be a JSON object")
    return data


@adapter_app.command("show")
def adapter_show(digest: str) -> None:
    """One adapter: state, metadata, release, and serving steps after a revocation."""
    from control.domain import DomainError  # domain (eventsourcing): only when a verb runs

    d = digest_arg(digest)
    view = routing()
    row = view.adapter(d)
    if row is None:
        with errors():
            raise DomainError("adapter not found")
    data = {k: getattr(row, k) for k in row.__dataclass_fields__}
    data["serving_steps"] = view.serving_steps(d)
    emit(data, lambda: print_fields(data))


@adapter_app.command("serving-step")
def adapter_serving_step(
    digest: str,
    host: Annotated[str, typer.Option(help="The Triton host reporting.")],
    step: Annotated[str, typer.Option(help="drained, purged or unloaded (in that order).")],
) -> None:
    """Record a serving host's step after a revocation (called by the backend)."""
    d = digest_arg(digest)
    with errors():
        registry().record_serving_step(d, host, step, actor=state.actor)
    emit({"digest": d, "host": host, "step": step},
         lambda: console.print(f"{short(d)}: {host} {step}"))
