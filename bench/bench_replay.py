"""Replay speed and memory: the Azure conv trace on 6 replicas, a 1 M-request synthetic trace, and
an overloaded replica whose waiting queue grows to thousands (per-policy).

Usage: .venv/bin/python bench/bench_replay.py [--skip-1m] [--repeat 3]
[--case azure|azure-disagg|azure-autoscale|azure-disagg-autoscale|1m|overload|overload15|overload200k|multiturn|quantum|vidur70b]
[--policy NAME ...]
Prints wall seconds (engine + result tables, trace already loaded), simulated events, and peak
RSS. Run each case in a fresh process for an honest peak-memory figure (``--case``).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_replays(trace, config, repeat: int):
    """The last of ``repeat`` replays of ``trace`` under ``config``, and each one's wall time."""
    from servelab.api import replay

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = replay(trace, config)
        times.append(time.perf_counter() - t0)
    return result, times


def case_azure(repeat: int) -> None:
    from servelab.api import EngineConfig, ReplayConfig
    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace

    trace = read_trace(default_trace_path())
    config = ReplayConfig(engine=EngineConfig(replicas=6))
    result, times = timed_replays(trace, config, repeat)
    iterations = sum(result.steps.column("num_iterations").to_pylist())
    print(f"azure-conv x6 replicas (roofline llama-3.1-8b/h100, sarathi): {trace.num_rows:,} requests, "
          f"{result.steps.num_rows:,} step rows for {iterations:,} iterations; "
          f"wall best {min(times):.3f} s, median {sorted(times)[len(times) // 2]:.3f} s; "
          f"peak RSS {peak_rss_mb():.0f} MB")


AZURE_DISAGG = {  # 2 prefill + 4 decode replicas, one 50 GB/s link (400 Gb/s), 0.5 ms latency
    "pools": [{"name": "prefill", "role": "prefill", "replicas": 2},
              {"name": "decode", "role": "decode", "replicas": 4, "router": "least-outstanding"}],
    "links": [{"from": "prefill", "to": "decode", "bandwidth_gbps": 50.0, "latency_s": 0.0005}],
}


def case_azure_disagg(repeat: int) -> None:
    """The azure case disaggregated: the same 6 GPUs as 2 prefill + 4 decode replicas (docs/cluster.md)."""
    from servelab.api import ReplayConfig
    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace

    trace = read_trace(default_trace_path())
    colocated = ReplayConfig.from_dict({"replicas": 6})
    disagg = ReplayConfig.from_dict({"cluster": AZURE_DISAGG})
    walls = {}
    for name, config in (("colocated x6", colocated), ("2 prefill + 4 decode", disagg)):
        result, times = timed_replays(trace, config, repeat)
        walls[name] = min(times)
        print(f"azure-conv {name}: {result.steps.num_rows:,} step rows; wall best {min(times):.3f} s, "
              f"median {sorted(times)[len(times) // 2]:.3f} s; counts {result.meta['counts']}")
    print(f"disaggregated / colocated wall: {walls['2 prefill + 4 decode'] / walls['colocated x6']:.2f}x; "
          f"peak RSS {peak_rss_mb():.0f} MB")


def case_azure_autoscale(repeat: int) -> None:
    """The azure case with an autoscaled pool of 2..6 replicas (8 running requests per replica, every 10 s,
    cooldown 60 s, start-up 30 s) and one pinned at 6 (the autoscaler's own cost: its ticks) against 6 fixed
    replicas."""
    from servelab.api import ReplayConfig
    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace

    trace = read_trace(default_trace_path())
    scaled = ReplayConfig.from_dict({"cluster": {"pools": [{"name": "web", "replicas": 2, "autoscale": {
        "min": 2, "max": 6, "signal": "running", "target": 8, "interval_s": 10, "cooldown_s": 60,
        "startup_s": 30}}]}})
    pinned = ReplayConfig.from_dict({"cluster": {"pools": [{"name": "web", "replicas": 6, "autoscale": {
        "min": 6, "max": 6, "signal": "running", "target": 8, "interval_s": 10}}]}})
    walls = {}
    for name, config in (("fixed x6", ReplayConfig.from_dict({"replicas": 6})),
                         ("autoscaler pinned at 6 (its ticks only)", pinned), ("autoscaled 2..6", scaled)):
        result, times = timed_replays(trace, config, repeat)
        walls[name] = min(times)
        extra = ""
        if "cluster" in result.meta:
            timeline = result.meta["cluster"]["pools"][0]["autoscale"]["timeline"]
            extra = f"; {len(timeline)} timeline rows, most active {max(row[1] for row in timeline)}"
        print(f"azure-conv {name}: {result.steps.num_rows:,} step rows; wall best {min(times):.3f} s, "
              f"median {sorted(times)[len(times) // 2]:.3f} s{extra}")
    print(f"wall against fixed x6: pinned {walls['autoscaler pinned at 6 (its ticks only)'] / walls['fixed x6']:.2f}x, "
          f"autoscaled 2..6 {walls['autoscaled 2..6'] / walls['fixed x6']:.2f}x")


