"""Packaging promises: one `servelab` namespace, and the replay path never imports torch."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True)


def test_replay_path_does_not_import_torch(tmp_path):
    proc = run_python("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now fails
        import pyarrow as pa
        import servelab
        from servelab.api import EngineConfig, ReplayConfig, replay
        from servelab.scoring import connect
        trace = pa.table({"request_id": pa.array([0, 1], pa.int64()), "arrival_s": [0.0, 0.5],
                          "prompt_tokens": pa.array([100, 50], pa.int32()),
                          "output_tokens": pa.array([20, 5], pa.int32())})
        result = replay(trace, ReplayConfig(engine=EngineConfig()))  # default roofline runner
        assert result.requests.column("status").to_pylist() == ["finished", "finished"]
        print("ok")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_only_the_servelab_namespace_is_installed(tmp_path):
    proc = run_python("""
        import importlib.util
        for name in ("search", "replay", "traces", "policies", "runners", "scoring", "live", "cli", "common"):
            assert importlib.util.find_spec(name) is None, name
        import servelab.search, servelab.replay, servelab.traces, servelab.live.bench
        print("ok")
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
