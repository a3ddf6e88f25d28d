"""The fidelity table of bench/RESULTS_fidelity.md: every calibration run, measured vs simulated,
before (the 2023 host profile) and after (the shipped defaults) calibration.

    python bench/bench_fidelity.py [--shared ../shared] [-o table.md]

Imports the real runs in ``shared/calibration/real_vllm`` into a temporary folder with
``servelab run import`` (the exact commands are printed), replays each with ``validate --real`` for
each variant and prints one markdown table per run.
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


def run(args: list[str]) -> str:
    print("$ servelab " + " ".join(shlex.quote(a) for a in args), file=sys.stderr)
    out = subprocess.run(SERVELAB + args, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(out.stderr)
    return out.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared"))
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    data = Path(args.shared) / "calibration" / "real_vllm"
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
