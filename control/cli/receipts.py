"""CLI verbs of per-answer receipts: c2sp.org/tlog-proofs of ledger entries.

``loraplane receipt get REQUEST_ID``    the receipt of one request (its host's log entry, the
                                        inclusion proof, the verified signed checkpoint)
``loraplane receipt keys``              the host checkpoint keys the control plane recorded
``loraplane receipt verify RECEIPT --output FILE --keys KEYS``
                                        offline: nothing but the receipt, the text and the keys
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import sys
from pathlib import Path
from typing import Annotated

import typer

from control.cli.base import app, console, emit, err_console, errors, registry, state

receipt_app = typer.Typer(no_args_is_help=True,
                          help="Per-answer receipts: fetch one, verify one offline.")
app.add_typer(receipt_app, name="receipt")


@receipt_app.command("get")
def receipt_get(
    request_id: Annotated[str, typer.Argument(help="The request id the answer carried.")],
    out: Annotated[Path | None, typer.Option(help="File to write (default: stdout).")] = None,
) -> None:
    """The receipt of a request: its ledger entry, inclusion proof and signed checkpoint."""
    # the registry and the hosts' logs (eventsourcing, SQLAlchemy): only when a verb runs
    from control.app.ledger_audit import NoReceipt, receipt, sync
    from control.contracts.db import make_engine

    with errors():
        reg = registry(existing=True)
        engine = make_engine(reg.settings.db_url)
        try:
            text = receipt(reg, engine, request_id)
        except NoReceipt:
            sync(reg, engine)  # a checkpoint signed since the last sync may cover it
            try:
                text = receipt(reg, engine, request_id)
            except NoReceipt as e:
                raise ValueError(str(e)) from None
    if out is None:
        sys.stdout.write(text)
        return
    out.write_text(text, encoding="utf-8")
    emit({"request_id": request_id, "out": str(out)},
         lambda: console.print(f"receipt of {request_id} -> {out}"))


@receipt_app.command("keys")
def receipt_keys(
    out: Annotated[Path | None, typer.Option(help="File to write (default: stdout).")] = None,
) -> None:
    """The host checkpoint keys the root of trust enrolled, one verifier key a line."""
    # the registry and the hosts' logs (eventsourcing, SQLAlchemy): only when a verb runs
    from control.app.ledger_audit import load, sync, trusted_keys_of
    from control.contracts.db import make_engine
    from control.contracts.ledger_log import hosts, opened
    from control.contracts.root_of_trust import root_public_key

    with errors():
        reg = registry(existing=True)
        engine = make_engine(reg.settings.db_url)
        sync(reg, engine)
        with opened(engine).connect() as conn:
            names = hosts(conn)
        # only keys the root of trust enrolled: a key a host merely presented vouches for nothing
        root = root_public_key(reg.settings.keys_dir)
        keys = [k for h in names if (agg := load(reg, h)) is not None
                for k in trusted_keys_of(agg, root)]
    text = "".join(k + "\n" for k in keys)
    if out is None:
        sys.stdout.write(text)
        return
    out.write_text(text, encoding="utf-8")
    emit({"keys": len(keys), "out": str(out)},
         lambda: console.print(f"{len(keys)} keys -> {out}"))


@receipt_app.command("verify")
def receipt_verify(
    receipt: Annotated[Path, typer.Argument(help="The receipt file (.tlog-proof).")],
    output: Annotated[Path, typer.Option(help="The exact output text the answer carried.")],
    keys: Annotated[Path, typer.Option(
        help="Trusted verifier keys, one a line (`loraplane receipt keys`).")],
) -> None:
    """Check a receipt offline; exit 1 naming the failed check."""
    # the offline verifier (cryptography): no database, no registry
    from control.contracts.receipt import trusted_keys, verify_receipt
    from control.contracts.tlog import ProofError

    try:
        trusted = trusted_keys(keys.read_text(encoding="utf-8"))
        checked = verify_receipt(receipt.read_text(encoding="utf-8"), output.read_bytes(),
                                 trusted)
    except ProofError as e:
        if state.json:
            emit({"ok": False, "check": e.check, "error": str(e)}, lambda: None)
        else:
            err_console.print(f"[red]receipt FAILED[/red] check '{e.check}': {e}")
        raise typer.Exit(1) from None
    except OSError as e:
        err_console.print(f"[red]error[/red] {e}")
        raise typer.Exit(2) from None
    entry = checked.entry
    emit(checked.to_json(), lambda: console.print(
        f"[green]receipt verified[/green]: request {entry.get('request_id')} (tenant "
        f"{entry.get('tenant')}, adapter {entry.get('served_digest') or 'base'}) is entry "
        f"{checked.index} of {checked.tree_size} in {entry.get('host')}'s ledger log, and the "
        "output matches"))
