"""``loraplane key root init``: the offline root key that vouches for ticket-signing keys
(``control.contracts.root_of_trust``). Also reachable as ``loraplane keys root init``.

The private key goes to the file named by ``--out``, which the operator then keeps offline and
passes back as ``--root-key FILE`` to ``key rotate`` and ``key retire``; its public half goes to
``<home>/keys/root.pub``, which hosts and gateways sharing the home read (others take it from
``LORAPLANE_ROOT_PUBKEY``).
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from pathlib import Path
from typing import Annotated

import typer

from control.cli.base import app, console, emit, errors, key_app, settings

root_app = typer.Typer(no_args_is_help=True,
                       help="The offline root key that vouches for ticket-signing keys.")
key_app.add_typer(root_app, name="root")
# `loraplane keys ...` reads as naturally as `key`: the same verbs, not listed twice.
app.add_typer(key_app, name="keys", hidden=True)


@root_app.command("init")
def root_init(
    out: Annotated[Path, typer.Option(
        "--out", help="File to write the root PRIVATE key to (0600; never overwritten). Keep "
        "it offline.")],
) -> None:
    """Make the root key: private half to --out, public half to <home>/keys/root.pub. Keys the
    former root vouched for are no longer trusted: run `key rotate --root-key FILE` next."""
    # the key files (cryptography): only this verb
    from control.contracts.root_of_trust import ROOT_ENV, init_root

    with errors():
        made = init_root(out, settings().keys_dir)
    emit({"private_key": str(made.private_path), "public_key_file": str(made.public_path),
          "public_key": made.public_b64},
         lambda: console.print(
             f"root private key -> {made.private_path} (keep it offline)\n"
             f"root public key  -> {made.public_path}: {made.public_b64}\n"
             f"hosts and gateways on other machines: {ROOT_ENV}={made.public_b64}\n"
             "next: loraplane key rotate --root-key " + str(made.private_path)))
