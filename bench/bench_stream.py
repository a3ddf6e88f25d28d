"""Peak memory and CPU of `servelab replay`, streamed (--stream) against another checkout in memory.

Usage: .venv/bin/python bench/bench_stream.py --main ROOT [--requests 1000000] [--rounds 2] [--replicas 8]
           [--modes main,stream] [--trace PATH] [--keep DIR]
where ROOT is a directory holding a ``servelab`` package (e.g. ``servelab -> /path/to/main``, or main's
commit unpacked into ROOT/servelab), put first on ``PYTHONPATH`` for its runs. The trace is
bench_replay.py's ``1m`` workload (gamma CV 2 at 40 req/s, lognormal prompt 800 / output 200,
seed 7) with ``--requests`` rows, generated once into an .arrow file (its generation's peak is
printed too: the generator builds the whole table). Each round runs every mode once in a fresh
process, in turn (ABAB), the whole `servelab replay TRACE -o DIR --no-report --replicas N` command:

- ``main``: ROOT's servelab, in memory;
- ``memory``: this checkout, in memory;
- ``stream``: this checkout, ``--stream``.

Per run it prints the peak resident memory (``ru_maxrss`` of that process, from ``wait4``), its CPU
seconds (user + system: less sensitive to a loaded machine than the wall time) and wall seconds; then
the medians per mode, and whether each mode's requests.parquet and steps.parquet hold the same
table as the first mode's (and the same bytes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # this checkout

GENERATE = r"""
import resource, sys
from servelab.traces.io import write_trace
from servelab.traces.synth import synth_trace
n, path = int(sys.argv[1]), sys.argv[2]
trace = synth_trace(n=n, rate=40.0, arrival="gamma", cv=2.0, prompt="lognormal:800:1.0", output="lognormal:200:1.0", seed=7)
write_trace(trace, path, "bench_stream: bench_replay.py's 1m workload")
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""

CLI = "import sys; from servelab.cli.main import main; sys.argv[0] = 'servelab'; main()"


def _root_of_this_checkout(tmp: Path) -> str:
    root = tmp / "here"
    root.mkdir()
    (root / "servelab").symlink_to(HERE)
    return str(root)


def measure(root: str, args: list[str]) -> tuple[float, float, float]:
    """(peak RSS MiB, CPU s, wall s) of ``servelab ARGS`` with ``root`` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=root)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CLI, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read()
    if proc.returncode:
        raise SystemExit(f"servelab {' '.join(args)} failed ({proc.returncode}):\n{err}")
    if "--stream" in args and "not streaming" in err:
        raise SystemExit(f"the streamed run was not streamed:\n{err}")
    return usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime, wall


SAME = r"""
import sys
from pathlib import Path
import pyarrow.parquet as pq
a, b = Path(sys.argv[1]), Path(sys.argv[2])
out = []
for name in ("requests.parquet", "steps.parquet"):
    tables = pq.read_table(a / name).equals(pq.read_table(b / name))
    data = (a / name).read_bytes() == (b / name).read_bytes()
    out.append(f"{name.split('.')[0]}: table {'same' if tables else 'DIFFERENT'}, bytes {'same' if data else 'differ'}")
print("; ".join(out))
"""


def same(a: Path, b: Path, root: str) -> str:
    """Whether two runs hold the same tables and bytes: read in a child process. The tables must not
    grow this process: a child's peak memory (``ru_maxrss``) counts its parent's high-water mark at the
    moment it is started (Linux folds the old address space's into it at ``exec``, and Python starts
    children with ``vfork``)."""
    return subprocess.run([sys.executable, "-c", SAME, str(a), str(b)], check=True, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=root)).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main", required=True, help="a directory holding the servelab package to compare with")
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--modes", default="main,stream", help="of main, memory, stream; in this order each round")
    parser.add_argument("--trace", help="an existing trace file (else generated)")
    parser.add_argument("--keep", help="a directory for the trace and runs (default: a temporary one, removed)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(dir=args.keep) as tmp_name:
        tmp = Path(tmp_name)
        here = _root_of_this_checkout(tmp)
        roots = {"main": args.main, "memory": here, "stream": here}
        trace = args.trace
        if trace is None:
            trace = str(tmp / f"synth{args.requests}.arrow")
            start = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", GENERATE, str(args.requests), trace], check=True,
                                 env=dict(os.environ, PYTHONPATH=here), capture_output=True, text=True).stdout
            print(f"generated {args.requests:,} requests in {time.perf_counter() - start:.0f} s, "
                  f"peak {float(out):.0f} MiB (synth_trace builds the whole table)", flush=True)
        results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for round_ in range(args.rounds):
            for mode in modes:
                run_dir = tmp / f"{mode}{round_}"
                cmd = ["replay", trace, "-o", str(run_dir), "--no-report", "--replicas", str(args.replicas)]
                if mode == "stream":
                    cmd.append("--stream")
                peak, cpu, wall = measure(roots[mode], cmd)
                results[mode].append((peak, cpu, wall))
                print(f"round {round_ + 1} {mode:6s}: peak {peak:7.0f} MiB  CPU {cpu:7.2f} s  wall {wall:7.2f} s", flush=True)
                if round_ == 0 and mode != modes[0]:
                    print(f"  {mode} vs {modes[0]}: {same(tmp / f'{modes[0]}0', run_dir, here)}", flush=True)
                if round_:  # (the first round's runs are kept for the comparison)
                    import shutil

                    shutil.rmtree(run_dir)
        print(f"medians over {args.rounds} rounds, {args.requests:,} requests, {args.replicas} replicas:")
        for mode in modes:
            peak, cpu, wall = (statistics.median(r[i] for r in results[mode]) for i in range(3))
            print(f"  {mode:6s}: peak {peak:7.0f} MiB  CPU {cpu:7.2f} s  wall {wall:7.2f} s")


if __name__ == "__main__":
    main()