def case_azure_disagg_autoscale(repeat: int) -> None:
    """The azure-disagg cluster (2 prefill + 4 decode, fixed) against both pools' autoscalers pinned at
    2 and 4 (their ticks only) and both pools autoscaled (examples/clusters/disagg-autoscale.toml)."""
    import copy

    from servelab.api import ReplayConfig
    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace

    trace = read_trace(default_trace_path())
    pinned = copy.deepcopy(AZURE_DISAGG)
    for pool in pinned["pools"]:
        n = pool["replicas"]
        pool["autoscale"] = {"min": n, "max": n, "signal": "running", "target": 8, "interval_s": 5}
    example = Path(__file__).resolve().parents[1] / "examples" / "clusters" / "disagg-autoscale.toml"
    walls = {}
    for name, config in (("fixed 2p+4d", ReplayConfig.from_dict({"cluster": AZURE_DISAGG})),
                         ("pinned 2p+4d (ticks only)", ReplayConfig.from_dict({"cluster": pinned})),
                         ("autoscaled 1..4p + 2..8d", ReplayConfig.from_toml(example))):
        result, times = timed_replays(trace, config, repeat)
        walls[name] = min(times)
        extra = ""
        for pool in result.meta["cluster"]["pools"]:
            if "autoscale" in pool:
                timeline = pool["autoscale"]["timeline"]
                extra += f"; {pool['name']}: {len(timeline)} timeline rows, most active {max(r[1] for r in timeline)}"
        print(f"azure-conv {name}: {result.steps.num_rows:,} step rows; wall best {min(times):.3f} s, "
              f"median {sorted(times)[len(times) // 2]:.3f} s{extra}")
    fixed = walls["fixed 2p+4d"]
    print(f"wall against fixed 2p+4d: pinned {walls['pinned 2p+4d (ticks only)'] / fixed:.2f}x, "
          f"autoscaled {walls['autoscaled 1..4p + 2..8d'] / fixed:.2f}x")


def case_1m() -> None:
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.traces.synth import synth_trace

    t0 = time.perf_counter()
    trace = synth_trace(n=1_000_000, rate=40.0, arrival="gamma", cv=2.0,
                        prompt="lognormal:800:1.0", output="lognormal:200:1.0", seed=7)
    gen_s = time.perf_counter() - t0
    config = ReplayConfig(engine=EngineConfig(replicas=8))
    t0 = time.perf_counter()
    result = replay(trace, config)
    wall = time.perf_counter() - t0
    iterations = sum(result.steps.column("num_iterations").to_pylist())
    print(f"synthetic 1M (gamma cv=2 at 40 req/s, lognormal lengths, 8 replicas): generated in {gen_s:.1f} s; "
          f"replay wall {wall:.1f} s; {result.steps.num_rows:,} step rows for {iterations:,} iterations; "
          f"counts {result.meta['counts']}; peak RSS {peak_rss_mb():.0f} MB")


def multiturn_trace():
    """12 k requests of multi-turn sessions (3 turns on average, each turn's prompt carrying the
    conversation so far) behind 4 tenants' shared 1 k-token system prompts, 512-token hash blocks as
    Mooncake's: mean prompt ~6.9 k tokens, two thirds of them reusable."""
    from servelab.traces.synth import synth_trace

    return synth_trace(n=12_000, rate=1.0, tenants=4, shared_prefix_tokens=1024, turns=3.0, think_s=30.0,
                       prompt="lognormal:1100:0.9", output="lognormal:300:0.8", prefix_block_tokens=512, seed=1)


