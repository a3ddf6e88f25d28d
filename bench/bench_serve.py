"""`servelab bench` against `servelab serve` vs `servelab replay` of the same trace and settings.

Runs `servelab serve` as its own process on a free port, sends the trace with the live client at
the trace's pace divided by the time scale, and compares the client's mean TTFT and TPOT (scaled back
to simulated seconds) with the replay's. Usage: python bench/bench_serve.py [--scales 1,10] [--n 40]
[--loops asyncio,uvloop] [--repeat R]: each scale x event loop (the server's `--loop` and the client's)
R times, interleaved, with the machine's load average at each run.

``--streams N``: instead, N streaming requests sent at once (all arrivals at 0) to one server at the
first scale: how many failed, the most in flight at once on the client, the most in the engine at once
(running + waiting, from /metrics scraped every 50 ms) and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import tempfile
import urllib.request
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from helpers_serve import serving_process, train_tokenizer  # noqa: E402

from servelab.assembly import replay  # noqa: E402
from servelab.common.loops import run as run_on  # noqa: E402
from servelab.live.bench import LiveOptions, run_live  # noqa: E402
from servelab.live.client import Target  # noqa: E402
from servelab.live.load import LoadConfig  # noqa: E402
from servelab.replay.config import ReplayConfig  # noqa: E402
from servelab.traces.synth import synth_trace  # noqa: E402

RUNNER = "linear:base=0.04,prefill_token=0.0004,decode_seq=0.0005"
NUM_GPU_BLOCKS = 4096


def trace(n: int, rate: float, prompt: str = "uniform:1000:2000", output: str = "uniform:8:24", seed: int = 1):
    return synth_trace(n=n, rate=rate, prompt=prompt, output=output, seed=seed)


def config() -> ReplayConfig:
    return ReplayConfig.from_dict({"runner": RUNNER, "num_gpu_blocks": NUM_GPU_BLOCKS}, source="bench_serve")


def replay_means(table) -> tuple[float, float]:
    reqs = replay(table, config()).requests
    ttft = reqs.column("ttft_s").to_pylist()
    tpot = reqs.column("tpot_s").to_pylist()
    return sum(ttft) / len(ttft), sum(tpot) / len(tpot)


def served_means(table, scale: float, tokenizer: str, loop: str = "auto", warmup: int = 0) -> tuple[float, float, int, float]:
    """Client means (TTFT, TPOT) x ``scale``, and the requests that failed; the server and the client
    count prompts with the same ``tokenizer``.json, so the server sees the trace's prompt lengths.
    ``warmup``: that many requests sent at once and awaited first (`servelab bench --warmup`), which
    leaves as many connections open: the run's requests reuse them rather than open their own in a
    burst; the server's own TTFT is then the run's (its /metrics before the first send and after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--runner", RUNNER, "--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--time-scale", str(scale),
            "--tokenizer", tokenizer, "--served-model-name", "sim", "--loop", loop]
    with serving_process(port, args) as url:
        target = Target(url, "sim", timeout_s=120.0, ignore_eos=True, min_tokens=True)
        # /metrics scraped only before the first send and after the last answer (interval: never)
        options = LiveOptions(metrics=True, metrics_interval_s=1e9, tokenizer=tokenizer, extensions="off")
        run = run_on(run_live(table, target, LoadConfig(time_scale=1.0 / scale, warmup=warmup), options), loop)
    ends = {}
    for name, value in zip(run.metrics.column("metric").to_pylist(), run.metrics.column("value").to_pylist()):
        ends.setdefault(name, []).append(value)  # (first scrape, last scrape)
    ttft = {k: ends[f"vllm:time_to_first_token_seconds_{k}"] for k in ("sum", "count")}
    server_ttft = (ttft["sum"][-1] - ttft["sum"][0]) / (ttft["count"][-1] - ttft["count"][0])
    assert all(r.usage_prompt_tokens == p for r, p in zip(run.records, run.prompt_tokens)), "prompt lengths differ"
    ok = [r for r in run.records if r.status == "finished"]
    ttft = [(r.first_token_s - r.send_s) * scale for r in ok]
    tpot = [(r.finish_s - r.first_token_s) * scale / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    return sum(ttft) / len(ttft), sum(tpot) / len(tpot), len(run.records) - len(ok), server_ttft


def streams(n: int, scale: float, tokenizer: str) -> None:
    """``n`` streams at once against one `servelab serve` process: failures, peak in flight, peak in the engine."""
    import threading
    import time

    table = trace(n, 1e9, "uniform:100:300", "uniform:16:64")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--runner", RUNNER, "--num-gpu-blocks", "65536", "--time-scale", str(scale),
            "--tokenizer", tokenizer, "--served-model-name", "sim"]
    peak = [0.0, 0.0]  # running + waiting, running
    done = threading.Event()

    def scrape(url: str) -> None:
        while not done.wait(0.05):
            with urllib.request.urlopen(url + "/metrics") as r:
                m = {s.name: s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
            running, waiting = m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]
            peak[0], peak[1] = max(peak[0], running + waiting), max(peak[1], running)

    with serving_process(port, args) as url:
        scraper = threading.Thread(target=scrape, args=(url,), daemon=True)
        scraper.start()
        t0 = time.perf_counter()
        target = Target(url, "sim", timeout_s=300.0, ignore_eos=True, min_tokens=True)
        run = asyncio.run(run_live(table, target, LoadConfig(time_scale=1.0 / scale),
                                   LiveOptions(metrics=False, tokenizer=tokenizer, extensions="off")))
        wall = time.perf_counter() - t0
        done.set()
        scraper.join()
    failed = [r for r in run.records if r.status != "finished"]
    short = [r for r in run.records if r.status == "finished" and r.usage_completion_tokens != len(r.token_times)]
    print(f"{n} streams at once, time scale {scale:g}: {len(failed)} failed "
          f"({sorted({r.reason for r in failed})[:3]}), {len(short)} with missing tokens; peak in flight (client) "
          f"{run.meta['client']['peak_in_flight']}, peak in the engine {peak[0]:.0f} ({peak[1]:.0f} running); "
          f"{sum(len(r.token_times) for r in run.records)} tokens in {wall:.1f} s wall")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scales", default="1,10")
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--prompt", default="uniform:1000:2000")
    parser.add_argument("--output", default="uniform:8:24")
    parser.add_argument("--streams", type=int, help="N streams at once instead (see the module's docstring)")
    parser.add_argument("--loops", default="auto", help="event loops to compare (server and client): auto, uvloop, asyncio")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each scale x loop, interleaved")
    parser.add_argument("--warmup", type=int, default=0, help="requests sent at once and awaited before the run "
                                                              "(servelab bench --warmup): its connections open")
    args = parser.parse_args()
    tokenizer = train_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer.json")
    if args.streams:
        streams(args.streams, float(args.scales.split(",")[0]), tokenizer)
        return
    table = trace(args.n, args.rate, args.prompt, args.output)
    r_ttft, r_tpot = replay_means(table)
    print(f"trace: {args.n} requests at {args.rate}/s, prompts {args.prompt}, outputs {args.output}; runner {RUNNER}; "
          f"warm-up requests {args.warmup}")
    print(f"replay: mean TTFT {r_ttft * 1e3:.1f} ms, mean TPOT {r_tpot * 1e3:.2f} ms (simulated)")
    runs = [(scale, loop) for _ in range(args.repeat) for scale in (float(s) for s in args.scales.split(","))
            for loop in args.loops.split(",")]
    for scale, loop in runs:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
        s_ttft, s_tpot, failed, server_ttft = served_means(table, scale, tokenizer, loop, args.warmup)
        print(f"serve x{scale:g} {loop} (load {load}): mean TTFT {s_ttft * 1e3:.1f} ms ({(s_ttft / r_ttft - 1) * 100:+.1f}%), "
              f"mean TPOT {s_tpot * 1e3:.2f} ms ({(s_tpot / r_tpot - 1) * 100:+.1f}%), failed {failed} "
              f"(client times x scale); the server's own mean TTFT (from receipt) {server_ttft * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
