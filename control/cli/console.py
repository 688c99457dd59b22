"""CLI verbs of the operator console (``control.console``).

``loraplane console [--host 127.0.0.1] [--port 8091]``  serve the console (loopback by default)
``loraplane console token [--rotate]``                  print (or replace) the console token
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from typing import Annotated

import typer

from control.cli.base import app, console, emit, err_console, errors, registry, settings, state

console_app = typer.Typer(
    invoke_without_command=True,
    help="The operator console in the browser (serves it; `console token` prints its token).")
app.add_typer(console_app, name="console")

DEFAULT_PORT = 8091


@console_app.callback()
def console_serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(
        help="Address to bind (loopback by default: put a TLS proxy in front to share it).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = DEFAULT_PORT,
) -> None:
    """Serve the operator console until interrupted (log in with `loraplane console token`)."""
    if ctx.invoked_subcommand is not None:
        return
    # aiohttp, Jinja2 and the registry: only when the console runs
    from aiohttp import web

    from control.console.access import token_path
    from control.console.app import Console

    with errors():
        c = Console(registry(existing=True), actor=state.actor)
    err_console.print(f"operator console on http://{host}:{port}/ ; log in with the token in "
                      f"{token_path(c.reg.settings.home)} (`loraplane console token`)")
    web.run_app(c.app(), host=host, port=port, print=None)


@console_app.command("token")
def console_token(
    rotate: Annotated[bool, typer.Option(
        "--rotate", help="Replace the token: every console session ends.")] = False,
) -> None:
    """Print the console token (made on first use, 0600 under the home); --rotate replaces it."""
    # the console package (aiohttp, Jinja2 behind it): only the console verbs load it
    from control.console.access import load_or_create_token, rotate_token, token_path

    home = settings().home
    token = rotate_token(home) if rotate else load_or_create_token(home)
    emit({"token": token, "path": str(token_path(home)), "rotated": rotate},
         lambda: console.print(token, highlight=False, soft_wrap=True))
