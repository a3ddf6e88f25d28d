"""When a runner spec is parsed (issue #27 item 3): a 2-pool cluster of 8 replicas (4 prefill on an
A100, 4 decode on an H100, so 2 runners built) read from TOML and replayed, counting the
``str.split`` / ``str.partition`` calls made from runners/ files and replay/core/runner_spec.py (a spec
split into its keys), while reading and while replaying; then whether a bad runner value in the TOML
file fails when the config is read. Runs on main's code as well (no new name imported).

    .venv/bin/python bench/runner_spec_typing.py
"""
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers_cli import PD_8_REPLICAS_TOML, write_small_trace  # noqa: E402
from helpers_engine import string_splits  # noqa: E402
from servelab.api import replay  # noqa: E402
from servelab.common.errors import ServelabError  # noqa: E402
from servelab.replay.config import ReplayConfig  # noqa: E402
from servelab.traces.io import read_trace  # noqa: E402

TOML = PD_8_REPLICAS_TOML
HERE = {ROOT / "runners", ROOT / "replay" / "core" / "runner_spec.py"}


def splits(run):
    calls, result = string_splits(run, HERE, names=("split", "partition"))
    return result, calls


tmp = Path(tempfile.mkdtemp())
(tmp / "c.toml").write_text(TOML)
trace = read_trace(write_small_trace(tmp))
config, read_calls = splits(lambda: ReplayConfig.from_toml(tmp / "c.toml"))
result, replay_calls = splits(lambda: replay(trace, config))
replicas = sum(len(p["replicas"]) for p in result.meta["cluster"]["pools"])
print(f"read:   spec string splits {len(read_calls)} {sorted(set(read_calls))}")
print(f"replay: spec string splits {len(replay_calls)} {sorted(set(replay_calls))}, replicas {replicas}, "
      f"finished {result.meta['counts']['finished']}")
(tmp / "bad.toml").write_text('runner = "linear:base=abc"\nnum_gpu_blocks = 100\n')
try:
    ReplayConfig.from_toml(tmp / "bad.toml")
    print("bad value: the config was read without an error (it fails when the runner is built)")
except ServelabError as err:
    print(f"bad value: refused when read: {str(err).replace(str(tmp), 'TMP')}")
