"""Iteration-level discrete-event replay of a trace through an inference engine model.

The engine and its contracts, in one folder per layer, bottom first: ``core/`` (the event loop, the
request, batch, step, the protocols; ``core/kv/`` the KV cache), then ``cluster/`` (pools, the
prefill/decode handoff, autoscaling, instance types) and ``platform/`` (front door, pausing,
failures) beside each other, and here the assembly: a whole replay's config and results
(docs/engine.md "Layers and one owner"). To assemble and run a replay from a config, use
``servelab.api``.
The result names (``RunResult``, ``requests_from_table``, ``write_run``) are loaded on first use:
they bring numpy and pyarrow, which a config, ``--help`` or a bad option need not wait for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from servelab.replay.config import EngineConfig, ReplayConfig

if TYPE_CHECKING:
    from servelab.replay.results import RunResult, requests_from_table, write_run

__all__ = ["EngineConfig", "ReplayConfig", "RunResult", "requests_from_table", "write_run"]
_RESULTS = ("RunResult", "requests_from_table", "write_run")


def __getattr__(name: str):
    if name in _RESULTS:
        from servelab.replay import results

        return getattr(results, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
