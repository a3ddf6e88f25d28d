"""Iteration-level discrete-event replay of a trace through an inference engine model.

The engine and its contracts; to assemble and run a replay from a config, use ``servelab.api``.
"""

from servelab.replay.config import EngineConfig, ReplayConfig
from servelab.replay.results import RunResult, requests_from_table, write_run

__all__ = ["EngineConfig", "ReplayConfig", "RunResult", "requests_from_table", "write_run"]
