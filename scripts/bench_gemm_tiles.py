"""Can a Triton GEMM match cuBLAS on the decode projections of 64-256 rows (where cuBLAS runs today)?
Our kernels would then take the elementwise op after each projection into their epilogue (rotary +
KV store after qkv, SiLU-and-mul after gate_up). Times, per projection of Qwen3-0.6B and batch size,
cuBLAS against the best of a tile sweep (up to 128x256 tiles) of two Triton kernels: pointer loads (cp.async pipelining) and
TMA tensor descriptors. Weights rotate over 8 copies (96+ MB), so they come from HBM as in a model.

    python scripts/bench_gemm_tiles.py [--m 64,128,256]   (GPU, Hopper for the TMA kernel)
"""
import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue  # noqa: E402

SHAPES = {"qkv": (4096, 1024), "gate_up": (6144, 1024), "o": (1024, 2048), "down": (1024, 3072)}
COPIES = 8


@triton.jit
def _ptr_kernel(a_ptr, w_ptr, o_ptr, M, N, K, stride_am, stride_wn, stride_om,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pdl_prologue()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for _ in tl.range(0, K, BK, num_stages=STAGES):
        a = tl.load(a_ptrs, mask=(rm < M)[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BK
        w_ptrs += BK
    tl.store(o_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(rm < M)[:, None])


@triton.jit
def _tma_kernel(a_desc, w_desc, o_desc, K,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    pdl_prologue()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        a = a_desc.load([pid_m * BM, k])
        w = w_desc.load([pid_n * BN, k])
        acc = tl.dot(a, w.T, acc)
    o_desc.store([pid_m * BM, pid_n * BN], acc.to(o_desc.dtype))


def run_ptr(x, w, out, cfg):
    bm, bn, bk, stages, warps = cfg
    m, k = x.shape
    n = w.shape[0]
    _ptr_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk, STAGES=stages,
        num_warps=warps, **PDL_LAUNCH)


def make_tma(x, ws, out, cfg):
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn, bk, stages, warps = cfg
    a = TensorDescriptor.from_tensor(x, [bm, bk])
    o = TensorDescriptor.from_tensor(out, [bm, bn])
    wd = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
    m, k = x.shape
    n = ws[0].shape[0]

    def run(i):
        _tma_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](a, wd[i], o, k, BM=bm, BN=bn, BK=bk, STAGES=stages,
                                                               num_warps=warps, **PDL_LAUNCH)
    return run


def per_call_us(fn, copies: int = COPIES):
    """fn(i) for each weight copy i, captured in one graph; microseconds per call."""
    return triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=20) * 1e3 / copies


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="64,128,256")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    configs = [(bm, bn, bk, st, 4 if bm == 64 else 8)
               for bm, bn, bk, st in itertools.product((64, 128), (64, 128, 256), (64, 128), (3, 4))]
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    for m in [int(v) for v in args.m.split(",")]:
        for name, (n, k) in SHAPES.items():
            ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(COPIES)]
            x = torch.randn(m, k, dtype=dt, device=dev)
            out = torch.empty(m, n, dtype=dt, device=dev)
            ref = F.linear(x, ws[0])
            t_cublas = per_call_us(lambda i: torch.matmul(x, ws[i].t(), out=out))
            line = f"M={m:3d} {name:>7} (N={n}, K={k}): cuBLAS {t_cublas:5.1f} us"
            for kind in ("ptr", "tma"):
                best = (float("inf"), None)
                for cfg in configs:
                    try:
                        if kind == "ptr":
                            fn = lambda i, cfg=cfg: run_ptr(x, ws[i], out, cfg)  # noqa: E731
                        else:
                            fn = make_tma(x, ws, out, cfg)
                        fn(0)
                        err = (out.float() - ref.float()).abs().max().item()
                        assert err < 0.05, err
                        t = per_call_us(fn)
                    except Exception as e:  # shared memory, or no TMA
                        if cfg == configs[0]:
                            print(f"  {kind} {cfg}: {type(e).__name__} {str(e)[:100]}")
                        continue
                    best = min(best, (t, cfg), key=lambda p: p[0])
                line += f" | {kind} {best[0]:5.1f} us {best[1]}"
            ideal = n * k * 2 / 4.27e12 * 1e6
            flop = 2 * m * n * k / 700e12 * 1e6
            print(line + f" | weights {ideal:4.1f} us, FLOPs at 700 TF {flop:4.1f} us", flush=True)


if __name__ == "__main__":
    main()
