"""One prepared check of the `torch` runner on a GPU: correctness, decode vs the bandwidth floor, profile, fit, validate.

Run on a machine with an H200, from the repository root (the whole check fits a 10-minute slot):

    python3 bench/gpu_check.py --out "$OUT" --budget-s 480

and on a CPU, as a smoke test of the same code path:

    .venv/bin/python bench/gpu_check.py --model tiny --device cpu --quick --out /tmp/gpu-check

Phases, each recorded in ``<out>/gpu_check.json`` as soon as it ends (a later crash or timeout
keeps the earlier results): ``env``; ``correctness`` (chunked prefill mixed with decodes through
each attention path vs a plain full-sequence forward); ``decode`` (step time of decode batches
against the floor ``(weight bytes + KV bytes read) / HBM bandwidth``); ``prefill`` (one large chunk
against the FLOP floor); ``profile`` (``servelab.runners.profiling.profile`` sweep); ``fit``
(``servelab.runners.fitted``); ``validate`` (``servelab.runners.validation.validate`` on a slice
of the Azure 2023 conversation trace, torch as the reference, the fitted model and the roofline as
candidates). A phase that would not finish inside ``--budget-s`` is skipped and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AZURE_CSV = Path("traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv")


def ensure_servelab() -> None:
    """Make ``import servelab`` work from a plain checkout (the GPU machine has no editable install)."""
    try:
        import servelab  # noqa: F401
    except ModuleNotFoundError:
        link_dir = Path(tempfile.mkdtemp(prefix="servelab-path-"))
        (link_dir / "servelab").symlink_to(REPO, target_is_directory=True)
        sys.path.insert(0, str(link_dir))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_check.json, profile.parquet, fitted.json, validate_*.json")
    p.add_argument("--model", default="llama-3.1-8b", help="model preset (default llama-3.1-8b)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (default cuda)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV block tokens (default: 256 where paged FlashAttention exists, else 16)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (cpu only)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop starting phases after this many seconds")
    p.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth for the floor, TB/s (H200: 4.8)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for the prefill floor (H200: 989)")
    p.add_argument("--gpu-preset", default="h200", help="GPU preset for the roofline candidate")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="512,2048", help="KV tokens per decoding request")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per decode shape (median reported)")
    p.add_argument("--grid", default=None, help="profile grid: default or small (default: default on cuda)")
    p.add_argument("--trace", default=None, help="servelab trace (.parquet/.arrow) or the Azure conv CSV")
    p.add_argument("--duration-s", type=float, default=120.0, help="trace slice replayed by validate")
    p.add_argument("--limit", type=int, default=None, help="at most this many requests in the slice")
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="engine token budget for validate")
    p.add_argument("--quick", action="store_true", help="tiny shapes everywhere (CPU smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch_sizes, args.contexts, args.repeats = "1,4", "32,64", 2
        args.grid = args.grid or "small"
        args.limit = args.limit or 12
        args.max_batched_tokens = min(args.max_batched_tokens, 256)
    return args


class Check:
    """Runs phases under a shared time budget and keeps ``gpu_check.json`` current after each."""

    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.results: dict = {"phases": {}, "started_unix_s": time.time()}

    def remaining_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def phase(self, name: str, fn, min_s: float = 0.0) -> dict | None:
        if self.remaining_s() < min_s:
            self.results["phases"][name] = {"status": "skipped", "reason": f"budget: {self.remaining_s():.0f} s left, needs ~{min_s:.0f}"}
            self.save()
            print(f"[{name}] skipped (budget)", flush=True)
            return None
        print(f"[{name}] ...", flush=True)
        t = time.perf_counter()
        try:
            data = fn()
            entry = {"status": "ok", **(data or {})}
        except Exception as err:  # a failed phase must not lose the others
            entry = {"status": "error", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        entry["seconds"] = round(time.perf_counter() - t, 3)
        self.results["phases"][name] = entry
        self.save()
        summary = {k: v for k, v in entry.items() if k in ("status", "error", "seconds", "summary", "pass")}
        print(f"[{name}] {json.dumps(summary, default=str)}", flush=True)
        return entry

    def save(self) -> None:
        from servelab.common.atomic import atomic_path

        self.results["elapsed_s"] = round(time.perf_counter() - self.t0, 3)
        with atomic_path(self.out / "gpu_check.json") as tmp:
            tmp.write_text(json.dumps(self.results, indent=2, default=str) + "\n")


# ---- phases ----------------------------------------------------------------------------------------


def env_info(runner) -> dict:
    import torch

    from servelab.runners.torch_model import varlen_api

    info = {"python": platform.python_version(), "torch": torch.__version__, "device": runner.device,
            "varlen_api": varlen_api(), "varlen_probe": runner.varlen_probe, "attention": runner.attention, "block_size": runner.block_size,
            "num_blocks": runner.total_blocks, "kv_capacity_tokens": runner.kv_capacity_tokens(),
            "weight_bytes": runner.args.num_params * runner._torch_dtype.itemsize,
            "kv_bytes_per_token": runner.kv_bytes_per_token}
    if runner.is_cuda:
        free, total = torch.cuda.mem_get_info(runner.device)
        info.update(gpu=torch.cuda.get_device_name(runner.device), memory_free_gib=free / 2**30,
                    memory_total_gib=total / 2**30)
    return info


def kinds_to_check(runner) -> list[str]:
    works = {name for name, err in runner.varlen_probe.items() if err is None}
    kinds = ["sdpa"]
    if "packed" in works:
        kinds.insert(0, "gather")
    if "paged" in works and runner.block_size % 256 == 0:
        kinds.insert(0, "paged")
    return kinds


def use_variant(runner, kind: str, graphs: bool) -> None:
    """Point the runner at one attention path, with or without graphed decode steps (check-only switch)."""
    from servelab.runners.torch_runner import DecodeGraphs

    runner.attention = kind
    runner._graphs = DecodeGraphs(runner, 256) if graphs else None


def variants(runner, kinds: list[str]) -> list[tuple[str, bool]]:
    out = [(k, False) for k in kinds]
    graph_kind = "paged" if "paged" in kinds else "sdpa"
    out.append((graph_kind, True))  # on CPU: the padded layout without capture
    return out


def compare(got, ref, bf16: bool) -> dict:
    """Logit rows vs the reference. float32 (CPU): near-exact. bf16 through every layer: random weights
    give near-flat logits whose argmax flips on rounding, so the verdict is the rows' cosine similarity."""
    import torch

    diff = (got - ref).abs()
    cosine = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item()
    return {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "logit_std": ref.std().item(),
            "min_row_cosine": cosine, "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "pass": bool(cosine >= 0.98 if bf16 else diff.max().item() < 1e-3)}


def graph_correctness(runner, allocator) -> dict:
    """Decode steps through the graphed path (padded batch) vs forward_dense at the same positions."""
    import numpy as np
    import torch

    from servelab.runners.paged_kv import synthetic_token_ids

    bs = runner.block_size
    reqs = [fake(2_000_000 + i, 40 + 17 * i) for i in range(3)]
    for r in reqs:
        r.block_table = allocator.allocate(-(-(r.prompt_tokens + 4) // bs))
    try:
        runner.step_time(plan_of([(r, 0, r.prompt_tokens) for r in reqs]))
        rows: dict[int, list] = {r.request_id: [] for r in reqs}
        for step in range(4):
            runner.step_time(plan_of([(r, r.prompt_tokens + step, 1) for r in reqs]))
            if runner._graphs.disabled:  # capture failed: the runner fell back to eager steps
                return {"pass": False, "graphs": runner._graphs.describe()}
            entry = runner._graphs.last_entry
            logits = entry["outputs"][0].float()
            for i, r in enumerate(reqs):
                rows[r.request_id].append(logits[i].clone())
        report, ok = {}, True
        for r in reqs:
            total = r.prompt_tokens + 4
            ids = synthetic_token_ids(np.full(total, r.request_id), np.arange(total), runner.args.vocab_size)
            ref = runner.model.forward_dense(torch.from_numpy(ids).to(runner.device)).float()[r.prompt_tokens:]
            entry = compare(torch.stack(rows[r.request_id]), ref, runner.dtype != "float32")
            report[str(r.request_id)] = entry
            ok &= entry["pass"]
    finally:
        for r in reqs:
            allocator.free(r.block_table)
    return {"pass": bool(ok), "graphs": runner._graphs.describe(), "requests": report}


def fake(request_id: int, prompt_tokens: int):
    from types import SimpleNamespace

    return SimpleNamespace(request_id=request_id, prompt_tokens=prompt_tokens, block_table=[])


def plan_of(items):
    from servelab.runners.base import StepItem, StepPlan, StepShape

    return StepPlan(StepShape(), tuple(StepItem(r, s, n) for r, s, n in items))


def correctness(runner, allocator, kinds: list[str]) -> dict:
    """Chunked prefill mixed with another request's decodes, through each attention path, vs forward_dense."""
    import numpy as np
    import torch

    from servelab.runners.paged_kv import synthetic_token_ids

    bs = runner.block_size
    length = 300 if runner.is_cuda else 40
    chunk = 128 if runner.is_cuda else 16
    out = {}
    ok = True
    for kind in kinds:
        use_variant(runner, kind, False)
        a, b = fake(1_000_001, length), fake(1_000_002, 8)
        steps, start = [], 0
        b_done = 0
        while start < length + 2:  # a: chunks, then two decodes; b rides along with a prefill then decodes
            n = min(chunk, length - start) if start < length else 1
            step = [(a, start, n)]
            step.append((b, 0, 8) if b_done == 0 else (b, 7 + b_done, 1))
            b_done += 1
            steps.append(step)
            start += n
        rows: dict[int, list] = {1_000_001: [], 1_000_002: []}
        for step in steps:
            for req, s, n in step:
                need = -(-(s + n) // bs) - len(req.block_table)
                req.block_table += allocator.allocate(max(0, need))
            logits = runner.execute(plan_of(step), all_logits=True).float()
            r = 0
            for req, _s, n in step:
                rows[req.request_id].append(logits[r:r + n])
                r += n
        report = {}
        for req, total in ((a, length + 2), (b, 8 + len(steps) - 1)):
            ids = synthetic_token_ids(np.full(total, req.request_id), np.arange(total), runner.args.vocab_size)
            ref = runner.model.forward_dense(torch.from_numpy(ids).to(runner.device)).float()
            got = torch.cat(rows[req.request_id])
            entry = compare(got, ref, runner.dtype != "float32")
            report[str(req.request_id)] = {"tokens": total, **entry}
            ok &= entry["pass"]
            allocator.free(req.block_table)
            req.block_table = []
        out[kind] = report
    graph_kind = variants(runner, kinds)[-1][0]
    use_variant(runner, graph_kind, True)
    try:
        graphed = graph_correctness(runner, allocator)
    finally:
        use_variant(runner, graph_kind, False)
    out[f"{graph_kind}+graphs"] = graphed
    return {"pass": bool(ok and graphed["pass"]), "kinds": out}


def decode_timing(runner, allocator, kinds: list[str], batch_sizes: list[int], contexts: list[int], repeats: int,
                  hbm_bytes_per_s: float, check: Check) -> dict:
    """Median step time of decode batches vs (weights + KV read) / HBM bandwidth."""
    a = runner.args
    # a decode reads every weight once, except the embedding table, of which it reads one row per request
    embedding = 0 if a.tied_embeddings else a.vocab_size * a.hidden_size
    weight_bytes = (a.num_params - embedding) * runner._torch_dtype.itemsize
    bs = runner.block_size
    rows = []
    for kind, graphs in variants(runner, kinds):
        use_variant(runner, kind, graphs)
        label = kind + ("+graphs" if graphs else "")
        for ctx in contexts:
            for n in batch_sizes:
                if check.remaining_s() < 60:
                    rows.append({"attention": label, "batch": n, "context": ctx, "skipped": "budget"})
                    continue
                blocks = n * -(-ctx // bs)
                if blocks > allocator.num_free:
                    rows.append({"attention": label, "batch": n, "context": ctx, "skipped": f"needs {blocks} KV blocks"})
                    continue
                reqs = [fake(10_000 + i, ctx - 1) for i in range(n)]
                for r in reqs:
                    r.block_table = allocator.allocate(-(-ctx // bs))
                plan = plan_of([(r, ctx - 1, 1) for r in reqs])  # KV values do not change the time
                try:
                    for _ in range(2):
                        runner.step_time(plan)
                    times, launches = [], []
                    for _ in range(repeats):
                        times.append(runner.step_time(plan))
                        launches.append(runner.last_stats.launch_s)
                finally:
                    for r in reqs:
                        allocator.free(r.block_table)
                step_s = statistics.median(times)
                floor_s = (weight_bytes + n * ctx * runner.kv_bytes_per_token) / hbm_bytes_per_s
                rows.append({"attention": label, "batch": n, "context": ctx, "step_ms": step_s * 1e3,
                             "floor_ms": floor_s * 1e3, "ratio_to_floor": step_s / floor_s,
                             "host_launch_ms": statistics.median(launches) * 1e3,
                             "graph_disabled": runner._graphs.disabled if runner._graphs is not None else None,
                             "achieved_tb_s": (weight_bytes + n * ctx * runner.kv_bytes_per_token) / step_s / 1e12})
                print(f"  decode {label:13} B={n:4} ctx={ctx:5}: {step_s * 1e3:8.3f} ms, floor {floor_s * 1e3:7.3f} ms, "
                      f"x{step_s / floor_s:5.2f}, host launch {statistics.median(launches) * 1e3:6.2f} ms", flush=True)
    best = {}
    for r in rows:
        if "ratio_to_floor" in r:
            key = f"B={r['batch']},ctx={r['context']}"
            best[key] = min(best.get(key, math.inf), r["ratio_to_floor"])
    worst_best = max(best.values()) if best else None
    use_variant(runner, kinds[0], False)
    # the floor is the GPU's: on a CPU the ratio means nothing, so there is no verdict
    verdict = (worst_best is not None and worst_best <= 2.0) if runner.is_cuda else None
    return {"rows": rows, "best_ratio_by_shape": best, "pass": verdict,
            "summary": f"worst shape's best path: x{worst_best:.2f} of the bandwidth floor" if worst_best else "no shape timed"}


def prefill_timing(runner, allocator, chunk: int, peak_flops: float) -> dict:
    req = fake(20_000, chunk)
    req.block_table = allocator.allocate(-(-chunk // runner.block_size))
    try:
        plan = plan_of([(req, 0, chunk)])
        runner.step_time(plan)
        times = [runner.step_time(plan) for _ in range(3)]
    finally:
        allocator.free(req.block_table)
    step_s = statistics.median(times)
    flops = 2 * runner.args.num_params * chunk  # the GEMMs; causal attention adds ~7% at 4096 tokens
    return {"chunk": chunk, "step_ms": step_s * 1e3, "flop_floor_ms": flops / peak_flops * 1e3,
            "mfu": flops / peak_flops / step_s, "summary": f"{chunk}-token chunk {step_s * 1e3:.1f} ms"}


def run_profile(runner, spec: str, grid_name: str, out: Path, model: str, gpu: str) -> dict:
    from servelab.runners.profiling import GRIDS, profile

    table = profile(runner, out / "profile.parquet", spec=spec, grid=GRIDS[grid_name], repeats=2, warmup=1,
                    context={"model": model, "gpu": gpu, "tp": 1})
    return {"rows": table.num_rows, "grid": grid_name, "summary": f"{table.num_rows} timed steps"}


def run_fit(out: Path) -> dict:
    from servelab.runners.fitted import fit_profile

    model = fit_profile(out / "profile.parquet", out / "fitted.json")
    fit = model.metadata["fit"]
    test = fit.get("test", fit["train"])
    return {"fit": fit, "summary": f"held-out MAPE {test['mape_pct']:.2f}%"}


def load_trace(path: Path):
    """A servelab trace file, or the Azure CSV (via the importer, or pyarrow alone where polars is missing)."""
    from servelab.traces.io import read_trace

    if path.suffix in (".parquet", ".arrow"):
        return read_trace(path)
    try:
        from servelab.traces.importers import import_trace

        return import_trace("azure", [path]).table
    except ModuleNotFoundError:
        import numpy as np
        import pyarrow as pa
        import pyarrow.csv as pcsv

        from servelab.traces import schema
        from servelab.traces.io import prepare

        raw = pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(column_types={"TIMESTAMP": pa.string()}))
        ts = np.array(raw.column("TIMESTAMP").to_pylist(), dtype="datetime64[ns]")
        order = np.argsort(ts, kind="stable")
        arrival = (ts[order] - ts[order][0]).astype(np.int64) / 1e9
        table = pa.table({"request_id": np.arange(len(ts), dtype=np.int64), "arrival_s": arrival,
                          "prompt_tokens": raw.column("ContextTokens").to_numpy()[order].astype(np.int32),
                          "output_tokens": raw.column("GeneratedTokens").to_numpy()[order].astype(np.int32)})
        keep = (table.column("prompt_tokens").to_numpy() > 0) & (table.column("output_tokens").to_numpy() > 0)
        return schema.with_defaults(prepare(table.filter(pa.array(keep)), path, "azure"))


def find_trace(given: str | None) -> Path:
    if given:
        return Path(given)
    for candidate in (REPO / ".gpu" / "azure_conv.parquet", REPO / "shared" / AZURE_CSV, REPO.parent / "shared" / AZURE_CSV):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("no trace: pass --trace (servelab trace or the Azure conv CSV), or put one at .gpu/azure_conv.parquet")


def run_validate(runner, spec: str, args, out: Path, check: Check) -> dict:
    from dataclasses import replace

    from servelab.replay.config import EngineConfig, ReplayConfig
    from servelab.runners.base import make_runner
    from servelab.runners.validation import slice_trace, validate, write_report

    trace_path = find_trace(args.trace)
    trace = slice_trace(load_trace(trace_path), limit=args.limit, duration_s=args.duration_s)
    engine = EngineConfig(block_size=runner.block_size, max_num_batched_tokens=args.max_batched_tokens)
    config = ReplayConfig(engine=engine, runner=spec, model=args.model, gpu=args.gpu_preset)
    results = {"trace": str(trace_path), "requests": trace.num_rows}
    candidates = []
    if (out / "fitted.json").is_file():  # absent when the fit phase failed
        candidates.append(("fitted", f"fitted:{out / 'fitted.json'}"))
    candidates.append(("roofline", f"roofline:model={args.model},gpu={args.gpu_preset}"))
    first_s = None
    for label, cand_spec in candidates:
        if first_s is not None and check.remaining_s() < 1.3 * first_s:
            results[label] = {"skipped": "budget"}
            continue
        t = time.perf_counter()
        candidate = make_runner(cand_spec, model=args.model, gpu=args.gpu_preset, tp=1)
        report = validate(trace, replace(config), runner, candidate, reference_spec=spec, candidate_spec=cand_spec)
        write_report(report, out / f"validate_{label}.json")
        results[label] = {"step_time": report["step_time"], "latency": report["latency"],
                          "finished": report["finished"], "num_gpu_blocks": report["num_gpu_blocks"]}
        first_s = first_s or (time.perf_counter() - t)
    mapes = [f"{label} step MAPE {results[label]['step_time']['mape_pct']:.2f}%"
             for label, _ in candidates if "step_time" in results.get(label, {})]
    results["summary"] = f"{trace.num_rows} requests; " + ("; ".join(mapes) or "no candidate priced")
    return results


# ---- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_servelab()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.budget_s)

    def on_alarm(_signum, _frame):
        raise TimeoutError(f"gpu_check: over the {args.budget_s:.0f} s budget")

    if hasattr(signal, "SIGALRM"):  # a phase that runs long is cut off, recorded, and the rest skipped
        signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(int(args.budget_s) + 30)

    from servelab.runners.torch_model import ModelArgs, probe_varlen
    from servelab.runners.torch_runner import TorchRunner

    on_cuda = args.device.startswith("cuda")
    block_size = args.block_size
    if block_size is None:  # 256-token blocks where paged FlashAttention works here, else vLLM's 16
        import torch

        paged_ok = on_cuda and probe_varlen(ModelArgs.from_name(args.model), torch.bfloat16, args.device)["paged"] is None
        block_size = 256 if paged_ok else 16
    spec_parts = [f"model={args.model}", f"device={args.device}", f"block_size={block_size}"]
    if args.dtype:
        spec_parts.append(f"dtype={args.dtype}")
    if args.threads:
        spec_parts.append(f"threads={args.threads}")
    spec = "torch:" + ",".join(spec_parts)
    built = {}

    def build():
        t = time.perf_counter()
        built["runner"] = TorchRunner(model_name=args.model, device=args.device, dtype=args.dtype,
                                      block_size=block_size, threads=args.threads)
        built["allocator"] = built["runner"].make_allocator(0, built["runner"].total_blocks)
        return {"build_s": time.perf_counter() - t, **env_info(built["runner"])}

    if check.phase("env", build) is None or "runner" not in built:
        return 1
    runner, allocator = built["runner"], built["allocator"]
    chosen = runner.attention
    kinds = kinds_to_check(runner)
    check.phase("correctness", lambda: correctness(runner, allocator, kinds), min_s=20)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    check.phase("decode", lambda: decode_timing(runner, allocator, kinds, batch_sizes, contexts, args.repeats,
                                                args.hbm_tb_s * 1e12, check), min_s=60)
    use_variant(runner, chosen, False)
    check.phase("prefill", lambda: prefill_timing(runner, allocator, 64 if args.quick else 4096,
                                                  args.peak_tflops * 1e12), min_s=20)
    grid = args.grid or ("default" if on_cuda else "small")
    profiled = check.phase("profile", lambda: run_profile(runner, spec, grid, out, args.model, args.gpu_preset),
                           min_s=90 if on_cuda else 5)
    if profiled and profiled["status"] == "ok":
        check.phase("fit", lambda: run_fit(out))
    # validate even without a fit (e.g. an image without polars): the roofline is a candidate too
    check.phase("validate", lambda: run_validate(runner, spec, args, out, check), min_s=60 if on_cuda else 5)
    if hasattr(signal, "SIGALRM"):
        signal.alarm(0)
    check.results["runner"] = runner.describe()
    check.save()
    statuses = {k: v["status"] for k, v in check.results["phases"].items()}
    print(f"wrote {out / 'gpu_check.json'}: {statuses}", flush=True)
    return 0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
