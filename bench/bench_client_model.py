"""Does the client model close the gap between engine-side simulation and client-side measurement?
(issue #25: mean TTFT within 10% on at least 10 of 12 live runs).

Against a running vLLM server (`source .ci/vllm.sh`), with `/metrics` scraped in every run:

1. lone-request levels (one user, warm-up first, prompts 16..1536, 2 output tokens) give, per level,
   the client TTFT and vLLM's engine-side queue + prefill time; the same engine-side means give an
   engine-only `linear` cost model (intercept + per prompt token per prefill step);
2. decode levels (C = 1, 4, 8, 16 users, 64-token prompts, 32 tokens) give the engine's decode time
   per gap at C sequences (`vllm:request_decode_time_seconds`): the model's per-step and
   per-sequence decode terms. `servelab fit --client` fits the client model to the lone and decode
   levels together: the decode levels are closed loops of C users, so each request is sent with
   about C - 1 other streams open, which is what identifies the load term (`stream_s`);
3. `--runs` live runs of one validation trace (40 Poisson requests at 5/s, prompts 32-384, outputs
   8-48: bench/bench_live_fit.py's) are replayed with that engine-only model (a `fitted` runner priced
   from those means) and compared with `validate --real`: with the client model fitted on the lone
   and decode levels, with one fitted on the levels and the first half of the live runs (judged on
   the second half), and without one (`--client-model none`). Every observation (levels and runs,
   each with its mean open streams at send) is written to DIR/observations_all.json.

Run the server and this script in one session (bench/RESULTS_live.md session 8: a client in another
session than the server's saw every token of a request arrive at its end), with the server's API
process and engine core kept off the model worker's CPU and the script there too
(`.ci/pin_frontend.py`, `taskset`).

    python bench/bench_client_model.py --endpoint http://127.0.0.1:8000 [--runs 12] [--keep DIR]

Prints each run's measured and simulated mean TTFT and E2E and the errors; the figures are in
bench/RESULTS_fidelity.md. A measurement, not a test: CPU timing on a shared machine is noisy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def cli(*args, timeout=600) -> str:
    proc = subprocess.run([sys.executable, "-m", "servelab", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"servelab {args[0]} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def write_level_trace(path: Path, n: int, prompt: int, output: int) -> None:
    from servelab.traces.io import write_trace
    import pyarrow as pa

    write_trace(pa.table({"request_id": list(range(n)), "arrival_s": [0.0] * n, "prompt_tokens": [prompt] * n,
                          "output_tokens": [output] * n}), path, source="bench_client_model level")


def bench(endpoint: str, trace: Path, out: Path, seed: int, *extra) -> Path:
    cli("bench", endpoint, trace, "-o", out, "--no-report", "--metrics", "--metrics-interval", "5",
        "--seed", seed, *extra)
    return out


def engine_means(run: Path) -> dict:
    from servelab.fidelity.client_model import observations_from

    return observations_from(run)[0]


def on_engine_times(run: Path, client_json: Path) -> tuple[float, float]:
    """The client model alone: the run's mean client-side TTFT predicted from vLLM's own engine-side
    mean TTFT (its /metrics) plus the model's outside time of each finished request (its prompt, and
    the other streams open at its send by the client's own times). (measured, predicted) seconds."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from servelab.fidelity.client_model import open_streams, resolve

    model = resolve(str(client_json))
    t = pq.read_table(run / "requests.parquet")
    done = t.filter(pc.equal(t.column("status"), "finished"))
    send, end = done.column("arrival_s").to_numpy(), done.column("finish_s").to_numpy()
    outside = model.outside_s(done.column("prompt_tokens").to_numpy().astype(float), open_streams(send, end))
    return float(done.column("ttft_s").to_numpy().mean()), engine_means(run)["server_ttft_s"] + float(outside.mean())


