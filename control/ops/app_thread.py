"""An aiohttp application served on a thread of its own, with its own event loop: the gateway
of ``serve`` and each Triton host's OpenAI route run this way beside the deployment's other
threads, and stop with it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from control.contracts.loops import new_event_loop

if TYPE_CHECKING:  # aiohttp: only a deployment that serves HTTP itself pays for it
    from aiohttp import web


@dataclass
class AppThread:
    name: str
    make: Callable[[], web.Application]  # called on the thread, inside its loop
    host: str
    port: int
    thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)

    def start(self, timeout_s: float = 30.0) -> None:
        """Serve on ``host:port``; raises RuntimeError (naming this server) when it fails to
        listen within ``timeout_s``."""
        from aiohttp import web

        started = threading.Event()
        errors: list[BaseException] = []

        def serve() -> None:
            loop = new_event_loop()
            asyncio.set_event_loop(loop)
            runner = web.AppRunner(self.make(), access_log=None)
            try:
                loop.run_until_complete(runner.setup())
                loop.run_until_complete(web.TCPSite(runner, self.host, self.port).start())
            except BaseException as e:  # reported to the starting thread
                errors.append(e)
                started.set()
                return
            self._loop = loop
            started.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self.thread = threading.Thread(target=serve, name=self.name, daemon=True)
        self.thread.start()
        started.wait(timeout_s)
        if errors:
            raise RuntimeError(f"{self.name} failed to start: {errors[0]}")

    @property
    def running(self) -> bool:
        return self._loop is not None

    def stop(self) -> None:
        """Stop serving (from any thread); stopping again changes nothing."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)
