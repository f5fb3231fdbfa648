"""The decode projections of Qwen3-0.6B through each GEMM that torch ships, against ours: cuBLAS
(`F.linear`), cuBLASLt (`preferred_blas_library("cublaslt")`) and the CUTLASS grouped GEMM behind
`torch._grouped_mm` (one group; Hopper kernels with thread-block clusters), with the weights cold as
in a model (28 copies, one per layer, chained in one CUDA graph: more than the L2 holds).

    python scripts/probe_library_gemm.py [--m 16,64,128,256]     (GPU)

Prints us per projection (graph time / layers) and each path's largest difference from cuBLAS (our
gate_up is gate_up + SiLU-and-mul: no difference printed; our o/down write split-K partials, which
the engine's residual-add RMSNorm sums).
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.gemm import dense_config, dense_linear, gated_linear, splitk_config, splitk_linear  # noqa: E402
from bench_gemm_tiles import per_call_us  # noqa: E402  (scripts/ is sys.path[0])

LAYERS = 28
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}  # (N, K)


def ours(name: str, x: torch.Tensor, w: torch.Tensor):
    """Our Triton kernel where the engine runs one for this shape, else None. o/down: the split-K
    partials alone (the engine's next kernel, the residual-add RMSNorm, sums them)."""
    m, k = x.shape
    if name in ("o", "down"):
        config = splitk_config(m, w.shape[0], k)
        return None if config is None else (lambda: splitk_linear(x, w, config))
    config = dense_config(m, w.shape[0], k, gated=name == "gate_up")
    if config is None:
        return None
    return (lambda: gated_linear(x, w, config)) if name == "gate_up" else (lambda: dense_linear(x, w, config))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="16,64,128,256")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    for m in (int(v) for v in args.m.split(",")):
        for name, (n, k) in SHAPES.items():
            weights = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(LAYERS)]
            weights_t = [w.t().unsqueeze(0) for w in weights]  # _grouped_mm's [G, K, N], K-major as stored
            x = torch.randn(m, k, dtype=dt, device=dev)
            offs = torch.tensor([m], dtype=torch.int32, device=dev)
            ref = F.linear(x, weights[0])
            paths = {"cublas": lambda i: F.linear(x, weights[i])}
            try:
                torch._grouped_mm(x, weights_t[0], offs=offs)
                paths["grouped_mm"] = lambda i: torch._grouped_mm(x, weights_t[i], offs=offs)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"  grouped_mm unavailable: {type(e).__name__}: {str(e)[:120]}")
            if ours(name, x, weights[0]) is not None:
                fns = [ours(name, x, w) for w in weights]
                paths["triton (ours)"] = lambda i: fns[i]()
            row = []
            for label, fn in paths.items():
                us = per_call_us(fn, LAYERS)
                out = fn(0)
                if isinstance(out, tuple):  # split-K partials
                    out = out.sum()
                if name == "gate_up" and label == "triton (ours)":
                    diff = float("nan")  # ours is gate_up + SiLU
                else:
                    diff = (out.float() - ref.float()).abs().max().item()
                row.append(f"{label} {us:6.2f} us (max|diff| {diff:.2g})")
            try:
                torch.backends.cuda.preferred_blas_library("cublaslt")
                row.append(f"cublaslt {per_call_us(paths['cublas'], LAYERS):6.2f} us")
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            weight_us = n * k * 2 / 4.5e12 * 1e6
            print(f"M={m:3d} {name:>7} (weights at 4.5 TB/s {weight_us:4.1f} us): " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
