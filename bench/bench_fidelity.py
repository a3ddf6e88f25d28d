"""The fidelity tables: every real run we have, measured vs simulated.

    python bench/bench_fidelity.py [--shared ../shared] [-o table.md]      # per-run variant tables
    python bench/bench_fidelity.py --scoreboard [--write-docs]             # one row per run

Imports the real runs in ``shared/calibration/real_vllm`` (and, for the scoreboard, those bundled in
``bench/real_runs``, which a fresh clone has) into a temporary folder with
``servelab run import`` (the exact commands are printed), replays each with ``validate --real``.
The default prints one markdown table per run and variant (before/after calibration, for
bench/RESULTS_fidelity.md). ``--scoreboard`` finds every run folder (format detected, settings from
the run's own files; only the GPU, which no file records, comes from ``GPUS``), replays each with
the shipped defaults and prints one table: mean and p99 error of TTFT, TPOT and E2E, the
prefix-cache hit share (server log, simulated), the failed-request share; ``--write-docs``
replaces the table in docs/fidelity.md (between the scoreboard markers).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

SERVELAB = [sys.executable, "-m", "servelab"]
RUNS = {
    "vllm-0.11-h100-llama2-7b (unsaturated, server-side OTel spans)": (
        ["--format", "otel", "{d}/vllm-0.11-h100-llama2-7b/traces.json",
         "--vllm-log", "{d}/vllm-0.11-h100-llama2-7b/vllm.log", "--setting", "gpu=h100-80gb"],
        [("before: roofline:host=vidur-2023", ["--candidate", "roofline:host=vidur-2023"]),
         ("after: roofline (defaults)", [])]),
    "vllm-0.19-rtx4090-llama31-8b (KV-saturated, server-side timestamps)": (
        ["--format", "timestamps-jsonl", "{d}/vllm-0.19-rtx4090-llama31-8b/requests.jsonl",
         "--setting", "gpu=rtx-4090"],
        [("before: roofline:host=vidur-2023,calibration=a40", ["--candidate",
                                                                "roofline:host=vidur-2023,calibration=a40"]),
         ("held-out GPU: host profile fitted on the H100 only (calibration=a40)",
          ["--candidate", "roofline:calibration=a40"]),
         ("after: roofline (defaults), derived KV", []),
         ("after: roofline (defaults), 2,588 blocks (sibling run's log)", ["--num-gpu-blocks", "2588"])]),
}


# What each run folder's files do not record, given as a user would (see each folder's README): the GPU
# (DeepSeek's meta.json names its own; its model, a 16-layer, 64-expert cut of DeepSeek-V3.2-Exp that no
# preset has, comes from the Hugging Face config.json beside it), the model of the one run without a meta.json.
SETTINGS = {"vllm-0.11-h100-llama2-7b": ["gpu=h100-80gb"], "vllm-0.19-rtx4090-llama31-8b": ["gpu=rtx-4090"],
            "jan20-codellama-prefill-1": ["gpu=h100-80gb"], "jan20-codellama-train-1": ["gpu=h100-80gb"],
            "jan20-prefill-llama7b-tp1-1": ["gpu=h100-80gb"],
            "llmservingsim-rtx4090-llama31-8b-examples": ["model=meta-llama/Llama-3.1-8B", "gpu=rtx-4090"],
            "llmservingsim-rtxpro6000-llama31-8b": ["gpu=rtx-pro-6000"],
            "llmservingsim-rtxpro6000-qwen3-32b": ["gpu=rtx-pro-6000"],
            "llmservingsim-rtxpro6000-qwen3-30b-a3b": ["gpu=rtx-pro-6000"]}
BUNDLED = Path(__file__).resolve().parent / "real_runs"
SOURCES = ("traces.json", "requests.jsonl", "trace.yaml", "report.json", "results.json",
           "per_request_lifecycle_metrics.json")
MARK_BEGIN, MARK_END = "<!-- scoreboard: begin -->", "<!-- scoreboard: end -->"


def run(args: list[str]) -> str:
    print("$ servelab " + " ".join(shlex.quote(a) for a in args), file=sys.stderr)
    out = subprocess.run(SERVELAB + args, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(out.stderr)
    return out.stdout


def _stat(report: dict, metric: str, stat: str) -> str:
    row = next(r for r in report["latency"] if r["metric"] == metric and r["stat"] == stat)
    return "n/a" if row["error_pct"] is None else f"{row['error_pct']:+.1f}%"


def _share(v) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def scoreboard(roots: dict[str, Path]) -> tuple[list[str], list[str]]:
    """(table lines, the commands run): every run folder under each root (name shown in the commands ->
    folder; a missing folder is skipped) with a per-request file."""
    commands, rows = [], []
    folders = sorted((p, shown_as, root) for shown_as, root in roots.items() if root.is_dir()
                     for p in root.iterdir() if p.is_dir())
    with tempfile.TemporaryDirectory() as tmp:
        for folder, shown_as, data in folders:
            source = next((folder / name for name in SOURCES if (folder / name).is_file()), None)
            if source is None:
                continue
            src = folder if source.name == "trace.yaml" else source
            run_dir = Path(tmp) / folder.name
            args = ["run", "import", str(src), "-o", str(run_dir)]
            for setting in SETTINGS.get(folder.name, []):
                args += ["--setting", setting]
            run(args)
            report = json.loads(run(["validate", "--real", str(run_dir), "--format", "json"]))
            shown = " ".join(shlex.quote(a) for a in args)
            shown = shown.replace(str(data), shown_as).replace(str(run_dir), f"runs/{folder.name}")
            commands += [f"servelab {shown}", f"servelab validate --real runs/{folder.name}"]
            meta = json.loads((run_dir / "run.json").read_text())
            counts = meta["counts"]
            failed = 1 - counts.get("finished", 0) / max(1, sum(counts.values()))  # failed, timed out, cancelled
            p = report["prefix"]
            cfg = report["config"]
            kv = "derived" if report["kv_blocks_from"].startswith("derived") else "run"
            errors = [f"{_stat(report, m, 'mean')} / {_stat(report, m, 'p99')}" for m in ("ttft", "tpot", "e2e")]
            shares = " / ".join(_share(p[k]) for k in ("measured", "ideal", "simulated"))
            rows.append(f"| {folder.name} | {report['requests']} | {cfg['gpu']}, {report['num_gpu_blocks']:,} blocks "
                        f"({kv}) | " + " | ".join(errors) + f" | {shares} | {failed:.1%} |")
    table = ["| run | requests | GPU, KV | TTFT mean / p99 | TPOT mean / p99 | E2E mean / p99 "
             "| prefix hits: server / ideal / sim | failed |", "|---|---:|---|---:|---:|---:|---:|---:|", *rows]
    return table, commands


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("-o", "--output")
    ap.add_argument("--scoreboard", action="store_true", help="one row per run, shipped defaults")
    ap.add_argument("--write-docs", action="store_true", help="with --scoreboard: update docs/fidelity.md")
    args = ap.parse_args()
    data = Path(args.shared) / "calibration" / "real_vllm"
    if args.scoreboard:
        table, commands = scoreboard({"$DATA": data, "bench/real_runs": BUNDLED})
        block = "\n".join([MARK_BEGIN, *table, "", "Reproduce (DATA = shared/calibration/real_vllm; bench/real_runs is "
                           "in the repository):", "",
                           *[f"    {c}" for c in commands], MARK_END])
        print(block)
        if args.write_docs:
            doc = Path(__file__).resolve().parents[1] / "docs" / "fidelity.md"
            text = doc.read_text()
            start, end = text.index(MARK_BEGIN), text.index(MARK_END) + len(MARK_END)
            doc.write_text(text[:start] + block + text[end:])
        return
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for title, (import_args, variants) in RUNS.items():
            run_dir = Path(tmp) / title.split()[0]
            run(["run", "import", *[a.format(d=data) for a in import_args], "-o", str(run_dir)])
            reports = []
            for label, extra in variants:
                reports.append((label, json.loads(run(["validate", "--real", str(run_dir), "--format", "json", *extra]))))
            lines += _table(title, reports)
    text = "\n".join(lines) + "\n"
    if args.output:
        Path(args.output).write_text(text)
    print(text)


def _table(title: str, reports: list[tuple[str, dict]]) -> list[str]:
    first = reports[0][1]
    lines = [f"### {title}", "",
             f"{first['requests']} requests; KV blocks per variant: "
             + ", ".join(f"{label.split(':')[0]} {r['num_gpu_blocks']:,} ({r['kv_blocks_from']})" for label, r in reports),
             "", "| metric | stat | measured | " + " | ".join(label for label, _ in reports) + " |",
             "|---|---|---:|" + "---:|" * len(reports)]
    for i, row in enumerate(first["latency"]):
        if row["metric"] == "queue":
            continue
        cells = []
        for _, r in reports:
            sim = r["latency"][i]
            err = "n/a" if sim["error_pct"] is None else f"{sim['error_pct']:+.1f}%"
            cells.append(f"{sim['simulated_s'] * 1000:,.1f} ms ({err})")
        lines.append(f"| {row['metric']} | {row['stat']} | {row['measured_s'] * 1000:,.1f} ms | " + " | ".join(cells) + " |")
    for i, row in enumerate(first["throughput"]):
        cells = [f"{r['throughput'][i]['simulated']:,.3f} ({r['throughput'][i]['error_pct']:+.1f}%)" for _, r in reports]
        lines.append(f"| {row['metric']} | | {row['measured']:,.3f} | " + " | ".join(cells) + " |")
    for m in ("ttft_s", "tpot_s", "e2e_s"):
        cells = [f"{r['per_request'][m]['mape_pct']:.1f}%" for _, r in reports]
        lines.append(f"| per-request MAPE | {m.removesuffix('_s')} | | " + " | ".join(cells) + " |")
    lines.append("")
    return lines


if __name__ == "__main__":
    main()
