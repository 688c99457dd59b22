"""The console served on 127.0.0.1 from a thread of the test process, and a logged-in client."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import requests
from aiohttp import web

from control.console.access import load_or_create_token
from control.console.app import Console


@contextmanager
def serving(console: Console) -> Iterator[str]:
    """Serve ``console`` on a free loopback port; yields its base URL; stops within seconds."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(console.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"] = runner
        box["port"] = runner.addresses[0][1]
        started.set()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()

    t = threading.Thread(target=run, name="console", daemon=True)
    t.start()
    assert started.wait(20), "the console did not start"
    try:
        yield f"http://127.0.0.1:{box['port']}"
    finally:
        asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)


def logged_in(base: str, console: Console) -> requests.Session:
    """A client holding a console session (the cookie a login sets)."""
    s = requests.Session()
    r = s.post(f"{base}/login", data={"token": load_or_create_token(console.reg.settings.home)},
               allow_redirects=False, timeout=10)
    assert r.status_code == 303, r.text
    return s


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', html)
    assert m is not None, "the page has no CSRF token"
    return m.group(1)
