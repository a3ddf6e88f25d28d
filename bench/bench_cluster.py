"""DistServe's result in both directions, on synthetic workloads (docs/cluster.md).

For each workload, the highest arrival rate (on a grid) at which at least 90 % of requests meet
both SLOs, per GPU (DistServe's "per-GPU goodput"), for colocated replicas and for a prefill/decode
split on the same GPUs; and, at low load, goodput per GPU of the smallest deployment of each
(1 colocated replica vs 1 prefill + 1 decode). Roofline runner, Llama-3.1-8B on H100-80GB, sarathi.

Usage: .venv/bin/python bench/bench_cluster.py [--n 1500]
"""

from __future__ import annotations

import argparse
import time

WORKLOADS = {
    # long prompts, tight TPOT: prefill chunks in colocated batches stretch every decode step
    "long prompts, TPOT <= 25 ms": dict(prompt="lognormal:3000:0.5", output="lognormal:250:0.5",
                                        slo="ttft=3,tpot=0.025"),
    # short prompts: little prefill to interfere with, so splitting only divides the decode capacity
    "short prompts, TPOT <= 100 ms": dict(prompt="lognormal:200:0.5", output="lognormal:200:0.5",
                                          slo="ttft=1,tpot=0.1"),
}
LINK = {"bandwidth_gbps": 50.0, "latency_s": 0.0005}
RATES = (0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)


def config(kind: str):
    from servelab.api import ReplayConfig

    if kind == "colocated x1":
        return ReplayConfig.from_dict({"replicas": 1}), 1
    if kind == "colocated x2":
        return ReplayConfig.from_dict({"replicas": 2, "router": "least-outstanding"}), 2
    prefill, decode = {"1P+1D": (1, 1)}[kind]
    return ReplayConfig.from_dict({"cluster": {
        "pools": [{"name": "p", "role": "prefill", "replicas": prefill},
                  {"name": "d", "role": "decode", "replicas": decode, "router": "least-outstanding"}],
        "links": [dict(LINK, **{"from": "p", "to": "d"})]}}), prefill + decode


def attainment(workload: dict, kind: str, rate: float, n: int, scorer) -> dict:
    from servelab.api import replay
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=n, rate=rate, arrival="poisson", prompt=workload["prompt"], output=workload["output"], seed=11)
    cfg, gpus = config(kind)
    score = scorer.score(replay(trace, cfg))
    return dict(score, gpus=gpus)


def main() -> None:
    from servelab.scoring.slo import SloTable
    from servelab.search.scorer import RunScorer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1500, help="requests per replay")
    args = parser.parse_args()
    t0 = time.perf_counter()
    for name, workload in WORKLOADS.items():
        scorer = RunScorer(SloTable.parse_cli([workload["slo"]]))
        print(f"## {name} (prompt {workload['prompt']}, output {workload['output']}, SLO {workload['slo']})")
        for kind in ("colocated x2", "1P+1D"):
            best = None
            for rate in RATES:
                s = attainment(workload, kind, rate, args.n, scorer)
                if s["attainment"] < 0.9:
                    break
                best = (rate, s)
            if best is None:
                print(f"{kind}: below 90 % attainment even at {RATES[0]} req/s")
                continue
            rate, s = best
            print(f"{kind}: {s['gpus']} GPUs; highest rate with >= 90 % attainment {rate} req/s "
                  f"(attainment {s['attainment']:.3f}, TTFT p90 {s['ttft_p90']:.3f} s, TPOT p90 {s['tpot_p90']:.4f} s) "
                  f"-> {rate / s['gpus']:.2f} req/s per GPU")
        low = 0.5
        for kind in ("colocated x1", "1P+1D"):
            s = attainment(workload, kind, low, args.n, scorer)
            print(f"low load {low} req/s, {kind}: attainment {s['attainment']:.3f}, "
                  f"goodput {s['goodput_rps']:.3f} req/s = {s['goodput_rps'] / s['gpus']:.3f} per GPU "
                  f"(TTFT p90 {s['ttft_p90']:.3f} s, TPOT p90 {s['tpot_p90']:.4f} s)")
        scorer.close()
    print(f"(wall {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
