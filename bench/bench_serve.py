"""`servelab bench` against `servelab serve` vs `servelab replay` of the same trace and settings.

Runs `servelab serve` as its own process on a free port, sends the trace with the live client at
the trace's pace divided by the time scale, and compares the client's mean TTFT and TPOT (scaled back
to simulated seconds) with the replay's. Usage: python bench/bench_serve.py [--scales 1,10] [--n 40]
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


def served_means(table, scale: float, tokenizer: str) -> tuple[float, float, int, float]:
    """Client means (TTFT, TPOT) x ``scale``, and the requests that failed; the server and the client
    count prompts with the same ``tokenizer``.json, so the server sees the trace's prompt lengths."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["--runner", RUNNER, "--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--time-scale", str(scale),
            "--tokenizer", tokenizer, "--served-model-name", "sim"]
    with serving_process(port, args) as url:
        target = Target(url, "sim", timeout_s=120.0, ignore_eos=True, min_tokens=True)
        run = asyncio.run(run_live(table, target, LoadConfig(time_scale=1.0 / scale),
                                   LiveOptions(metrics=False, tokenizer=tokenizer, extensions="off")))
        with urllib.request.urlopen(url + "/metrics") as r:
            server = {s.name: s.value for f in text_string_to_metric_families(r.read().decode()) for s in f.samples}
    server_ttft = server["vllm:time_to_first_token_seconds_sum"] / server["vllm:time_to_first_token_seconds_count"]
    assert all(r.usage_prompt_tokens == p for r, p in zip(run.records, run.prompt_tokens)), "prompt lengths differ"
    ok = [r for r in run.records if r.status == "finished"]
    ttft = [(r.first_token_s - r.send_s) * scale for r in ok]
    tpot = [(r.finish_s - r.first_token_s) * scale / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    return sum(ttft) / len(ttft), sum(tpot) / len(tpot), len(run.records) - len(ok), server_ttft


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scales", default="1,10")
    parser.add_argument("--n", type=int, default=40)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--prompt", default="uniform:1000:2000")
    parser.add_argument("--output", default="uniform:8:24")
    args = parser.parse_args()
    table = trace(args.n, args.rate, args.prompt, args.output)
    tokenizer = train_tokenizer(Path(tempfile.mkdtemp()) / "tokenizer.json")
    r_ttft, r_tpot = replay_means(table)
    print(f"trace: {args.n} requests at {args.rate}/s, prompts {args.prompt}, outputs {args.output}; runner {RUNNER}")
    print(f"replay: mean TTFT {r_ttft * 1e3:.1f} ms, mean TPOT {r_tpot * 1e3:.2f} ms (simulated)")
    for scale in (float(s) for s in args.scales.split(",")):
        s_ttft, s_tpot, failed, server_ttft = served_means(table, scale, tokenizer)
        print(f"serve x{scale:g}: mean TTFT {s_ttft * 1e3:.1f} ms ({(s_ttft / r_ttft - 1) * 100:+.1f}%), "
              f"mean TPOT {s_tpot * 1e3:.2f} ms ({(s_tpot / r_tpot - 1) * 100:+.1f}%), failed {failed} "
              f"(client times x scale); the server's own mean TTFT (from receipt) {server_ttft * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
