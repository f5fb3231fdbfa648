"""Small-M projections (decode steps): cuBLAS through F.linear against Triton tile configurations.

    python scripts/bench_gemm.py            (on the GPU machine)

Shapes are Qwen3-0.6B's per-layer projections; M is the decode batch. Prints, per (M, shape),
cuBLAS and the best Triton configuration, in microseconds and as a fraction of the weight-read
time at the copy bandwidth measured in the same run.
"""
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}


@triton.jit
def _matmul_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = a_ptr + rm[:, None] * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptrs, mask=rm[:, None] < M, other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BK
        w_ptrs += BK
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=rm[:, None] < M)


def triton_linear(x, w, cfg):
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _matmul_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages)
    return out


def main():
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    bw = 2 * src.numel() * 2 / (ms * 1e-3)
    del src, dst
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    configs = [c for c in itertools.product((16, 64, 128), (32, 64, 128), (64, 128), (4,), (4,))]
    total = {}
    for m in (1, 16, 64, 128, 256):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            ideal_us = n * k * 2 / bw * 1e6
            t_cublas = triton.testing.do_bench_cudagraph(lambda: F.linear(x, w), rep=30) * 1e3
            expect = F.linear(x, w)
            best = (float("inf"), None)
            for cfg in configs:
                if cfg[0] > max(16, triton.next_power_of_2(m)):
                    continue
                try:
                    out = triton_linear(x, w, cfg)
                    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
                    t = triton.testing.do_bench_cudagraph(lambda: triton_linear(x, w, cfg), rep=30) * 1e3
                except Exception as e:
                    print(f"  {cfg}: {type(e).__name__} {str(e)[:60]}")
                    continue
                best = min(best, (t, cfg))
            total.setdefault(m, [0.0, 0.0, 0.0])
            total[m][0] += t_cublas
            total[m][1] += best[0]
            total[m][2] += ideal_us
            print(f"M={m:3d} {name:>7} ({k}x{n}): cuBLAS {t_cublas:6.1f} us ({ideal_us / t_cublas:5.1%}), "
                  f"Triton best {best[0]:6.1f} us ({ideal_us / best[0]:5.1%}) {best[1]}")
    for m, (c, t, ideal) in total.items():
        print(f"M={m:3d} per layer: cuBLAS {c:.1f} us, Triton best {t:.1f} us, weight-read bound {ideal:.1f} us")


if __name__ == "__main__":
    main()
