"""A replay's start-up: from process start to the engine's first event, and the whole process.

Usage: .venv/bin/python bench/bench_startup.py [--repeat 5] [--modules] [--compare ROOT] [--instructions] [-- REPLAY ARGS...]
Default replay: ``servelab replay data/azure_conv_2023.arrow --replicas 6 -o TMP --no-report``
(the bundled trace, roofline Llama-3.1-8B on H100, sarathi). Each run is a fresh process, timed
from just before it is started (fork + exec + interpreter start-up count) to:

- first event: when ``Engine.run`` is entered (imports, option and config checks, reading and
  validating the trace, building requests and replicas are all before it), as wall seconds and as
  the child's CPU seconds (``time.process_time``, less noisy on a shared machine);
- exit: the whole process (replay, result tables, writing the run directory), wall and CPU; and the
  CPU seconds from ``Engine.run``'s return to exit (building the result tables, writing the run
  directory, interpreter shutdown), alone and as a share of the process's.

``Engine.run`` is timed through an import hook that wraps it as ``servelab.replay.core.engine`` loads, so
the child imports exactly what ``servelab replay`` imports. ``--modules`` lists the top-level packages
and pyarrow's modules imported by the first event (and the heavy ones: polars, duckdb, optuna,
matplotlib, scipy, rich, torch, pandas).
``--compare ROOT`` also runs another checkout (ROOT holds a ``servelab`` package, e.g. ``git archive``
of main's commit unpacked into ROOT/servelab; put first on ``PYTHONPATH`` for its runs), interleaved
with this one (A B, then B A, ...; give the replay's paths absolute), and prints both sides' figures: an A/B in one run on a shared machine.
The child may write ``__pycache__`` (``PYTHONDONTWRITEBYTECODE`` is dropped from its environment), as
an installed servelab has compiled modules; one warm-up run precedes the timed ones.
``--instructions`` also counts the instructions of the plain command (``python -m servelab ARGS``, no
hook), per side, and of the floor (``python -c "import numpy, pyarrow, pyarrow.ipc, click"``, what any
command that reads a trace imports) under valgrind's cachegrind, with the hash seed and address
randomisation fixed and one OpenBLAS thread: figures that do not depend on the machine's load (three
runs agreed to 0.2%).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("polars", "duckdb", "optuna", "matplotlib", "scipy", "rich", "torch", "pandas")

# Run in the child: wrap Engine.run when servelab.replay.core.engine is loaded, then run the CLI.
CHILD = r"""
import os, sys, time
MARK = "@@first-event"

class _Hook:
    def find_spec(self, name, path, target=None):
        if name != "servelab.replay.core.engine":
            return None
        sys.meta_path.remove(self)
        spec = next(s for s in (f.find_spec(name, path, target) for f in sys.meta_path if hasattr(f, "find_spec")) if s)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            run = module.Engine.run

            def timed_run(engine, *args, **kwargs):
                wall, cpu = time.time(), time.process_time()
                mods = sorted(sys.modules) if os.environ.get("BENCH_MODULES") else []
                sys.stderr.write(f"{MARK} {wall!r} {cpu!r} {' '.join(mods)}\n")
                try:
                    return run(engine, *args, **kwargs)
                finally:
                    sys.stderr.write(f"@@last-event {time.process_time()!r}\n")

            module.Engine.run = timed_run

        spec.loader.exec_module = exec_and_wrap
        return spec

sys.meta_path.insert(0, _Hook())
from servelab.cli.main import main
try:
    main()  # as the console command runs it (sys.argv: this script's, then the command's arguments)
finally:
    mods = sorted(sys.modules) if os.environ.get("BENCH_MODULES") else []
    sys.stderr.write(f"@@exit {time.process_time()!r} {' '.join(mods)}\n")
