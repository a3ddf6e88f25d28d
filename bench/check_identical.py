"""Fingerprint the replay's outputs: sha256 of requests.parquet and steps.parquet (and tokens.parquet)
for every case of bench_replay.py and bench_platform.py, every replay config in examples/, plus every
policy over a matrix of engine settings on a slice of the bundled trace. A refactor of the engine must leave every line unchanged.

    .venv/bin/python bench/check_identical.py [--with-1m] > before.txt
    ... change the engine ...
    .venv/bin/python bench/check_identical.py [--with-1m] > after.txt && diff before.txt after.txt
    .venv/bin/python bench/check_identical.py --stream > streamed.txt && diff before.txt streamed.txt
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def report(name: str, run_dir: Path) -> None:
    files = ("requests.parquet", "steps.parquet", "tokens.parquet")
    parts = [f"{f.split('.')[0]}={digest(run_dir / f)}" for f in files if (run_dir / f).exists()]
    print(f"{name}: {' '.join(parts)}", flush=True)


# --stream: each case replayed streamed (servelab.api.replay_to) from a trace file, where it can be
STREAM = {"on": False, "cases": 0, "streamed": 0}


def run(out: Path, name: str, trace, config, **kwargs) -> None:
    from servelab.api import replay, write_run

    if not STREAM["on"]:
        report(name, write_run(replay(trace, config, **kwargs), out / name))
        return
    import pyarrow as pa
    import pyarrow.ipc as ipc
    from servelab.api import replay_to

    path = out / f"{name}.trace.arrow"
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, trace.schema) as writer:
        writer.write_table(trace)
    fell_back = []
    STREAM["cases"] += 1
    report(name, replay_to(path, config, out / name, on_fallback=fell_back.append, **kwargs))
    STREAM["streamed"] += not fell_back


MATRIX = {  # engine settings that exercise every path of the engine: KV pressure, swap, reserve, ...
    "default": {},
    "kv-recompute": {"num_gpu_blocks": 600},
    "kv-swap": {"num_gpu_blocks": 600, "preemption": "swap", "kv_bytes_per_token": 131072, "swap_space_gb": 0.5},
    "reserve": {"num_gpu_blocks": 1500, "kv_allocation": "reserve"},
    "small-budget": {"max_num_batched_tokens": 256, "max_num_seqs": 8},
    "skip-horizon": {"num_gpu_blocks": 600, "head_of_line": "skip", "until_s": 120.0},
    "least-outstanding": {"replicas": 3, "router": "least-outstanding"},
    "platform": {"replicas": 2, "quota": ("tenant=*:rpm=600",), "retries": 2, "queue_cap": 40,
                 "pause": "tier=standard,waiting=30,resume=10", "fail": ("replica=1,at=60,for=30",)},
}


PAUSES = {"waiting": "tier=flex,waiting=2,resume=1", "never": "tier=flex,waiting=100000",
          "kv": "tier=flex,kv=0.25,resume=0.15"}


PREFIX_MATRIX = {  # the prefix cache under KV pressure, preemption (both kinds), scopes and routers
    "default": {},
    "kv-recompute": {"num_gpu_blocks": 2500},
    "kv-swap": {"num_gpu_blocks": 2500, "preemption": "swap", "kv_bytes_per_token": 131072, "swap_space_gb": 2.0},
    "small-budget": {"num_gpu_blocks": 4000, "max_num_batched_tokens": 300, "max_num_seqs": 8},
    "tenant-scope": {"num_gpu_blocks": 4000, "prefix_cache_scope": "tenant"},
    "affinity": {"replicas": 4, "router": "prefix-affinity", "num_gpu_blocks": 3000},
}


def prefix_cases(out: Path) -> None:
    """Hashed traces: multi-turn sessions with shared system prompts, hash blocks of 512 (32 engine
    blocks, long contexts), 48 (3, and chunks that end mid hash block), 40 and 8 (not multiples of 16)."""
    from servelab.replay import EngineConfig, ReplayConfig
    from servelab.traces.synth import synth_trace

    long = synth_trace(n=600, rate=3.0, tenants="a=1,b=1,c=1,d=1", shared_prefix_tokens=2048, turns=5.0,
                       think_s=20.0, prompt="lognormal:3000:0.8", output="lognormal:200:0.8",
                       prefix_block_tokens=512, seed=3)
    for label, settings in {"default": {"replicas": 4, "router": "prefix-affinity"},
                            "kv-recompute": {"num_gpu_blocks": 12000},
                            "kv-swap": {"num_gpu_blocks": 12000, "preemption": "swap", "kv_bytes_per_token": 131072},
                            "srpt-preempt": {"num_gpu_blocks": 12000, "max_num_batched_tokens": 1000},
                            "round-robin": {"replicas": 4, "num_gpu_blocks": 9000}}.items():
        policy, params = ("srpt", {"preempt": True}) if label == "srpt-preempt" else ("sarathi", {})
        engine = EngineConfig(**{"replicas": 1, **settings})
        run(out, f"prefix-long-{label}", long, ReplayConfig(engine=engine, policy=policy, policy_params=params))
    import bench_replay

    multiturn = bench_replay.multiturn_trace()
    for router in ("round-robin", "prefix-affinity"):
        run(out, f"prefix-multiturn-{router}", multiturn, ReplayConfig(engine=EngineConfig(replicas=4, router=router)))
    for tb in (16, 48, 40, 8):
        short = synth_trace(n=1500, rate=6.0, tenants="a=1,b=1,c=1", shared_prefix_tokens=300, turns=4.0,
                            think_s=4.0, prompt="lognormal:300:0.6", output="lognormal:40:0.6",
                            prefix_block_tokens=tb, seed=5)
        for label, settings in PREFIX_MATRIX.items():
            engine = EngineConfig(**{"replicas": 1, **settings})
            run(out, f"prefix-tb{tb}-{label}", short, ReplayConfig(engine=engine))
        engine = EngineConfig(num_gpu_blocks=2500)
        run(out, f"prefix-tb{tb}-srpt-preempt", short,
            ReplayConfig(engine=engine, policy="srpt", policy_params={"preempt": True}))


def example_cases(out: Path) -> None:
    """Every replay config in examples/ (the KV-tier ones and examples/clusters/) on the bundled trace:
    the first 3,000 requests, ten minutes for the spot pool (its availability drops at 600 s)."""
    from servelab.replay import ReplayConfig
    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace

    azure = read_trace(default_trace_path())
    examples = Path(__file__).resolve().parent.parent / "examples"
    for path in sorted([*examples.glob("kv_*.toml"), *(examples / "clusters").glob("*.toml")]):
        n = azure.num_rows if path.stem == "spot-fallback" else 3000
        run(out, f"example-{path.stem}", azure.slice(0, n), ReplayConfig.from_toml(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--with-1m", action="store_true", help="also the 1 M-request case (about a minute)")
    parser.add_argument("--prefix-only", action="store_true", help="only the prefix-caching cases (hashed traces)")
    parser.add_argument("--examples-only", action="store_true", help="only the example configs (examples/)")
    parser.add_argument("--stream", action="store_true",
                        help="replay each case streamed from a trace file (the same lines expected); counts on stderr")
    args = parser.parse_args()
    STREAM["on"] = args.stream
    try:
        _main(args)
    finally:
        if args.stream:
            print(f"streamed {STREAM['streamed']} of {STREAM['cases']} cases (the others in memory)", file=sys.stderr)


def _main(args) -> None:
    if args.examples_only:
        with tempfile.TemporaryDirectory() as tmp:
            example_cases(Path(tmp))
        return
    if args.prefix_only:
        with tempfile.TemporaryDirectory() as tmp:
            prefix_cases(Path(tmp))
        return

    import bench_platform
    from servelab.policies.base import policy_names
    from servelab.replay import EngineConfig, ReplayConfig
    from servelab.traces.bundled import default_trace_path
    from servelab.traces.io import read_trace
    from servelab.traces.synth import synth_trace

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        azure = read_trace(default_trace_path())
        run(out, "replay-azure", azure, ReplayConfig(engine=EngineConfig(replicas=6)))
        overload = synth_trace(n=20_000, rate=40.0, arrival="poisson", prompt="lognormal:800:1.0",
                               output="lognormal:200:1.0", seed=7)
        for policy in ("sarathi", "sjf", "srpt", "vtc", "tiers", "edf"):
            run(out, f"replay-overload-{policy}", overload,
                ReplayConfig(engine=EngineConfig(replicas=1), policy=policy))
        if args.with_1m:
            big = synth_trace(n=1_000_000, rate=40.0, arrival="gamma", cv=2.0,
                              prompt="lognormal:800:1.0", output="lognormal:200:1.0", seed=7)
            run(out, "replay-1m", big, ReplayConfig(engine=EngineConfig(replicas=8)))

        import bench_replay

        run(out, "replay-azure-disagg", azure, ReplayConfig.from_dict({"cluster": bench_replay.AZURE_DISAGG}))
        # a slow link and small decode KV: transfers share the link, handoffs wait for room (back-pressure)
        tight = {"pools": [{"name": "prefill", "role": "prefill", "replicas": 2},
                           {"name": "decode", "role": "decode", "replicas": 2, "num_gpu_blocks": 700}],
                 "links": [{"from": "prefill", "to": "decode", "bandwidth_gbps": 2.0, "latency_s": 0.001}]}
        run(out, "replay-azure-disagg-tight", azure.slice(0, 3000), ReplayConfig.from_dict({"cluster": tight}))

        slice_ = azure.slice(0, 1500)
        for policy in policy_names():
            for label, settings in MATRIX.items():
                engine = EngineConfig(**{"replicas": 1, **settings})
                run(out, f"matrix-{policy}-{label}", slice_, ReplayConfig(engine=engine, policy=policy))
        run(out, "matrix-sarathi-token-log", slice_, ReplayConfig(engine=EngineConfig(num_gpu_blocks=600)),
            token_log=True)

        # pausing a tier (waiting or KV share) on a tiered overload, under every policy: a rule that fires
        # often, one that never fires, and the KV-share rule
        tiered = bench_platform.overload()
        for policy in policy_names():
            for label, pause in PAUSES.items():
                engine = EngineConfig(replicas=1, max_num_seqs=8, num_gpu_blocks=300, pause=pause)
                run(out, f"pause-{policy}-{label}", tiered, ReplayConfig(engine=engine, policy=policy))

        prefix_cases(out)
        example_cases(out)

        platform = out / "platform"
        platform.mkdir()
        for fn in (bench_platform.noisy_neighbour_report, bench_platform.tiers_report,
                   bench_platform.quota_report, bench_platform.fault_report):
            fn(platform)
        for run_dir in sorted(p for p in platform.iterdir() if (p / "requests.parquet").exists()):
            report(f"platform-{run_dir.name}", run_dir)


if __name__ == "__main__":
    main()
