"""Projections for decode-sized batches: one Triton kernel for x @ W^T in three forms (and its
`mainloop`, which `qkv_rope.py` shares).

- dense: the product in the activation dtype (qkv_proj, where qkv_rope.py's fused form does not run);
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
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue

# Split-K up to 256 rows: with TMA operands, 4 slices beat cuBLAS's o/down at 192 and 256 rows too
# (H200, net of the kernel before: 256 rows o 6.0 vs 7.5 us, down 6.7 vs
# 8.3; 192 rows o 6.0 vs 6.8, down 7.0 vs 8.6). Past 256 rows (max_num_seqs > 256) not measured.
_MAX_SPLITK_M = 256
# Split-K is for narrow outputs, where cuBLAS has too few output tiles to fill the GPU. Measured with
# bench.py on the H200: Qwen3-0.6B's o/down (N=1024) gain; Qwen3-8B's (N=4096) lose: 9,458 tok/s with
# split-K against 9,813 without (every decode bucket from 16 to 127 rows slower with it).
_MAX_SPLITK_N = 2048
# Up to this many rows our dense form (qkv) and gated form (gate_up + SiLU-and-mul) run instead of
# cuBLAS. Measured with TMA loads (H200, Qwen3-0.6B, weights from HBM):
# qkv 4.9 / 5.0 / 6.0 us against cuBLAS 5.4 / 5.2 / 6.1 at 64 / 128 / 256 rows; gate_up 5.6 / 6.5 / 9.3
# against 6.2 / 6.0 / 7.5 plus a 2.2 us SiLU-and-mul kernel.
MAX_DENSE_M = 128  # measured end to end: from 129 rows on, cuBLAS's qkv is faster
_MAX_GATED_M = 128
# Past 16 rows only for the inner dimensions measured (Qwen3-0.6B's hidden size, 1024); wider models
# (Qwen3-8B: 4096) keep cuBLAS there until measured.
MAX_DENSE_K = 2048


class SplitKOutput(NamedTuple):
    parts: torch.Tensor   # [S, M, N] float32 partial products (a long MoE step's: in the activation dtype)
    dtype: torch.dtype    # the activation dtype the sum stands for

    @property
    def shape(self):
        return self.parts.shape[1:]

    def sum(self) -> torch.Tensor:
        """The plain tensor (for consumers that cannot sum partials themselves), summed in the
        fused consumer's order."""
        total = self.parts[0].to(torch.float32, copy=True)
        for part in self.parts[1:]:
            total += part
        return total.to(self.dtype)


@triton.jit
def mainloop(a_desc, w_desc, m0, n0, k0, up_row, K_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GATED: tl.constexpr):
    """The [BM, BN] fp32 tile at (m0, n0) of a @ w^T over k in [k0, k0 + K_SPLIT), and (GATED) the
    tile of rows n0 + up_row of w. Operands through TMA tensor descriptors (Hopper; plain loads
    elsewhere): 10-25% faster than pointer loads at 64-256 rows (H200). Rows
    past M and columns past N read as zeros; K_SPLIT is a multiple of BK: nothing masked along K."""
    acc = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    for k in range(k0, k0 + K_SPLIT, BK):
        a = a_desc.load([m0, k])
        acc = tl.dot(a, w_desc.load([n0, k]).T, acc)
        if GATED:
            acc_u = tl.dot(a, w_desc.load([n0 + up_row, k]).T, acc_u)
    return acc, acc_u


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_desc, w_desc, out_ptr, M, N, stride_om, up_row,
                 K_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GATED: tl.constexpr, PARTIALS: tl.constexpr):
    pdl_prologue()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    m0 = pid_m * BM
    n0 = pid_n * BN
    acc, acc_u = mainloop(a_desc, w_desc, m0, n0, pid_k * K_SPLIT, up_row, K_SPLIT, BM, BN, BK, GATED)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
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
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        out, m, n, out.stride(-2), n if gated else 0,
        K_SPLIT=k // splits, BM=bm, BN=bn, BK=bk, GATED=gated, PARTIALS=partials,
        num_warps=warps, num_stages=stages, **PDL_LAUNCH)
    return out


def tma_compatible(t: torch.Tensor) -> bool:
    """A tensor descriptor needs 16-byte aligned rows (and base)."""
    size = t.element_size()
    return t.stride(-1) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0


def _usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and x.dtype == weight.dtype and tma_compatible(x) and tma_compatible(weight)


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
    table (from scripts/tune.py gemm on the H200, o_proj/down_proj
    of Qwen3-0.6B behind the kernels that precede them, where 4 slices of BK=128 won at every batch size
    up to 256); host-only, so CUDA-graph capture never benchmarks."""
    if m > _MAX_SPLITK_M or m == 0 or n > _MAX_SPLITK_N:
        return None
    splits, bk = 4, 128
    if k % (splits * bk):
        return None
    # Pipeline depths from scripts/tune.py gemm, weights in HBM as in a model (the tiles were
    # first tuned with L2-resident weights, which hide the latency that deeper pipelines cover). Net us,
    # o / down, old table -> this one: 32 rows 6.0 / 8.2 -> 5.1 / 6.4, 64 rows 5.0 / 6.5 -> 4.5 / 5.5,
    # 128 rows 5.8 / 7.0 -> 5.5 / 6.5, 256 rows 6.9 / 8.2 -> 6.6 / 7.5.
    if m > 192:
        return GemmConfig(splits, 128, 64, bk, 8, 4)
    if m > 128:
        return GemmConfig(splits, 64, 128, bk, 4, 4)
    if m > 64:
        return GemmConfig(splits, 128, 32, bk, 4, 4)
    if m > 32:
        return GemmConfig(splits, 64, 32, bk, 4, 6)
    return GemmConfig(splits, 16 if m <= 16 else 32, 32, bk, 4, 4)


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> SplitKOutput | None:
    """x [M, K] @ weight[N, K]^T as fp32 partials, or None when no split-K configuration applies."""
    config = config or splitk_config(x.shape[0], weight.shape[0], x.shape[1])
    if config is None or not _usable(x, weight):
        return None
    return partial_linear(x, weight, config)


def dense_config(m: int, n: int, k: int, gated: bool = False) -> GemmConfig | None:
    """The configuration of the dense (or, gated, the SwiGLU) form for m rows, or None where cuBLAS
    does better. From 17 rows on: 64-row tiles (one warpgroup's wgmma), 4 stages."""
    if m > (_MAX_GATED_M if gated else MAX_DENSE_M) or m == 0 or k % 128:
        return None
    if m <= 16:  # 4 stages: gated 16 rows 6.5 us against 6.9 with 3 (weights in HBM, tune.py gemm)
        return GemmConfig(1, 16, 32, 128, 4, 4 if gated else 3)
    if k > MAX_DENSE_K:
        return None
    if gated and 32 < m <= 64:  # twice the programs: 6.6 us against 7.5 at 64 rows (weights in HBM)
        return GemmConfig(1, 64, 32, 128, 4, 4)
    return GemmConfig(1, 64, 64, 128, 4, 4)
