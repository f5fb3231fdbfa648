"""Projections for decode-sized batches: one Triton kernel for x @ W^T in three forms.

- dense: the product in the activation dtype (qkv_proj);
- gated: the SwiGLU of a fused [gate | up] projection, silu(x @ G^T) * (x @ U^T), so gate_up_proj
  and SiLU-and-mul are one kernel and the [M, 2I] intermediate never reaches memory;
- partials: K cut into S slices, each program writing an fp32 partial product that the next
  kernel (the residual add + RMSNorm after o_proj / down_proj) sums while it loads its row: at a
  decode step cuBLAS has only a few dozen output tiles for N=1024, and S times as many programs
  keep the memory system busy (`SplitKOutput`).

The partial sums are rounded to the activation dtype before the residual add, as a cuBLAS output
would be, so the consumer's arithmetic is unchanged; only the fp32 accumulation order differs.
The gated form rounds gate and up to the activation dtype before the SiLU, as the unfused pair
(GEMM output, then SiLU-and-mul) does, so only the fp32 accumulation order differs.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue

_MAX_SPLITK_M = 128  # measured: from 256 rows on, cuBLAS has enough tiles and the partials cost more
# Split-K is for narrow outputs, where cuBLAS has too few output tiles to fill the GPU. Measured with
# bench.py on the H200: Qwen3-0.6B's o/down (N=1024) gain; Qwen3-8B's (N=4096) lose: 9,458 tok/s with
# split-K against 9,813 without (every decode bucket from 16 to 127 rows slower with it).
_MAX_SPLITK_N = 2048
# Measured (scripts/bench_decode_gemm.py, H200, Qwen3-0.6B qkv / gate_up): up to this many rows our
# dense and gated forms beat cuBLAS (+ SiLU-and-mul); at 64 rows cuBLAS ties or wins.
_MAX_DENSE_M = 16


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
def _gemm_kernel(a_ptr, w_ptr, out_ptr, M, N, stride_am, stride_wn, stride_om, up_row,
                 K_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GATED: tl.constexpr, PARTIALS: tl.constexpr):
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
    if GATED:
        u_ptrs = w_ptrs + up_row.to(tl.int64) * stride_wn
        acc_u = tl.zeros([BM, BN], tl.float32)
    for _ in range(0, K_SPLIT, BK):  # K_SPLIT is a multiple of BK: no mask along K
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        if GATED:
            u = tl.load(u_ptrs, mask=n_mask[:, None], other=0.0)
            acc_u = tl.dot(a, tl.trans(u), acc_u)
            u_ptrs += BK
        a_ptrs += BK
        w_ptrs += BK
    mask = m_mask[:, None] & n_mask[None, :]
    if PARTIALS:
        out = out_ptr + (pid_k * M + rm)[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(out, acc, mask=mask)
    else:
        out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        dtype = out_ptr.dtype.element_ty
        if GATED:
            gate = acc.to(dtype).to(tl.float32)
            up = acc_u.to(dtype).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out, acc.to(dtype), mask=mask)


class GemmConfig(NamedTuple):
    splits: int
    bm: int
    bn: int
    bk: int
    num_warps: int = 4
    num_stages: int = 3


def _launch(x, weight, out, n, config: GemmConfig, gated: bool, partials: bool):
    m, k = x.shape
    splits, bm, bn, bk, warps, stages = config
    assert k % (splits * bk) == 0, (k, config)
    _gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), splits)](
        x, weight, out, m, n, x.stride(0), weight.stride(0), out.stride(-2), n if gated else 0,
        K_SPLIT=k // splits, BM=bm, BN=bn, BK=bk, GATED=gated, PARTIALS=partials,
        num_warps=warps, num_stages=stages, **PDL_LAUNCH)
    return out


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1 and weight.stride(-1) == 1 and x.dtype == weight.dtype


def dense_linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T in x's dtype."""
    assert _usable(x, weight) and config.splits == 1
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    return _launch(x, weight, out, weight.shape[0], config, gated=False, partials=False)


def gated_linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for weight = [gate | up] stacked along N ([2I, K]) -> [M, I]."""
    assert _usable(x, weight) and config.splits == 1 and weight.shape[0] % 2 == 0
    inter = weight.shape[0] // 2
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    return _launch(x, weight, out, inter, config, gated=True, partials=False)


def partial_linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> SplitKOutput:
    """x [M, K] @ weight[N, K]^T as `config.splits` fp32 partials."""
    assert _usable(x, weight)
    n = weight.shape[0]
    parts = torch.empty(config.splits, x.shape[0], n, dtype=torch.float32, device=x.device)
    _launch(x, weight, parts, n, config, gated=False, partials=True)
    return SplitKOutput(parts, x.dtype)


def splitk_config(m: int, n: int, k: int) -> GemmConfig | None:
    """The split-K configuration for an [m, k] x [k, n] product, or None when split-K does not pay
    (m past _MAX_SPLITK_M, n past _MAX_SPLITK_N, or a k that does not divide into slices). A fixed
    table (from scripts/bench_decode_gemm.py on the H200, o_proj/down_proj of Qwen3-0.6B behind the
    kernels that precede them, where 4 slices of BK=128 won at every batch size); host-only, so
    CUDA-graph capture never benchmarks."""
    if m > _MAX_SPLITK_M or m == 0 or n > _MAX_SPLITK_N:
        return None
    bm = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
    bn = 128 if 16 < m <= 32 else 32
    splits, bk = 4, 128
    if k % (splits * bk):
        return None
    return GemmConfig(splits, bm, bn, bk, 4, 3)


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> SplitKOutput | None:
    """x [M, K] @ weight[N, K]^T as fp32 partials, or None when no split-K configuration applies."""
    config = config or splitk_config(x.shape[0], weight.shape[0], x.shape[1])
    if config is None or not _usable(x, weight):
        return None
    return partial_linear(x, weight, config)


def dense_config(m: int, n: int, k: int) -> GemmConfig | None:
    """The configuration of the dense / gated forms for m rows, or None where cuBLAS does better."""
    if m > _MAX_DENSE_M or m == 0 or k % 128:
        return None
    return GemmConfig(1, 16, 32, 128, 4, 3)
