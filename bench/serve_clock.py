"""How late `servelab serve`'s clock releases tokens: simulated time now minus each token's simulated
time, in wall milliseconds, measured in the listener the release calls (no HTTP; serve/sim.py alone).

Usage: python bench/serve_clock.py [--scale 10] [--requests 40] [--loop auto|uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

from servelab.common.loops import run as run_on
from servelab.replay.config import ReplayConfig
from servelab.serve.sim import Simulation

RUNNER = "linear:base=0.04,prefill_token=0.0004,decode_seq=0.0005"


async def run(scale: float, n: int) -> np.ndarray:
    sim = Simulation(ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": 4096}, source="bench"), scale)
    late: list[float] = []
    sim.listeners.append(lambda req, times, ended: late.extend((sim.now_s() - t) / scale for t in times))
    await sim.start()
    queues = []
    rng = np.random.default_rng(1)
    for _ in range(n):  # one request every 0.5 simulated seconds, prompts 200-600, outputs 8-24
        await asyncio.sleep(0.5 / scale)
        queues.append(sim.submit(int(rng.integers(200, 600)), int(rng.integers(8, 24)), sim.now_s())[1])
    for queue in queues:
        while not (await queue.get())[1]:
            pass
    await sim.stop()
    return np.array(late) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--loop", default="auto", help="event loop: auto, uvloop, asyncio")
    args = parser.parse_args()
    late = run_on(run(args.scale, args.requests), args.loop)
    p50, p90, p99 = np.percentile(late, [50, 90, 99])
    print(f"{late.size} tokens at x{args.scale:g} ({args.loop} loop): release lateness (wall ms) mean {late.mean():.3f}, "
          f"p50 {p50:.3f}, p90 {p90:.3f}, p99 {p99:.3f}, min {late.min():.3f}")


if __name__ == "__main__":
    main()
