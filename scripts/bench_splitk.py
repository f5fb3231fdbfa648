"""o_proj / down_proj at decode batch sizes: cuBLAS + residual-add RMSNorm against split-K partials
summed inside the RMSNorm, with the default table (`splitk_config`) and a sweep of configurations.

    python scripts/bench_splitk.py            (on the GPU machine)
"""
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.fused_ops import fused_add_rms_norm  # noqa: E402
from nanovllm.kernels.gemm import splitk_config, splitk_linear  # noqa: E402

SHAPES = {"o_proj": (2048, 1024), "down_proj": (3072, 1024)}  # Qwen3-0.6B (K, N)


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3  # us


def main():
    total = {}
    for m in (1, 8, 16, 32, 64, 128, 256):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            res = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
            nw = torch.ones(n, dtype=torch.bfloat16, device="cuda")
            t_cublas = bench(lambda: fused_add_rms_norm(F.linear(x, w), res, nw))
            default = splitk_config(m, n, k)
            t_default = bench(lambda: fused_add_rms_norm(splitk_linear(x, w, default), res, nw)) if default else None
            bm = 16 if m <= 16 else (32 if m <= 32 else 64)
            best = (float("inf"), None)
            for s, bn, bk, stages in itertools.product((2, 4, 8, 16), (32, 64, 128), (64, 128), (3,)):
                if k % (s * bk):
                    continue
                cfg = (s, bm, bn, bk, 4, stages)
                try:
                    t = bench(lambda: fused_add_rms_norm(splitk_linear(x, w, cfg), res, nw))
                except Exception as e:
                    print(f"  {cfg}: {type(e).__name__}")
                    continue
                best = min(best, (t, cfg))
            y0, _ = fused_add_rms_norm(F.linear(x, w), res, nw)
            y1, _ = fused_add_rms_norm(splitk_linear(x, w, best[1]), res, nw)
            err = (y0.float() - y1.float()).abs().max().item()
            row = total.setdefault(m, [0.0, 0.0, 0.0])
            row[0] += t_cublas
            row[1] += t_default or t_cublas
            row[2] += min(best[0], t_cublas)
            print(f"M={m:3d} {name:>9}: cuBLAS+norm {t_cublas:5.1f} us | split-K default {default} "
                  f"{t_default if t_default is None else round(t_default, 1)} us | best {best[0]:5.1f} us {best[1]} "
                  f"(max |diff| {err:.3g})")
    for m, (c, d, b) in total.items():
        print(f"M={m:3d} o+down per layer: cuBLAS {c:.1f} us, split-K default {d:.1f} us, best {b:.1f} us")


if __name__ == "__main__":
    main()
