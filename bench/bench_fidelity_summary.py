"""servelab against real vLLM runs that publish only per-stage summaries (inference-perf stage files).

Each experiment folder (``--data``) holds inference-perf's ``results/config.yaml`` (the shared_prefix
generator and the constant-rate load stages as run), ``results/stage_N_lifecycle_metrics.json`` (per
stage: client-side TTFT / E2E / TPOT means, the client's prompt_len and output_len distributions,
failures) and, for some, ``exp-config.yaml`` (the server's batch limits). There are no per-request
records, so the trace is rebuilt from the generator settings:

- arrivals: ``constant`` = evenly spaced at each stage's rate, stages back to back (synth's constant
  process under a piecewise rate schedule); the whole run is one replay, so a stage inherits the
  previous stage's queue;
- prompts: inference-perf's (pre-2026) shared_prefix generator makes num_groups x num_prompts_per_group
  prompts (a group's system prompt + a question, random token ids decoded to text) and the requests
  cycle through that pool (request i sends pool prompt i mod K). The server re-tokenises the decoded
  text, so the measured prompt_len (the same tokenizer as the server's) is ~5% above system + question.
  The K pool prompts get the measured prompt_len distribution (its percentiles, pooled over the
  stages: one pool serves every stage) at the K midpoint quantiles; the shared prefix is the system
  prompt scaled by the same re-tokenisation factor (measured mean / (system + question)). Prefix
  hashes: servelab's PrefixSpec (group i mod G, pool prompt i mod K), so a repeated prompt hits the
  prefix cache (vLLM v1 default) as on the server;
- outputs: ``ignore_eos`` with ``max_tokens`` = output_len: the server generates exactly that many;
- the client's timeout: every failure of these runs ended 300.0-301.0 s after it was sent
  (aiohttp's default total timeout of 300 s; config.yaml request_timeout is null), so the replay
  gives every request ``client_timeout_s`` = 300.

Measured TPOT: inference-perf's ``time_per_output_token`` divides (E2E - TTFT) by the number of
streamed chunks it recorded (about twice the tokens: ITL mean == TPOT mean and its median is ~30 us),
so it is about half the real per-token time; the comparable figure is derived from the means:
(mean E2E - mean TTFT) / (output_len - 1). Both are printed; errors use the derived one.

Simulated times are made client-side with the calibrated vLLM client model, as ``validate --real``
does for a client-clock run (fidelity/client_model.py); the engine-side errors are printed too.

The data: github.com/inference-sim/training, ``default_args/<experiment>/`` at commit c4f03409 (16
experiments; the repository has no licence file, so nothing of it is bundled here): copy each
experiment's ``results/config.yaml``, ``results/stage_*_lifecycle_metrics.json`` and ``exp-config.yaml``
(where present) into ``DATA/<experiment>/`` keeping those paths. The runs record no vLLM version:
``--async-scheduling`` replays them with vLLM's default since 0.14 (docs/engine.md "Async scheduling").

    .venv/bin/python bench/bench_fidelity_summary.py --data /tmp/agg [--async-scheduling] [--settings exp-config-all] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from servelab.assembly import build_cluster, build_runner, replay, resolve_num_gpu_blocks, trace_block_tokens
from servelab.fidelity import client_model as cm
from servelab.fidelity.base import read_yaml
from servelab.fidelity.vllm_defaults import batch_defaults
from servelab.replay.config import ReplayConfig
from servelab.replay.core.engine_config import EngineConfig
from servelab.runners.presets import find_model
from servelab.traces.prefixes import PrefixSpec, hashes_column, spec_hashes
from servelab.traces.synth import SynthConfig, generate

PCTS = (("min", 0.0), ("p0.1", 0.1), ("p1", 1), ("p5", 5), ("p10", 10), ("p25", 25), ("median", 50), ("p75", 75),
        ("p90", 90), ("p95", 95), ("p99", 99), ("p99.9", 99.9), ("max", 100))
CLIENT_TIMEOUT_S = 300.0  # aiohttp ClientTimeout(total=300), inference-perf's default; see the docstring
BLOCK = 16
ASSUMED_VLLM = "0.11"  # no version is recorded anywhere in the data set; any >= 0.9 gives the same defaults


def quantile_fn(dist: dict):
    """The inverse CDF through a summary's percentile points (linear between them)."""
    qs = np.array([q for _, q in PCTS]) / 100
    vs = np.array([float(dist[k]) for k, _ in PCTS])
    return lambda u: np.interp(u, qs, vs)


