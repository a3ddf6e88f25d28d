"""Keep a vLLM CPU server's own processes off the CPUs its model worker computes on.

    python3 .ci/pin_frontend.py SERVER_PID          prints the CPUs the other processes now run on
    python3 .ci/pin_frontend.py PID --cpus 1,2      pins PID's whole process tree to those CPUs

vLLM's CPU backend binds the worker's OpenMP threads to some CPUs (VLLM_CPU_OMP_THREADS_BIND=auto
leaves one CPU for "the rest": on a 2-CPU machine the worker gets CPU 0) but lets the API server
and the engine core run anywhere, so they keep landing on the worker's CPU, where the worker also
busy-waits for work. Every decode step then waits for whichever of them the kernel ran there, and
the server's speed swings by up to 1.5x between runs of the same requests minutes apart
(bench/RESULTS_live.md, session 8). With them moved off it, the worker's CPU does only the model's
work, as a GPU would. Linux only; threads included (/proc/PID/task). Nothing is moved where the
worker is not bound (its CPUs are all CPUs) or it cannot be found.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pin(pids: list[int], cpus: set[int]) -> None:
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except OSError:  # a thread that just ended
                pass


def main() -> int:
    root = int(sys.argv[1])
    pids = descendants(root)
    if len(sys.argv) == 4 and sys.argv[2] == "--cpus":
        pin(pids, {int(c) for c in sys.argv[3].split(",")})
        return 0
    workers = [pid for pid in pids if title(pid).startswith("VLLM::Worker")]
    all_cpus = os.sched_getaffinity(0)
    rest = all_cpus - set().union(*(os.sched_getaffinity(pid) for pid in workers))
    if workers and rest:  # a bound worker: keep the rest apart from it
        pin([pid for pid in pids if pid not in workers], rest)
    print(",".join(map(str, sorted(rest if workers and rest else all_cpus))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