"""


FLOOR = "import numpy, pyarrow, pyarrow.ipc, click"


def _env(root: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if root is not None:  # the other checkout's servelab first on the path
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def instructions(command: list[str], root: str | None = None) -> int:
    """Instructions the whole process ``python COMMAND`` executes (all threads), counted by cachegrind."""
    # (one OpenBLAS thread: its idle threads spin, counted, and made the figure vary by ~4% run to run)
    env = dict(_env(root), PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(["setarch", platform.machine(), "-R", "valgrind", "--tool=cachegrind", "--cache-sim=no",
                           "--cachegrind-out-file=/dev/null", sys.executable, *command],
                          capture_output=True, text=True, env=env, check=False, cwd=tempfile.gettempdir())
    match = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    if proc.returncode != 0 or match is None:
        sys.exit(f"valgrind python {' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def one_run(args: list[str], modules: bool, root: str | None = None) -> dict:
    env = _env(root)
    if modules:
        env["BENCH_MODULES"] = "1"
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, env=env, check=False,
                          cwd=tempfile.gettempdir() if root else None)  # (a servelab/ in the cwd would shadow ROOT's)
    end = time.time()
    if proc.returncode != 0:
        sys.exit(f"replay failed ({proc.returncode}):\n{proc.stderr}")
    first = next(line for line in proc.stderr.splitlines() if line.startswith("@@first-event"))
    _, wall, cpu, *mods = first.split(" ")
    exit_cpu = next(line for line in proc.stderr.splitlines() if line.startswith("@@exit")).split(" ")[1]
    last_cpu = next(line for line in proc.stderr.splitlines() if line.startswith("@@last-event")).split(" ")[1]
    return {"first_wall": float(wall) - start, "first_cpu": float(cpu), "wall": end - start,
            "cpu": float(exit_cpu), "after_cpu": float(exit_cpu) - float(last_cpu), "modules": mods}


def _summary(runs: list[dict]) -> None:
    share = statistics.median(r["after_cpu"] / r["cpu"] for r in runs)
    for key, label in (("first_wall", "start -> first event, wall"), ("first_cpu", "start -> first event, CPU"),
                       ("wall", "whole process, wall"), ("cpu", "whole process, CPU"),
                       ("after_cpu", "last event -> exit, CPU")):
        values = [r[key] for r in runs]
        print(f"{label:28s} median {statistics.median(values) * 1000:7.0f} ms  "
              f"(min {min(values) * 1000:.0f}, max {max(values) * 1000:.0f}, {len(values)} runs)")
    print(f"after the engine's last event (result tables, writing the run, exit): {share:.1%} of the process's CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--modules", action="store_true", help="list the packages imported by the first event")
    parser.add_argument("--compare", metavar="ROOT", help="also run the servelab package in ROOT, interleaved (A = ROOT, B = this checkout)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count the instructions of the plain command per side, and of the floor")
    parser.add_argument("replay_args", nargs="*", help="after --: servelab's arguments instead of the default")
    opts = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        args = opts.replay_args or ["replay", str(root / "data" / "azure_conv_2023.arrow"), "--replicas", "6",
                                    "-o", str(Path(tmp) / "run"), "--no-report", "--force"]
        sides = {"this checkout": None} if not opts.compare else {"A " + opts.compare: opts.compare, "B this checkout": None}
        for side_root in sides.values():
            one_run(args, False, side_root)  # warm-up (not counted): the OS file cache, servelab's .pyc files
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for i in range(opts.repeat):
            order = list(sides.items()) if i % 2 == 0 else list(sides.items())[::-1]
            for name, side_root in order:
                runs[name].append(one_run(args, opts.modules, side_root))
        counts = {}
        if opts.instructions:
            counts = {name: instructions(["-m", "servelab", *args], side_root) for name, side_root in sides.items()}
            counts["floor"] = instructions(["-c", FLOOR])
    print(f"servelab {' '.join(args)}")
    for name, side_runs in runs.items():
        if len(runs) > 1:
            print(f"== {name}")
        _summary(side_runs)
    for name, count in counts.items():
        print(f"instructions, {name:28s} {count / 1e6:7,.0f} M ({count / counts['floor']:.2f}x the floor)")
    runs = runs[list(sides)[-1]]
    if opts.modules:
        mods = runs[-1]["modules"]
        top = sorted({m.split(".")[0] for m in mods})
        print(f"heavy packages imported by the first event: {[m for m in HEAVY if m in top] or 'none'}")
        print(f"pyarrow modules imported by the first event: {[m for m in mods if m.startswith('pyarrow.')]}")
        print(f"modules imported by the first event: {len(mods)}, of {len(top)} top-level packages: {' '.join(top)}")


if __name__ == "__main__":
    main()
