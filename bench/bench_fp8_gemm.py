"""FP8 against bf16 GEMM throughput on the GPU (torch._scaled_mm, cuBLASLt), for Llama-3.1-8B's MLP
GEMMs, and the roofline's prediction for the same shapes: where runners/quant.py's
LOW_PRECISION_ACHIEVED comes from.

    python3 bench/bench_fp8_gemm.py > fp8.txt                  # on the GPU machine (torch with CUDA)
    .venv/bin/python bench/bench_fp8_gemm.py --compare fp8.txt --gpu h200   # here: the Markdown table
"""

from __future__ import annotations

import argparse
import re

SHAPES = {"mlp_up": (4096, 28672), "mlp_down": (14336, 4096)}  # (K, N): Llama-3.1-8B gate+up, down
TOKENS = (16, 64, 256, 1024, 4096, 8192)


def measure() -> None:
    import torch

    def bench(f, n=30):
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            f()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / n * 1e-3

    print(torch.__version__, torch.cuda.get_device_name())
    one = torch.ones((), device="cuda")
    for name, (k, n) in SHAPES.items():
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w8 = wb.to(torch.float8_e4m3fn)
        for t in TOKENS:
            xb = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            x8 = xb.to(torch.float8_e4m3fn)
            tb = bench(lambda: xb @ wb.t())
            t8 = bench(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
            print(f"{name} T={t} bf16_us={tb * 1e6:.1f} fp8_us={t8 * 1e6:.1f} ratio={tb / t8:.2f}")


def compare(path: str, gpu: str) -> None:
    from servelab.runners.base import make_runner

    bf16 = make_runner(f"roofline:model=llama-3.1-8b,gpu={gpu}")
    fp8 = make_runner(f"roofline:model=llama-3.1-8b,gpu={gpu},quantization=fp8")
    index = {"mlp_up": 2, "mlp_down": 4}  # runners.roofline.LAYER_OPS order
    print("| GEMM | T | measured bf16 / fp8 (us) | ratio | roofline bf16 / fp8 (us) | ratio |")
    print("|---|---|---|---|---|---|")
    for line in open(path):
        m = re.match(r"(\w+) T=(\d+) bf16_us=([\d.]+) fp8_us=([\d.]+)", line)
        if not m:
            continue
        name, t, mb, m8 = m.group(1), int(m.group(2)), float(m.group(3)), float(m.group(4))
        pb = bf16._op(bf16._ops[index[name]], t) * 1e6
        p8 = fp8._op(fp8._ops[index[name]], t) * 1e6
        print(f"| {name} | {t} | {mb:.1f} / {m8:.1f} | {mb / m8:.2f} | {pb:.1f} / {p8:.1f} | {pb / p8:.2f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", help="a file this script printed on the GPU: print the table against the roofline")
    ap.add_argument("--gpu", default="h200")
    args = ap.parse_args()
    compare(args.compare, args.gpu) if args.compare else measure()