def case_multiturn(repeat: int) -> None:
    """Issue #12's long-context case: prefix caching on (routers round-robin and prefix-affinity) and off."""
    from servelab.api import EngineConfig, ReplayConfig

    trace = multiturn_trace()
    prompts = trace.column("prompt_tokens").to_numpy()
    for label, engine in (("caching off", EngineConfig(replicas=4, enable_prefix_caching=False)),
                          ("caching on, round-robin", EngineConfig(replicas=4)),
                          ("caching on, prefix-affinity", EngineConfig(replicas=4, router="prefix-affinity"))):
        result, times = timed_replays(trace, ReplayConfig(engine=engine), repeat)
        hit = sum(result.requests.column("cached_tokens").to_pylist()) / prompts.sum()
        print(f"multi-turn 12k (mean prompt {prompts.mean():,.0f} tokens, 4 replicas) {label}: "
              f"wall best {min(times):.2f} s, median {sorted(times)[len(times) // 2]:.2f} s; "
              f"prompt tokens from cache {hit:.1%}; peak RSS {peak_rss_mb():.0f} MB", flush=True)


def case_overload() -> None:
    """A queue that builds up: policies that order the waiting queue must not re-sort it per event."""
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=20_000, rate=40.0, arrival="poisson", prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    for policy in ("sarathi", "sjf", "srpt", "vtc", "tiers", "edf"):
        t0 = time.perf_counter()
        result = replay(trace, ReplayConfig(engine=EngineConfig(replicas=1), policy=policy))
        wall = time.perf_counter() - t0
        waiting = max(result.steps.column("waiting").to_pylist())
        print(f"overload (20k requests at 40 req/s, 1 replica) {policy}: wall {wall:.2f} s; "
              f"{result.steps.num_rows:,} step rows; longest queue {waiting:,}")


def case_overload15(n: int, policies: list[str]) -> None:
    """One replica at ~1.5x its capacity (16 req/s of the overload lengths; it serves ~10.7): every
    policy's replay CPU time against sarathi's, in one process (issue #31 item 5: within 2x, vllm-v0
    within 1.5x). CPU time, not wall: the machine is shared."""
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=n, rate=16.0, arrival="poisson", prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    reference = None
    for policy in ["sarathi", *[p for p in policies if p != "sarathi"], "sarathi"]:
        t0 = time.process_time()
        result = replay(trace, ReplayConfig(engine=EngineConfig(replicas=1), policy=policy))
        cpu = time.process_time() - t0
        reference = reference if reference is not None else cpu
        print(f"overload x1.5 ({n:,} requests at 16 req/s, 1 replica) {policy}: CPU {cpu:.2f} s "
              f"({cpu / reference:.2f}x the first sarathi); {result.steps.num_rows:,} step rows", flush=True)


def registered_policies() -> list[str]:
    """Every policy the registry knows (a new one is benchmarked without editing this file)."""
    from servelab.policies.base import policy_names

    return policy_names()


def case_overload200k(n: int, policies: list[str]) -> None:
    """One replica at ~15x its capacity (it serves ~10.7 req/s of these lengths; 160 arrive): the
    queue grows to ~n. Each policy runs in a fresh process so one's memory does not weigh on the next."""
    for policy in policies:
        subprocess.run([sys.executable, __file__, "--case", "overload200k-one", "--n", str(n), "--policy", policy],
                       check=True)


def case_overload200k_one(n: int, policy: str) -> None:
    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=n, rate=160.0, arrival="poisson", prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    t0 = time.perf_counter()
    result = replay(trace, ReplayConfig(engine=EngineConfig(replicas=1), policy=policy))
    wall = time.perf_counter() - t0
    waiting = max(result.steps.column("waiting").to_pylist())
    print(f"overload x15 ({n:,} requests at 160 req/s, 1 replica) {policy}: wall {wall:.2f} s; "
          f"{result.steps.num_rows:,} step rows; longest queue {waiting:,}; peak RSS {peak_rss_mb():.0f} MB",
          flush=True)


def case_quantum(n: int) -> None:
    """round-robin's quantum under the overload200k shape (n requests): preemptions, mean E2E and
    the replay's wall time per quantum, with sarathi for reference (docs/engine.md)."""
    import pyarrow.compute as pc

    from servelab.api import EngineConfig, ReplayConfig, replay
    from servelab.traces.synth import synth_trace

    trace = synth_trace(n=n, rate=160.0, arrival="poisson", prompt="lognormal:800:1.0",
                        output="lognormal:200:1.0", seed=7)
    for policy, params in [("round-robin", {"quantum": 16}), ("round-robin", {"quantum": 64}),
                           ("round-robin", {}), ("sarathi", {})]:
        t0 = time.perf_counter()
        result = replay(trace, ReplayConfig(engine=EngineConfig(replicas=1), policy=policy, policy_params=params))
        wall = time.perf_counter() - t0
        requests = result.requests
        print(f"{policy} {params or '(defaults)'}: preemptions {pc.sum(requests['num_preemptions']).as_py():,}; "
              f"mean e2e {pc.mean(requests['e2e_s']).as_py():,.0f} s; wall {wall:.2f} s", flush=True)


