"""A link that carries KV between pools: transfers in flight share its bandwidth equally.

A transfer of ``B`` bytes on a link of bandwidth ``W`` alone takes ``B / W`` seconds plus the
link's latency. While ``n`` transfers are in flight each moves at ``W / n`` (processor sharing:
two equal transfers started together both end after ``2B / W``). The link keeps each transfer's
bytes still to move and one pending event, the next time a transfer's last byte arrives; the
events are the engine's ``TIMER`` events (a function of the time), and a stale one (the set of
transfers changed since it was pushed) is ignored. Cost per transfer start or end: O(transfers
in flight on the link).

A transfer may be cancelled (``cancel``: an end of it lost its KV, replay/cluster/disagg.py): it leaves the
link at once and the others share the bandwidth from then on; its bytes moved so far are not counted
in ``bytes_moved`` (the bytes of transfers that arrived).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Transfer:
    __slots__ = ("bytes", "left", "payload", "start_s")

    def __init__(self, payload: Any, num_bytes: float, start_s: float):
        self.payload = payload
        self.bytes = num_bytes
        self.left = float(num_bytes)
        self.start_s = start_s


class Link:
    """``push(time_s, fn)`` schedules ``fn(time_s)`` (the engine enacts what it returns); ``done(transfer,
    time_s)`` is called when a transfer has arrived (its last byte plus the latency) and returns a list
    (the intents of its arrival)."""

    def __init__(self, bytes_per_s: float, latency_s: float, push: Callable, done: Callable):
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self.push = push
        self.done = done
        self.active: list[Transfer] = []
        self.last_s = 0.0
        self.token = 0  # identifies the pending event; older ones are stale
        self.bytes_moved = 0.0
        self.busy_s = 0.0  # time with at least one transfer in flight

    def start(self, payload: Any, num_bytes: float, now: float) -> Transfer:
        self._advance(now)
        transfer = Transfer(payload, num_bytes, now)
        self.active.append(transfer)
        self._plan(now)
        return transfer

    def cancel(self, which: Callable[[Any], bool], now: float) -> bool:
        """Take the transfer whose payload ``which`` picks off the link at ``now`` (True), if it is still
        moving bytes (False: not on the link, or only its latency is left: the caller ignores its arrival)."""
        for t in self.active:
            if which(t.payload):
                self._advance(now)
                self.active.remove(t)
                self._plan(now)
                return True
        return False

    def _advance(self, now: float) -> None:
        """Move every transfer in flight forward to ``now``."""
        active = self.active
        dt = now - self.last_s
        if active and dt > 0:
            share = dt * self.bytes_per_s / len(active)
            for t in active:
                t.left -= share
            self.busy_s += dt
        self.last_s = now

    def _plan(self, now: float) -> None:
        self.token += 1
        if not self.active:
            return
        first = min(t.left for t in self.active)
        token = self.token
        at = now + max(first, 0.0) * len(self.active) / self.bytes_per_s
        self.push(at, lambda time_s: self._arrive(token, time_s))

    def _arrive(self, token: int, now: float) -> list:
        """The event planned for the next arrival: the transfers in (``done`` called, its results returned
        together to the engine when there is no latency: intents, replay/core/intents.py)."""
        if token != self.token:
            return []
        self._advance(now)
        # This event was planned for the transfers with the fewest bytes left (nothing changed since,
        # or its token would be stale): they are in, whatever rounding left of them — late in a long
        # replay ``now + tiny`` can round back to ``now`` and the bytes would never reach zero. Others
        # within a billionth of their size of the same end land with them.
        first = min(t.left for t in self.active)
        due = [t.left <= first + 1e-9 * max(t.bytes, 1.0) for t in self.active]
        landed = [t for t, d in zip(self.active, due) if d]
        self.active = [t for t, d in zip(self.active, due) if not d]
        self._plan(now)
        out = []
        for t in landed:
            self.bytes_moved += t.bytes
            if self.latency_s:
                self.push(now + self.latency_s, lambda time_s, t=t: self.done(t, time_s))
            else:
                out += self.done(t, now)
        return out


__all__ = ["Link", "Transfer"]