def stage_files(exp: Path) -> list[dict]:
    out, i = [], 0
    while (p := exp / "results" / f"stage_{i}_lifecycle_metrics.json").is_file():
        out.append(json.loads(p.read_text()))
        i += 1
    return out


def build_trace(cfg: dict, stages_m: list[dict], seed: int = 0, arrivals: str = "constant") -> tuple[pa.Table, dict]:
    shared = cfg["data"]["shared_prefix"]
    sys_len, q_len, out_len = int(shared["system_prompt_len"]), int(shared["question_len"]), int(shared["output_len"])
    groups, per = int(shared.get("num_groups") or 1), int(shared.get("num_prompts_per_group") or 1)
    pool = groups * per
    load = cfg["load"]
    assert load.get("type", "constant") == "constant", load.get("type")
    rates = [float(s["rate"]) for s in load["stages"]]
    durs = [float(s["duration"]) for s in load["stages"]]
    counts = [int(round(r * d)) for r, d in zip(rates, durs)]
    starts = np.concatenate([[0.0], np.cumsum(durs)[:-1]])
    # one pool for all stages: the measured prompt_len percentiles, weighted by each stage's successes
    w = np.array([m["successes"]["count"] for m in stages_m], float)
    u = (np.arange(pool) + 0.5) / pool
    lengths = sum(wi * quantile_fn(m["successes"]["prompt_len"])(u) for wi, m in zip(w, stages_m)) / w.sum()
    lengths = np.rint(lengths).astype(np.int64)
    np.random.default_rng(seed).shuffle(lengths)  # the generator's prompts are not sorted by length
    mean_measured = float(sum(wi * m["successes"]["prompt_len"]["mean"] for wi, m in zip(w, stages_m)) / w.sum())
    factor = mean_measured / (sys_len + q_len)
    prefix = int(round(sys_len * factor))
    n = sum(counts)
    schedule = tuple((float(s), r) for s, r in zip(starts, rates))
    synth = SynthConfig(n=n, arrival=arrivals, rate=rates[0], profile="piecewise" if len(rates) > 1 else "flat",
                        schedule=schedule if len(rates) > 1 else (), prompt=_fixed(q_len), output=_fixed(out_len),
                        shared_prefix_tokens=prefix, prefix_groups=groups, prompt_pool=pool,
                        prefix_block_tokens=BLOCK, model=cfg["server"]["model_name"], seed=seed)
    trace = generate(synth)
    prompt = lengths[np.arange(n) % pool]
    spec = PrefixSpec(prefix, groups, pool, origin="config.yaml")
    trace = trace.set_column(trace.column_names.index("prompt_tokens"), "prompt_tokens", pa.array(prompt.astype(np.int32)))
    trace = trace.set_column(trace.column_names.index("prefix_hashes"), "prefix_hashes",
                             hashes_column(spec_hashes(prompt, spec, BLOCK)))
    arrival = trace.column("arrival_s").to_numpy()
    bounds = np.concatenate([starts, [starts[-1] + durs[-1]]])
    got = np.histogram(arrival, bounds)[0].tolist()
    if arrivals == "constant":
        assert got == counts, (got, counts)  # each stage sent rate x duration requests, as measured (load_summary.count)
    info = {"rates": rates, "counts": counts, "bounds": bounds.tolist(), "out_len": out_len, "pool": pool,
            "groups": groups, "prefix_tokens": prefix, "retokenise_factor": factor,
            "trace_prompt_mean": float(prompt.mean()), "measured_prompt_mean": mean_measured}
    return trace, info


