"""Decode-step projections of Qwen3-0.6B through the two BLAS back ends torch offers: cuBLAS (the
default for F.linear without bias) and cuBLASLt (`torch.backends.cuda.preferred_blas_library`), each
in a CUDA graph, us per call (median), with the weight bytes' time at 4.3 TB/s and the FLOPs' time
at 790 TFLOP/s for scale.

    python scripts/bench_blas.py [--m 32,64,96,128,192,256]     (GPU)
"""
import argparse

import torch
import torch.nn.functional as F
import triton.testing

SHAPES = {"qkv": (4096, 1024), "gate_up": (6144, 1024), "o": (1024, 2048), "down": (1024, 3072),
          "lm_head": (151936, 1024)}


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="16,32,64,96,128,192,256")
    args = ap.parse_args()
    dt, dev = torch.bfloat16, "cuda"
    weights = {k: torch.randn(n, kk, dtype=dt, device=dev) * 0.02 for k, (n, kk) in SHAPES.items()}
    libs = ["cublas", "cublaslt"]
    print("M, projection: " + " | ".join(libs) + " | weights @4.3TB/s | FLOPs @790TF")
    totals = {}
    for m in [int(v) for v in args.m.split(",")]:
        for name, w in weights.items():
            x = torch.randn(m, w.shape[1], dtype=dt, device=dev)
            times = []
            for lib in libs:
                torch.backends.cuda.preferred_blas_library(lib)
                times.append(bench(lambda: F.linear(x, w)))
            torch.backends.cuda.preferred_blas_library("cublas")
            floor_w = w.numel() * 2 / 4.3e12 * 1e6
            floor_f = 2 * m * w.numel() / 790e12 * 1e6
            if name != "lm_head":
                row = totals.setdefault(m, [0.0] * len(libs))
                for i, t in enumerate(times):
                    row[i] += t
            print(f"M={m:3d} {name:>7}: " + " | ".join(f"{t:6.1f}" for t in times)
                  + f" | {floor_w:5.1f} | {floor_f:5.1f}", flush=True)
    for m, row in totals.items():
        print(f"M={m:3d} four projections: " + " | ".join(f"{t:6.1f}" for t in row))


if __name__ == "__main__":
    main()
