"""Helpers for the live client's tests (tests/test_live_client.py, tests/test_live_sagemaker.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


async def send_or_cancel(send: Coroutine, cancel_after: float | None) -> None:
    """Run ``send`` (one request's send, which fills its ``Record``) to its end or, with
    ``cancel_after`` seconds, cancel it then, as a benchmark's stop does; the cancellation is
    swallowed, so the caller looks at the record it left."""
    task = asyncio.create_task(send)
    if cancel_after is not None:
        await asyncio.sleep(cancel_after)
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
