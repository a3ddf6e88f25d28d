"""A real `servelab serve` application on a free local port, run in a thread with its own event loop."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

from aiohttp import web

from servelab.replay.config import ReplayConfig
from servelab.serve.app import make_app
from servelab.serve.prompts import PromptCounter
from servelab.serve.sim import Simulation


@contextmanager
def serving(port: int, config: ReplayConfig | None = None, time_scale: float = 1.0, model: str = "sim",
            tokenizer: str | None = None):
    """Yield the base URL of a server for ``config`` (default: one roofline replica) until the block ends."""
    config = config or ReplayConfig.from_dict({}, source="test")
    sim = Simulation(config, time_scale)
    app = make_app(sim, model, PromptCounter(tokenizer))
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
