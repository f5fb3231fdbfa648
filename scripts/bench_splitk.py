"""o_proj / down_proj at decode batch sizes: cuBLAS + residual-add RMSNorm against split-K partials
summed inside the RMSNorm, with the default table (`splitk_config`) and a sweep of configurations.

--gated: down_proj with SwiGLU in front: silu_and_mul + cuBLAS, silu_and_mul + split-K (two
launches) and the gated split-K kernel that computes silu(gate) * up while loading A (one), each
followed by the residual-add RMSNorm, with the default config and the best of the sweep (the gated
kernel redoes the SiLU in every N tile, so wider N tiles may pay more than they do unfused).

    python scripts/bench_splitk.py                 (on the GPU machine)
    python scripts/bench_splitk.py --gated         (down_proj only, M = 1, 16, 64, 128)
"""
import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.fused_ops import fused_add_rms_norm, silu_and_mul  # noqa: E402
from nanovllm.kernels.splitk_gemm import splitk_config, splitk_linear  # noqa: E402

SHAPES = {"o_proj": (2048, 1024), "down_proj": (3072, 1024)}  # Qwen3-0.6B (K, N)
M_ALL = (1, 8, 16, 32, 64, 128, 256)
M_GATED = (1, 16, 64, 128)


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3  # us


def fmt(t):
    return "  -  " if t is None else f"{t:5.1f}"


def sweep(m, k, run):
    """(best time, config) over a grid of split-K configs; run(cfg) is the timed closure."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    best = (float("inf"), None)
    for s, bn, bk, stages in itertools.product((2, 4, 8, 16), (32, 64, 128), (64, 128), (3,)):
        if k % (s * bk):
            continue
        cfg = (s, bm, bn, bk, 4, stages)
        try:
            t = bench(lambda: run(cfg))
        except Exception as e:
            print(f"  {cfg}: {type(e).__name__}")
            continue
        best = min(best, (t, cfg))
    return best


def bench_projections(ms):
    total = {}
    for m in ms:
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            res = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
            nw = torch.ones(n, dtype=torch.bfloat16, device="cuda")
            t_cublas = bench(lambda: fused_add_rms_norm(F.linear(x, w), res, nw))
            default = splitk_config(m, n, k)
            t_default = bench(lambda: fused_add_rms_norm(splitk_linear(x, w, default), res, nw)) if default else None
            best = sweep(m, k, lambda cfg: fused_add_rms_norm(splitk_linear(x, w, cfg), res, nw))
            y0, _ = fused_add_rms_norm(F.linear(x, w), res, nw)
            y1, _ = fused_add_rms_norm(splitk_linear(x, w, best[1]), res, nw)
            err = (y0.float() - y1.float()).abs().max().item()
            row = total.setdefault(m, [0.0, 0.0, 0.0])
            row[0] += t_cublas
            row[1] += t_default or t_cublas
            row[2] += min(best[0], t_cublas)
            print(f"M={m:3d} {name:>9}: cuBLAS+norm {t_cublas:5.1f} us | split-K default {default} "
                  f"{fmt(t_default)} us | best {best[0]:5.1f} us {best[1]} (max |diff| {err:.3g})")
    for m, (c, d, b) in total.items():
        print(f"M={m:3d} o+down per layer: cuBLAS {c:.1f} us, split-K default {d:.1f} us, best {b:.1f} us")


def bench_gated(ms):
    k, n = SHAPES["down_proj"]
    for m in ms:
        gate_up = torch.randn(m, 2 * k, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        res = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
        nw = torch.ones(n, dtype=torch.bfloat16, device="cuda")

        def unfused(cfg):
            return fused_add_rms_norm(splitk_linear(silu_and_mul(gate_up), w, cfg), res, nw)

        def gated(cfg):
            return fused_add_rms_norm(splitk_linear(gate_up, w, cfg, gated=True), res, nw)

        t_cublas = bench(lambda: fused_add_rms_norm(F.linear(silu_and_mul(gate_up), w), res, nw))
        default = splitk_config(m, n, k)
        t_unfused = bench(lambda: unfused(default)) if default else None
        t_gated = bench(lambda: gated(default)) if default else None
        best_u, best_g = sweep(m, k, unfused), sweep(m, k, gated)
        # Same A operand, tiles and order: the partials must agree bit for bit.
        p0 = splitk_linear(silu_and_mul(gate_up), w, best_g[1]).parts
        p1 = splitk_linear(gate_up, w, best_g[1], gated=True).parts
        same = torch.equal(p0, p1)
        print(f"M={m:3d} down_proj (K={k}, N={n}) + norm: silu+cuBLAS {t_cublas:5.1f} us | default {default}: "
              f"silu+split-K {fmt(t_unfused)} us, gated {fmt(t_gated)} us | best silu+split-K "
              f"{best_u[0]:5.1f} us {best_u[1]}, best gated {best_g[0]:5.1f} us {best_g[1]} "
              f"(partials identical: {same})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gated", action="store_true",
                    help="down_proj with SiLU-and-mul fused into the split-K A-load vs silu_and_mul + split-K")
    ap.add_argument("--m", type=int, nargs="+", metavar="M",
                    help=f"batch sizes (default {M_ALL}, or {M_GATED} with --gated)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_splitk.py needs a CUDA GPU")
    if args.gated:
        bench_gated(args.m or M_GATED)
    else:
        bench_projections(args.m or M_ALL)


if __name__ == "__main__":
    main()