def reanalyse(root: Path) -> None:
    """``--reanalyse DIR``: the client model alone on the live runs kept in DIR (``--keep``)."""
    runs = sorted((p for p in root.glob("live_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
    hits = 0
    print("run | measured TTFT ms | vLLM engine TTFT + level-fitted client model | err")
    for run in runs:
        measured, predicted = on_engine_times(run, root / "client.json")
        err = 100 * (predicted / measured - 1)
        hits += abs(err) <= 10.0
        print(f"{run.name} | {measured * 1e3:.2f} | {predicted * 1e3:.2f} | {err:+.1f}%")
    print(f"mean TTFT within 10%: {hits} of {len(runs)} with the client model on vLLM's own engine times")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint")
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--reanalyse", type=Path, default=None,
                        help="only judge the client model on vLLM's engine times of the live runs kept in DIR")
    args = parser.parse_args()
    if args.reanalyse is not None:
        reanalyse(args.reanalyse)
        return
    if not args.endpoint:
        parser.error("--endpoint is required (or --reanalyse DIR)")
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_client_model_"))
    root.mkdir(parents=True, exist_ok=True)
    seed = 100
    # 1. lone-request levels
    prefill = []
    for p in (16, 256, 768, 1536):
        t = root / f"prefill_{p}.arrow"
        write_level_trace(t, 6, p, 2)
        seed += 1
        run = bench(args.endpoint, t, root / f"prefill_{p}", seed, "--shape", "closed", "--users", "1",
                    "--think", "0.15", "--warmup", "1")
        prefill.append(engine_means(run))
    # the engine-side prefill step: intercept + per prompt token (least squares on the level means)
    ps = np.array([o["prompt_tokens"] for o in prefill])
    es = np.array([o["server_ttft_s"] for o in prefill])
    slope, intercept = np.polyfit(ps, es, 1)
    # 2. decode levels: the engine's decode time per gap at C sequences
    decode, decode_obs = [], []
    for c in (1, 4, 8, 16):
        t = root / f"decode_{c}.arrow"
        write_level_trace(t, 2 * c, 64, 32)
        seed += 1
        run = bench(args.endpoint, t, root / f"decode_{c}", seed, "--shape", "closed", "--users", c, "--warmup", "1")
        o = engine_means(run)
        decode.append((c, o["server_decode_s"] / (o["output_tokens"] - 1)))
        decode_obs.append(o)
    levels = [*(root / f"prefill_{p}" for p in (16, 256, 768, 1536)), *(root / f"decode_{c}" for c in (1, 4, 8, 16))]
    cli("fit", *[a for r in levels for a in ("--client", r)], "-o", root / "client.json")
    client = json.loads((root / "client.json").read_text())
    cs, gaps = np.array([d[0] for d in decode]), np.array([d[1] for d in decode])
    d_slope, d_intercept = np.polyfit(cs, gaps, 1)
    # a `fitted` runner (runners/fitted.py) priced by hand: a decode step = intercept + per sequence;
    # a lone prefill step = intercept + per prefill sequence + per prompt token
    intercept_s = max(d_intercept, 0.0)
    coef = {"intercept": intercept_s, "prefill_tokens": max(slope, 0.0),
            "prefill_seqs": max(intercept - intercept_s, 0.0), "prefill_context_tokens": 0.0,
            "prefill_attention_pairs": 0.0, "decode_seqs": max(d_slope, 0.0), "decode_context_tokens": 0.0}
    model_path = root / "engine.json"
    model_path.write_text(json.dumps({"format": 1, "kind": "servelab-fitted-runner", "terms": list(coef),
                                      "bucket_edges_tokens": [], "coefficients_s": [coef],
                                      "metadata": {"fit": "bench_client_model.py: vLLM engine-side /metrics"}}))
    runner = f"fitted:{model_path}"
    print(f"client model: {client['request_s'] * 1e3:.2f} ms + {client['prompt_token_s'] * 1e6:.2f} us/prompt token "
          f"+ {client['stream_s'] * 1e3:.2f} ms per open stream, token_s {client['token_s'] * 1e6:.1f} us "
          f"({client['provenance'].rsplit('; ', 1)[-1]})")
    print("prefill levels (P, client TTFT ms, engine ms): "
          + ", ".join(f"{o['prompt_tokens']:.0f}: {o['client_ttft_s'] * 1e3:.2f} / {o['server_ttft_s'] * 1e3:.2f}"
                      for o in prefill))
    print("decode levels (C, open streams at send, client TTFT ms, engine ms): "
          + ", ".join(f"{c}: {o['open_streams']:.2f}, {o['client_ttft_s'] * 1e3:.2f} / {o['server_ttft_s'] * 1e3:.2f}"
                      for (c, _), o in zip(decode, decode_obs)))
    print("decode levels (C, engine ms per gap): " + ", ".join(f"{c}: {g * 1e3:.2f}" for c, g in decode))
    print("engine-only model: " + ", ".join(f"{k} {v * 1e3:.4g} ms" for k, v in coef.items() if v), flush=True)
    # 3. validation runs
    from servelab.traces.io import write_trace
    from servelab.traces.synth import synth_trace

    vt = root / "v.arrow"
    write_trace(synth_trace(n=40, rate=5.0, prompt="uniform:32:384", output="uniform:8:48", seed=2), vt, source="v")
    runs = []
    for k in range(args.runs):
        seed += 1
        runs.append(bench(args.endpoint, vt, root / f"live_{k}", seed))
    # a second client model: the lone levels plus the first half of the loaded runs (their vLLM
    # /metrics give the engine-side TTFT), judged on the second half only
    half = args.runs // 2
    cli("fit", *[a for r in [*levels, *runs[:half]] for a in ("--client", r)], "-o", root / "client_loaded.json")
    # every observation (levels and runs) with where it came from: what the shipped default is fitted on
    (root / "observations_all.json").write_text(json.dumps(
        {"observations": [dict(engine_means(r), source=r.name) for r in [*levels, *runs]]}, indent=1))
    hits = {"client": 0, "none": 0, "loaded": 0, "engine": 0}
    print("run | open streams at send | measured TTFT ms | engine TTFT (vLLM) | sim, level-fitted client model | err | "
          "sim, +loaded runs | err | engine-only | err | measured E2E ms | sim | err | "
          "vLLM engine TTFT + level-fitted client model | err")
    for k, run in enumerate(runs):
        rows = {}
        for mode, spec in (("client", root / "client.json"), ("loaded", root / "client_loaded.json"),
                           ("none", "none")):
            report = json.loads(cli("validate", "--real", run, "--candidate", runner, "--set", "max_num_seqs=16",
                                    "--client-model", spec, "--format", "json"))
            rows[mode] = {(r["metric"], r["stat"]): r for r in report["latency"]}
        t = {mode: rows[mode][("ttft", "mean")] for mode in rows}
        e_c = rows["client"][("e2e", "mean")]
        for mode in hits:
            hits[mode] += abs(t[mode]["error_pct"]) <= 10.0 and (mode != "loaded" or k >= half)
        means = engine_means(run)
        engine_ttft = means["server_ttft_s"]
        _, alone = on_engine_times(run, root / "client.json")
        alone_err = 100 * (alone / t["client"]["measured_s"] - 1)
        hits["engine"] += abs(alone_err) <= 10.0
        print(f"{k} | {means['open_streams']:.2f} | {t['client']['measured_s'] * 1e3:.2f} | {engine_ttft * 1e3:.2f} | "
              f"{t['client']['simulated_s'] * 1e3:.2f} | {t['client']['error_pct']:+.1f}% | "
              f"{t['loaded']['simulated_s'] * 1e3:.2f} | {t['loaded']['error_pct']:+.1f}%{' (fit)' if k < half else ''} | "
              f"{t['none']['simulated_s'] * 1e3:.2f} | {t['none']['error_pct']:+.1f}% | {e_c['measured_s'] * 1e3:.2f} | "
              f"{e_c['simulated_s'] * 1e3:.2f} | {e_c['error_pct']:+.1f}% | {alone * 1e3:.2f} | {alone_err:+.1f}%",
              flush=True)
    print(f"mean TTFT within 10%: {hits['client']} of {args.runs} with the client model fitted on the levels, "
          f"{hits['loaded']} of {args.runs - half} held-out runs with the one fitted on loaded runs too, "
          f"{hits['none']} of {args.runs} engine-only, {hits['engine']} of {args.runs} with the level-fitted "
          f"client model on vLLM's own engine times")
    print(f"run directories: {root}")


if __name__ == "__main__":
    main()