def _fixed(n: int):
    from servelab.traces.lengths import LengthDist

    return LengthDist("fixed", n)


def engine_settings(exp: Path, model: str, gpu: str, mode: str) -> tuple[dict, str]:
    """Batch limits and max_model_len: exp-config.yaml where the folder has one (or, with mode
    exp-config-all, the shared exp-config of the data set), else vLLM's defaults (fidelity/vllm_defaults.py)."""
    path = exp / "exp-config.yaml"
    if path.is_file() or mode == "exp-config-all":
        src = path if path.is_file() else next(  # the same model's exp-config (its TP); the limits are alike in all
            p for p in sorted(exp.parent.glob("*/exp-config.yaml")) if find_model(read_yaml(p)["model"]).name == model)
        data = read_yaml(src)
        return ({"max_num_seqs": int(data["max_num_seqs"]), "max_num_batched_tokens": int(data["max_num_batched_tokens"]),
                 "max_model_len": int(data["max_model_len"]), "tp": int(data["tensor_parallelism"])},
                "exp-config" if src == path else f"exp-config of {src.parent.name}")
    values, _ = batch_defaults(ASSUMED_VLLM, gpu)
    tp = int(re.search(r"-tp(\d+)-", exp.name).group(1))
    return {**values, "max_model_len": None, "tp": tp}, f"vLLM>=0.9 defaults ({ASSUMED_VLLM} assumed)"


def run_experiment(exp: Path, mode: str, gpu: str = "h100-80gb", async_scheduling: bool = False,
                   arrivals: str = "constant") -> list[dict]:
    cfg = read_yaml(exp / "results" / "config.yaml")
    stages_m = stage_files(exp)
    trace, info = build_trace(cfg, stages_m, arrivals=arrivals)
    preset = find_model(cfg["server"]["model_name"]).name
    eng, origin = engine_settings(exp, preset, gpu, mode)
    engine = EngineConfig(max_num_seqs=eng["max_num_seqs"], max_num_batched_tokens=eng["max_num_batched_tokens"],
                          max_model_len=eng["max_model_len"], client_timeout_s=CLIENT_TIMEOUT_S, enable_prefix_caching=True,
                          async_scheduling=async_scheduling)
    config = ReplayConfig(engine=engine, policy="sarathi", runner="roofline", model=preset, gpu=gpu, tp=eng["tp"])
    runner = build_runner(config)
    blocks = resolve_num_gpu_blocks(config, runner)
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, num_gpu_blocks=blocks))
    cluster = build_cluster(config, runner, trace_block_tokens(trace))
    result = replay(trace, config, runner=runner, token_log=True, cluster=cluster)
    model = cm.resolve("vllm")
    tokens = result.tokens.read() if hasattr(result.tokens, "read") else result.tokens
    req = cm.with_client_columns(result.requests, model, tokens)
    col = lambda name: np.asarray(req.column(name).to_numpy(zero_copy_only=False), dtype=float)  # noqa: E731
    arrival, status = col("arrival_s"), np.asarray(req.column("status").to_pylist())
    ttft_e, e2e_e, ttft_c, e2e_c = col("ttft_s"), col("e2e_s"), col("client_ttft_s"), col("client_e2e_s")
    out_n = col("output_tokens")
    rows = []
    for s, m in enumerate(stages_m):
        lo, hi = info["bounds"][s], info["bounds"][s + 1]
        sel = (arrival >= lo) & (arrival < hi)
        ok = sel & (status == "finished")
        lat = m["successes"]["latency"]
        meas = {"ttft": lat["time_to_first_token"]["mean"], "e2e": lat["request_latency"]["mean"],
                "tpot_ip": lat["time_per_output_token"]["mean"]}
        meas["tpot"] = (meas["e2e"] - meas["ttft"]) / (info["out_len"] - 1)
        def sim(ttft, e2e):
            return {"ttft": float(np.mean(ttft[ok])), "e2e": float(np.mean(e2e[ok])),
                    "tpot": float(np.mean((e2e[ok] - ttft[ok]) / (out_n[ok] - 1)))}
        client, server = sim(ttft_c, e2e_c), sim(ttft_e, e2e_e)
        rows.append({
            "experiment": exp.name, "stage": s, "rate": info["rates"][s], "model": preset, "tp": eng["tp"],
            "settings": origin, "max_num_seqs": eng["max_num_seqs"], "max_num_batched_tokens": eng["max_num_batched_tokens"],
            "num_gpu_blocks": int(blocks), "measured": meas, "sim_client": client, "sim_server": server,
            "err": {k: client[k] / meas[k] - 1 for k in ("ttft", "tpot", "e2e")},
            "err_server": {k: server[k] / meas[k] - 1 for k in ("ttft", "tpot", "e2e")},
            "ok_measured": int(m["successes"]["count"]), "failed_measured": int(m["failures"]["count"]),
            "ok_sim": int(ok.sum()), "failed_sim": int(sel.sum() - ok.sum()),
            "prompt_mean_measured": m["successes"]["prompt_len"]["mean"], "prompt_mean_trace": info["trace_prompt_mean"],
            "prefix_tokens": info["prefix_tokens"], "client_outlen_mean": m["successes"]["output_len"]["mean"],
            "out_len": info["out_len"],
        })
    return rows


