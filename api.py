"""servelab's Python API: assemble a replay from a config (runner, policies, router by name) and run it.

    from servelab.api import EngineConfig, ReplayConfig, replay, write_run
    result = replay(trace, ReplayConfig(engine=EngineConfig(replicas=2), policy="sarathi"))
    write_run(result, "runs/sarathi")
    replay_to("trace.parquet", config, "runs/big")  # streamed: memory holds the requests in flight only

The work is done in ``servelab.assembly`` (names become parts there: runners, policies and routers
looked up in their registries); this module is the stable surface on top of everything else, so
nothing inside the package imports it.
"""

from __future__ import annotations

from servelab.assembly import (  # noqa: F401  (build_cluster, ...: importable from here as before)
    EngineConfig, ReplayConfig, RunResult, build_cluster, build_replicas, build_runner, kv_bytes_per_token, not_streamed,
    replay, replay_to, requests_from_table, resolve_num_gpu_blocks, trace_block_tokens, write_run,
)

__all__ = ["EngineConfig", "ReplayConfig", "RunResult", "build_runner", "not_streamed", "replay", "replay_to",
           "requests_from_table", "resolve_num_gpu_blocks", "write_run"]
