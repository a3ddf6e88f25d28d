"""The asyncio event loop a command runs on: ``auto`` (uvloop when it is installed, else asyncio's own),
``uvloop`` (an error when it is not installed) or ``asyncio``."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable

from servelab.common.errors import ServelabError

LOOPS = ("auto", "uvloop", "asyncio")


def uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve_loop(name: str) -> str:
    """The loop ``name`` stands for: ``uvloop`` or ``asyncio``."""
    if name not in LOOPS:
        raise ServelabError(f"unknown event loop {name!r}: choose one of {', '.join(LOOPS)}")
    if name == "auto":
        return "uvloop" if uvloop_installed() else "asyncio"
    if name == "uvloop" and not uvloop_installed():
        raise ServelabError("--loop uvloop: uvloop is not installed (pip install 'servelab[fast]', or "
                            "pip install uvloop); --loop auto falls back to asyncio's own loop")
    return name


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of new event loops of the kind ``name`` resolves to (for ``asyncio.Runner``)."""
    if resolve_loop(name) == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(coro, loop: str = "auto"):
    """``asyncio.run(coro)`` on the event loop ``loop`` names."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(coro)