def pct(x: float) -> str:
    return f"{x * 100:+6.1f}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--settings", choices=("exp-config-or-default", "exp-config-all"), default="exp-config-or-default")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", default="", help="substring of the experiment names to run")
    ap.add_argument("--arrivals", choices=("constant", "poisson"), default="constant",
                    help="the sends' process within each stage (config.yaml says constant; inference-sim/training's "
                         "replay_data of these runs records irregular sends, closer to poisson)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="replay with vLLM's async scheduling (its default since 0.14; the runs record no version)")
    args = ap.parse_args(argv)
    rows = []
    for exp in sorted(p for p in args.data.iterdir() if (p / "results" / "config.yaml").is_file()):
        if args.only and args.only not in exp.name:
            continue
        rows += run_experiment(exp, args.settings, args.gpu, args.async_scheduling, args.arrivals)
    head = (f"{'experiment':46} st {'rate':>4} {'TTFT ms':>8} {'TPOTip':>7} {'TPOT ms':>7} {'E2E s':>7} | "
            f"{'eTTFT':>7} {'eTPOT':>7} {'eE2E':>7} | {'srv eTTFT':>9} {'eTPOT':>7} {'eE2E':>7} | ok/fail meas sim | seqs/mbt")
    print(head)
    for r in rows:
        m, e, es = r["measured"], r["err"], r["err_server"]
        print(f"{r['experiment'][16:62]:46} {r['stage']:2d} {r['rate']:4.0f} {m['ttft'] * 1e3:8.1f} {m['tpot_ip'] * 1e3:7.2f} "
              f"{m['tpot'] * 1e3:7.2f} {m['e2e']:7.2f} | {pct(e['ttft'])} {pct(e['tpot'])} {pct(e['e2e'])} | "
              f"{pct(es['ttft']):>9} {pct(es['tpot'])} {pct(es['e2e'])} | "
              f"{r['ok_measured']}/{r['failed_measured']} {r['ok_sim']}/{r['failed_sim']} | {r['max_num_seqs']}/{r['max_num_batched_tokens']}")
    for side in ("err", "err_server"):
        allerr = np.array([[abs(r[side][k]) for k in ("ttft", "tpot", "e2e")] for r in rows])
        within = int((allerr.max(axis=1) <= 0.15).sum())
        print(f"{'client-side' if side == 'err' else 'engine-side'}: median |error| TTFT {np.median(allerr[:, 0]):.1%}, "
              f"TPOT {np.median(allerr[:, 1]):.1%}, E2E {np.median(allerr[:, 2]):.1%}, all {np.median(allerr):.1%}; "
              f"rows with all three within 15%: {within}/{len(rows)}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
