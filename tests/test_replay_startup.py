"""A replay's start-up imports only what it uses (issue 17): no heavy package on the replay path, and
neither pyarrow.compute nor pyarrow.parquet before the engine's first event for a canonical .arrow
trace. Each check runs in a fresh interpreter and reads its ``sys.modules``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO
from helpers_cli import write_small_trace
from servelab.common.errors import ServelabError
from servelab.common.registry import ClassRegistry

def _bench_startup():
    """bench/bench_startup.py as a module: its child program (an import hook that wraps Engine.run as
    servelab.replay.core.engine loads, so the import order is the CLI's own) and its list of heavy packages."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_startup", REPO / "bench" / "bench_startup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench_startup()
HEAVY = BENCH.HEAVY


def _modules_of(args: list[str], cwd) -> dict[str, set[str]]:
    """The modules `servelab ARGS` has loaded when Engine.run is entered ("first-event") and at exit."""
    proc = subprocess.run([sys.executable, "-c", BENCH.CHILD, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, check=True, env={**os.environ, "BENCH_MODULES": "1"})
    out = {}
    for line in proc.stderr.splitlines():
        if line.startswith(("@@first-event ", "@@exit ")):
            name, *fields = line.split(" ")
            skip = 2 if name == "@@first-event" else 1  # (wall and CPU time, or CPU time)
            out[name[2:]] = set(fields[skip:]) - {""}
    return out


def _top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def test_a_replay_imports_nothing_heavy_and_no_pyarrow_compute_or_parquet_before_its_first_event(tmp_path):
    trace = write_small_trace(tmp_path)
    seen = _modules_of(["replay", trace, "--replicas", "2", "-o", tmp_path / "run", "--no-report"], tmp_path)
    assert (tmp_path / "run" / "requests.parquet").is_file()  # it did replay and write
    first, end = seen["first-event"], seen["exit"]
    assert "servelab.replay.core.engine" in first and "pyarrow" in first  # the hook saw the real replay
    assert not _top_level(first) & set(HEAVY), _top_level(first) & set(HEAVY)
    assert not {"pyarrow.compute", "pyarrow.parquet"} & first, {"pyarrow.compute", "pyarrow.parquet"} & first
    # writing the run needs Parquet's writer (pyarrow._parquet, not pyarrow.parquet: common/parquet_out.py),
    # and nothing heavy either
    assert "pyarrow._parquet" in end and "pyarrow.parquet" not in end
    assert not _top_level(end) & set(HEAVY), _top_level(end) & set(HEAVY)


def _imported_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_the_replay_configs_and_replay_help_import_neither_numpy_nor_pyarrow():
    mods = _imported_after("from servelab.replay import EngineConfig, ReplayConfig\n"
                           "ReplayConfig(engine=EngineConfig(replicas=2))")
    assert not {"numpy", "pyarrow"} & mods
    mods = _imported_after("from servelab.cli.main import main\n"
                           "try:\n    main(['replay', '--help'])\nexcept SystemExit:\n    pass")
    assert "servelab.cli.replay_cmd" in mods and not {"numpy", "pyarrow"} & mods


def test_the_replay_package_still_exports_its_results_api():
    from servelab import replay
    from servelab.replay import RunResult, requests_from_table, results, write_run

    assert (RunResult, requests_from_table, write_run) == (results.RunResult, results.requests_from_table,
                                                           results.write_run)
    assert set(replay.__all__) <= set(dir(replay)) | {"RunResult", "requests_from_table", "write_run"}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        replay.nothing  # noqa: B018


def test_a_runner_spec_imports_only_its_own_runner_module():
    mods = _imported_after("from servelab.runners.base import make_runner\n"
                           "make_runner('linear:base=0.01,prefill_token=1e-5')")
    assert "servelab.runners.linear" in mods
    assert not {"servelab.runners.roofline", "servelab.runners.fitted", "servelab.runners.torch_runner"} & mods


def test_an_unknown_runner_still_lists_every_runner():
    from servelab.runners.base import make_runner

    with pytest.raises(ServelabError) as err:
        make_runner("nosuch")
    assert "known: fitted, linear, roofline, torch" in str(err.value)


class _Entry:
    def __init__(self, registry: ClassRegistry, name: str):
        self.registry, self.name = registry, name
        self.loaded = 0

    def load(self):
        self.loaded += 1
        self.registry.register(self.name)(type("Plugin", (), {}))


def test_plugins_load_only_for_a_name_the_package_lacks_or_a_listing(monkeypatch):
    registry = ClassRegistry("thing", package="servelab.routers")  # its modules are imported already
    registry.register("builtin")(type("Builtin", (), {}))
    entry = _Entry(registry, "plugin")
    scans = []

    def entry_points(group):
        scans.append(group)
        return [entry]

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
    assert registry.get("builtin").name == "builtin" and "builtin" in registry
    assert scans == []  # a built-in name: no scan of the installed packages
    assert registry.get("plugin").name == "plugin"
    assert scans == ["servelab.routers"] and entry.loaded == 1
    assert registry.names() == ["builtin", "plugin"] and "plugin" in registry
    assert scans == ["servelab.routers"] and entry.loaded == 1  # scanned once
    with pytest.raises(ServelabError, match="unknown thing 'other'"):
        registry.get("other")


def test_a_listing_loads_the_plugins(monkeypatch):
    registry = ClassRegistry("thing", package="servelab.routers")
    entry = _Entry(registry, "plugin")
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [entry])
    assert registry.names() == ["plugin"]


def test_the_bench_script_runs(tmp_path):
    """bench/bench_startup.py times a real replay's first event (one run, a small trace)."""
    trace = write_small_trace(tmp_path)
    out = subprocess.run([sys.executable, str(REPO / "bench" / "bench_startup.py"), "--repeat", "1", "--modules",
                          "--", "replay", str(trace), "--no-report"], capture_output=True, text=True, check=True).stdout
    assert "start -> first event, CPU" in out and "heavy packages imported by the first event: none" in out
