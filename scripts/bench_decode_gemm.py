"""Decode-step projections of Qwen3-0.6B: cuBLAS (+ the fused op after it) against the Triton GEMM
of `nanovllm.kernels.gemm` over a sweep of tile configurations, each timed behind the kernel that
precedes it in a layer (programmatic dependent launch overlaps a launch with its predecessor).

    python scripts/bench_decode_gemm.py [--budget SECONDS] [--m 256,128,64,16,1] [--only o,down]   (GPU)

Chains timed (CUDA graph, median):
  qkv:     add+RMSNorm -> qkv_proj                      vs  add+RMSNorm -> dense_linear
  gate_up: add+RMSNorm -> gate_up_proj -> SiLU-and-mul  vs  add+RMSNorm -> gated_linear
  o/down:  SiLU-and-mul -> proj -> add+RMSNorm          vs  SiLU-and-mul -> partial_linear -> add+RMSNorm
The predecessor alone is timed too and subtracted in the "net" column. One weight tensor serves every
call, so at these sizes it stays in L2: for pipeline depths, where HBM latency matters, use
scripts/sweep_gemm_stages.py (weights rotating over copies).
"""
import argparse
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.fused_ops import fused_add_rms_norm, silu_and_mul  # noqa: E402
from nanovllm.kernels.gemm import (GemmConfig, dense_config, dense_linear, gated_linear, partial_linear,  # noqa: E402
                                   splitk_config)

HIDDEN, INTER, QKV = 1024, 3072, 4096


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3  # us


def _final(result):
    """What the chain's projection produced: its output, or (o/down, whose chain ends in the
    residual-add RMSNorm) the new residual, which is the projection's sum plus the old residual."""
    while isinstance(result, tuple):
        result = result[-1]
    return result


def configs(m, kind, k):
    bms = [b for b in (16, 32, 64, 128) if b <= max(16, triton.next_power_of_2(m))]
    bms = bms[-2:]  # the two largest that fit
    splits = (1,) if kind != "partial" else ((2, 4, 8) if m <= 64 else (1, 2, 4))
    bns = (32, 64, 128) if kind != "dense" else (32, 64, 128, 256)
    for s, bm, bn, bk, warps in itertools.product(splits, bms, bns, (64, 128), (4, 8)):
        if k % (s * bk) or (warps == 8 and (bm < 128 or bn < 64)) or (kind == "partial" and bk == 128 and k // s < 512):
            continue
        yield GemmConfig(s, bm, bn, bk, warps, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=240.0, help="seconds; the sweep stops after this")
    ap.add_argument("--m", default="256,128,64,16,192,1")
    ap.add_argument("--only", default="qkv,gate_up,o,down", help="projections to sweep")
    args = ap.parse_args()
    deadline = time.time() + args.budget
    dt, dev = torch.bfloat16, "cuda"
    torch.manual_seed(0)
    nw = torch.ones(HIDDEN, dtype=dt, device=dev)
    weights = {"qkv": torch.randn(QKV, HIDDEN, dtype=dt, device=dev) * 0.02,
               "gate_up": torch.randn(2 * INTER, HIDDEN, dtype=dt, device=dev) * 0.02,
               "o": torch.randn(HIDDEN, 2048, dtype=dt, device=dev) * 0.02,
               "down": torch.randn(HIDDEN, INTER, dtype=dt, device=dev) * 0.02}
    totals = {}
    for m in [int(v) for v in args.m.split(",")]:
        h = torch.randn(m, HIDDEN, dtype=dt, device=dev)
        res = torch.randn(m, HIDDEN, dtype=dt, device=dev)
        act = torch.randn(m, 2 * INTER, dtype=dt, device=dev)
        x_o = torch.randn(m, 2048, dtype=dt, device=dev)
        norm = lambda: fused_add_rms_norm(h, res, nw)  # noqa: E731
        silu = lambda: silu_and_mul(act)  # noqa: E731
        cases = {
            "qkv": ("dense", norm, lambda: F.linear(norm()[0], weights["qkv"]),
                    lambda c: dense_linear(norm()[0], weights["qkv"], c)),
            "gate_up": ("gated", norm, lambda: silu_and_mul(F.linear(norm()[0], weights["gate_up"])),
                        lambda c: gated_linear(norm()[0], weights["gate_up"], c)),
            "o": ("partial", silu, lambda: (silu(), fused_add_rms_norm(F.linear(x_o, weights["o"]), res, nw)),
                  lambda c: (silu(), fused_add_rms_norm(partial_linear(x_o, weights["o"], c), res, nw))),
            "down": ("partial", silu, lambda: fused_add_rms_norm(F.linear(silu(), weights["down"]), res, nw),
                     lambda c: fused_add_rms_norm(partial_linear(silu(), weights["down"], c), res, nw)),
        }
        for name, (kind, pred, base_fn, ours_fn) in cases.items():
            if name not in args.only.split(","):
                continue
            if time.time() > deadline:
                print(f"budget spent: stopping before M={m} {name}")
                break
            w = weights[name]
            k = w.shape[1]
            t_pred = bench(pred)
            t_base = bench(base_fn)
            best = (float("inf"), None)
            for cfg in configs(m, kind, k):
                if time.time() > deadline:
                    break
                try:
                    t = bench(lambda: ours_fn(cfg))
                except Exception as e:  # a tile config the compiler rejects (shared memory)
                    print(f"  {cfg}: {type(e).__name__} {str(e)[:80]}")
                    continue
                best = min(best, (t, cfg), key=lambda p: p[0])
            if best[1] is None:
                continue
            table = (splitk_config(m, w.shape[0], k) if kind == "partial"
                     else dense_config(m, w.shape[0], k, gated=kind == "gated"))
            t_table = bench(lambda: ours_fn(table)) if table else float("nan")
            err = (_final(base_fn()).float() - _final(ours_fn(best[1])).float()).abs().max().item()
            ideal = w.numel() * w.element_size() / 4.3e12 * 1e6
            row = totals.setdefault(m, [0.0, 0.0])
            row[0] += t_base - t_pred
            row[1] += min(best[0], t_base) - t_pred
            print(f"M={m:3d} {name:>7}: pred {t_pred:5.1f} | cuBLAS chain {t_base:6.1f} (net {t_base - t_pred:5.1f}) | "
                  f"table {t_table:6.1f} | best {best[0]:6.1f} (net {best[0] - t_pred:5.1f}) | {tuple(best[1])} "
                  f"| weights at 4.3 TB/s {ideal:4.1f} | max|diff| {err:.3g}", flush=True)
    for m, (c, o) in totals.items():
        print(f"M={m:3d} per layer (net of predecessors): cuBLAS path {c:.1f} us, best {o:.1f} us")


if __name__ == "__main__":
    main()