def clipped_azure(path, max_tokens: int = 4096):
    """The bundled Azure conversation trace with prompt + output clipped to ``max_tokens`` as Vidur
    clips them (the prompt first, then the output to what is left, at least one token)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace, write_trace

    trace = read_trace(default_trace_path())
    prompt = pc.min_element_wise(trace["prompt_tokens"], pa.scalar(max_tokens - 1, trace["prompt_tokens"].type))
    room = pc.subtract(pa.scalar(max_tokens, prompt.type), prompt)
    output = pc.max_element_wise(pc.min_element_wise(trace["output_tokens"], room), pa.scalar(1, room.type))
    trace = trace.set_column(trace.schema.get_field_index("prompt_tokens"), "prompt_tokens", prompt)
    trace = trace.set_column(trace.schema.get_field_index("output_tokens"), "output_tokens", output.cast(trace["output_tokens"].type))
    return write_trace(trace, path, "azure-clipped")


def case_vidur70b(repeat: int) -> None:
    """Issue #17's side-by-side with Vidur: the Azure conversation trace clipped to 4,096 tokens,
    Llama-2-70B at TP 2 on A100-80GB, 6 replicas behind round-robin, timed as a whole `servelab
    replay` process (start-up, replay, writing the run), per scheduler."""
    import statistics
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        trace = clipped_azure(Path(tmp) / "azure.arrow")
        for policy in ("vllm-v0", "sarathi"):
            walls = []
            for i in range(repeat):
                cmd = [sys.executable, "-m", "servelab", "replay", str(trace), "--model", "llama-2-70b", "--gpu",
                       "a100-80gb", "--tp", "2", "--replicas", "6", "--router", "round-robin", "--policy", policy,
                       "--no-report", "-o", str(Path(tmp) / f"{policy}{i}")]  # fmt: skip
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                walls.append(time.perf_counter() - t0)
            print(f"vidur70b (azure-conv clipped to 4096, llama-2-70b tp2 a100-80gb x6, round-robin) {policy}: "
                  f"whole process median {statistics.median(walls):.2f} s of {', '.join(f'{w:.2f}' for w in walls)}",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--case", choices=["azure", "azure-disagg", "azure-autoscale", "azure-disagg-autoscale", "1m",
                                           "overload", "overload15", "overload200k", "overload200k-one", "multiturn", "quantum",
                                           "vidur70b"])
    parser.add_argument("--policy", action="append", help="overload200k: only these policies (repeatable)")
    parser.add_argument("--n", type=int, default=None, help="overload200k, quantum (200,000), overload15 (20,000): requests")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-1m", action="store_true")
    args = parser.parse_args()
    if args.case == "azure":
        case_azure(args.repeat)
    elif args.case == "azure-disagg":
        case_azure_disagg(args.repeat)
    elif args.case == "azure-autoscale":
        case_azure_autoscale(args.repeat)
    elif args.case == "azure-disagg-autoscale":
        case_azure_disagg_autoscale(args.repeat)
    elif args.case == "1m":
        case_1m()
    elif args.case == "overload":
        case_overload()
    elif args.case == "multiturn":
        case_multiturn(args.repeat)
    elif args.case == "overload15":
        case_overload15(args.n or 20_000, args.policy or registered_policies())
    elif args.case == "overload200k":
        case_overload200k(args.n or 200_000, args.policy or registered_policies())
    elif args.case == "overload200k-one":
        case_overload200k_one(args.n or 200_000, args.policy[0])
    elif args.case == "quantum":
        case_quantum(args.n or 200_000)
    elif args.case == "vidur70b":
        case_vidur70b(args.repeat)
    else:
        cases = ["azure", "overload", "multiturn"] + ([] if args.skip_1m else ["1m"])
        for case in cases:
            subprocess.run([sys.executable, __file__, "--case", case, "--repeat", str(args.repeat)], check=True)


if __name__ == "__main__":
    main()
