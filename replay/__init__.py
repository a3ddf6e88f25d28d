"""Iteration-level discrete-event replay of a trace through an inference engine model."""

from servelab.replay.api import RunResult, replay, requests_from_table, write_run
from servelab.replay.config import EngineConfig, ReplayConfig

__all__ = ["EngineConfig", "ReplayConfig", "RunResult", "replay", "requests_from_table", "write_run"]
