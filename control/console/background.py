"""The console beside a running deployment (``loraplane serve --console-port``): served from a
thread of its own, with its own event loop, on its own port (loopback by default), never on the
tenant-facing gateway's."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from control.console.app import Console
from control.contracts.config import Settings
from projections.follower import open_registry


def serve_in_thread(settings: Settings, *, port: int, actor: str,
                    host: str = "127.0.0.1", timeout_s: float = 30.0) -> threading.Thread:
    """Start the console on ``host:port`` in a daemon thread; return once it listens (raises
    the start's error if it could not, e.g. the port is taken)."""
    console = Console(open_registry(settings), actor=actor)
    started = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def start() -> None:
            runner = web.AppRunner(console.app())
            await runner.setup()
            await web.TCPSite(runner, host, port).start()

        try:
            loop.run_until_complete(start())
        except BaseException as e:  # reported to the starting thread
            failed.append(e)
            started.set()
            return
        started.set()
        loop.run_forever()

    t = threading.Thread(target=run, name="console", daemon=True)
    t.start()
    if not started.wait(timeout_s):
        raise RuntimeError(f"the console did not start on {host}:{port} in {timeout_s:g} s")
    if failed:
        raise RuntimeError(f"the console could not listen on {host}:{port}: {failed[0]}")
    return t
