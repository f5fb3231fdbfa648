"""Split-K projections for decode-sized batches, summed by the kernel that consumes them.

At a decode step M (the batch) is small and a projection like o_proj (K=2048 -> N=1024) offers
cuBLAS only a few dozen output tiles: most SMs idle while the rest stream the weights, and the
GEMM runs at ~20% of the memory bandwidth. Cutting K into S slices gives S times as many
programs; each writes its fp32 partial product to ``parts[s]``. Instead of a separate reduction
kernel, the next kernel (the residual add + RMSNorm that always follows o_proj and down_proj)
sums the S partials while it loads its input row: `SplitKOutput` carries them there.

The sum is rounded to the activation dtype before the residual add, as a cuBLAS output would be,
so the consumer's arithmetic is unchanged; only the fp32 accumulation order differs.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue

_MAX_M = 128  # measured: from 256 rows on, cuBLAS has enough tiles and the partials cost more


class SplitKOutput(NamedTuple):
    parts: torch.Tensor   # [S, M, N] float32 partial products
    dtype: torch.dtype    # the activation dtype the sum stands for

    @property
    def shape(self):
        return self.parts.shape[1:]

    def sum(self) -> torch.Tensor:
        """The plain tensor (for consumers that cannot sum partials themselves), summed in the
        fused consumer's order."""
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        return total.to(self.dtype)


@triton.jit(do_not_specialize=["M"])
def _splitk_kernel(a_ptr, w_ptr, part_ptr, M, N, stride_am, stride_wn,
                   K_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pdl_prologue()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = pid_k * K_SPLIT + tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros([BM, BN], tl.float32)
    for _ in range(0, K_SPLIT, BK):  # K_SPLIT is a multiple of BK: no mask along K
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BK
        w_ptrs += BK
    out = part_ptr + (pid_k * M + rm)[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


def splitk_config(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int] | None:
    """(splits, BM, BN, BK, num_warps, num_stages) for an [m, k] x [k, n] product, or None when
    split-K does not pay (m past _MAX_M, or a k that does not divide into slices). A fixed table
    (from scripts/bench_splitk.py on the H200, o_proj/down_proj of Qwen3-0.6B, where 4 slices won
    at every batch size); host-only, so CUDA-graph capture never benchmarks."""
    if m > _MAX_M or m == 0:
        return None
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn = 32 if m <= 64 else 64
    bk = 64 if m > 64 and k <= 2048 else 128
    splits = 4
    if k % (splits * bk):
        return None
    return splits, bm, bn, bk, 4, 3


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, config=None) -> SplitKOutput | None:
    """x [M, K] @ weight[N, K]^T as S fp32 partials, or None when no config applies."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or splitk_config(m, n, k)
    if config is None or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return None
    splits, bm, bn, bk, warps, stages = config
    assert k % (splits * bk) == 0, (k, config)
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _splitk_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), splits)](
        x, weight, parts, m, n, x.stride(0), weight.stride(0),
        K_SPLIT=k // splits, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages, **PDL_LAUNCH)
    return SplitKOutput(parts, x.dtype)
