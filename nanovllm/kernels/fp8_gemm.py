"""W8A8 block-scaled FP8 GEMMs (the Qwen3-*-FP8 / DeepSeek recipe): y = x @ W^T with x in 1 x 128
groups (`fp8_quant.QuantizedActivation`) and W [N, K] float8_e4m3fn in 128 x 128 blocks with one
fp32 scale each (`weight_scale_inv` [ceil(N/128), ceil(K/128)]), partial blocks at the edges.

Decode-sized batches take our Triton kernel, one `tl.dot` of FP8 tensor-core products per 128-deep
K block, scaled by that block's activation and weight scales into an fp32 accumulator (so the
products never accumulate across blocks in the tensor core's reduced precision), in the forms of
kernels/gemm.py:
- dense: the product in the activation dtype (qkv_proj);
- gated: silu(x @ G^T) * (x @ U^T) for gate_up_proj, written as the block-FP8 input of down_proj
  when a program's 128 output columns are exactly one group (no [M, 2I] product, no quant kernel);
- partials: K cut into S slices of fp32 partial products that the next residual-add RMSNorm sums
  (`gemm.SplitKOutput`), for o_proj / down_proj: at a decode step an N=4096 output has too few
  tiles to keep the memory system busy.
Products of more than a few rows (LIBRARY_MIN_M) go to torch's block-scaled `torch._scaled_mm`
(cuBLASLt, CUDA >= 12.9, sm_90) where a start-up check on the device finds it present and exact
(`library_available`), split-K ones past MAX_SPLITK_M; else to the same Triton kernel (large tiles
past MAX_TRITON_M rows). Tile tables are fixed (no autotuning): the kernel is launched
inside CUDA-graph captures and must not benchmark there.
"""
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.fp8_quant import (GROUP_SIZE, QuantizedActivation, empty_quantized, quantize_groups,
                                        per_token_group_quant)
from nanovllm.kernels.fused_ops import silu_mul
from nanovllm.kernels.gemm import SplitKOutput, tma_compatible
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue

BLOCK_K = GROUP_SIZE  # one K block of the weight (and one activation group) per iteration
_BLOCK_K = tl.constexpr(BLOCK_K)  # the kernels' view: a compiled kernel reads only constexpr globals
# Rows up to which the decode-sized tiles serve (weights-bound: one row of tiles); past it the
# prefill tiles, where the library's GEMM is unavailable.
MAX_TRITON_M = 128
# Where the library's GEMM is available it takes the dense and gated products of more rows than
# this: on the H200 (BENCHMARKS.md "FP8 kernels", 2026-12-04) cuBLASLt's block-scaled GEMM is as
# fast as ours from 32 rows on and far faster at 128 (Qwen3-8B gate_up + silu_and_mul_quant 40.5 us
# against our gated kernel's 64.6). Our split-K form (o_proj, down_proj) stays faster up to
# MAX_SPLITK_M (down at 128 rows: 32.0 against 36.3 us).
LIBRARY_MIN_M = 17
# Split-K (partials) up to this many rows: past it the partials' traffic (S x M x N x 4 bytes)
# approaches the weights'.
MAX_SPLITK_M = 128


@triton.jit
def fp8_mainloop(a_desc, a_ptr, as_ptr, w_desc, w_ptr, ws_ptr, M, W_ROWS, K, stride_as, stride_ws,
                 m0, n0, kb0, up_row, K_BLOCKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 GATED: tl.constexpr, TMA: tl.constexpr):
    """The [BM, BN] fp32 tile at (m0, n0) of dequant(a) @ dequant(w)^T over the K blocks
    [kb0, kb0 + K_BLOCKS), and (GATED) the tile of rows n0 + up_row of w. a: [M(+pad), K] fp8 with
    scales as_ptr[kb * stride_as + row]; w: [W_ROWS, K] fp8 with scales ws_ptr[(row // 128) *
    stride_ws + kb]. Operands through TMA descriptors (zero-filled past the edges) or masked loads."""
    acc = tl.zeros([BM, BN], tl.float32)
    acc_u = tl.zeros([BM, BN], tl.float32)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    kk = tl.arange(0, _BLOCK_K)
    m_ok = rm < M
    n_ok = rn < W_ROWS
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * K
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * K
    ws_rows = ws_ptr + (rn // _BLOCK_K) * stride_ws
    if GATED:
        w_rows_u = w_ptr + (rn + up_row).to(tl.int64)[:, None] * K
        ws_rows_u = ws_ptr + ((rn + up_row) // _BLOCK_K) * stride_ws
        n_ok_u = rn + up_row < W_ROWS
    for kb in range(kb0, kb0 + K_BLOCKS):
        k = kb * _BLOCK_K
        if TMA:
            a = a_desc.load([m0, k])
            w = w_desc.load([n0, k])
        else:
            k_ok = (k + kk < K)[None, :]
            a = tl.load(a_rows + (k + kk)[None, :], mask=m_ok[:, None] & k_ok, other=0.0)
            w = tl.load(w_rows + (k + kk)[None, :], mask=n_ok[:, None] & k_ok, other=0.0)
        # Padding rows (past M) have any scale: 0 keeps them finite; they are never stored.
        a_s = tl.load(as_ptr + kb * stride_as + rm, mask=m_ok, other=0.0)
        w_s = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, w.T) * (a_s[:, None] * w_s[None, :])
        if GATED:
            if TMA:
                u = w_desc.load([n0 + up_row, k])
            else:
                u = tl.load(w_rows_u + (k + kk)[None, :], mask=n_ok_u[:, None] & k_ok, other=0.0)
            u_s = tl.load(ws_rows_u + kb, mask=n_ok_u, other=0.0)
            acc_u += tl.dot(a, u.T) * (a_s[:, None] * u_s[None, :])
    return acc, acc_u


@triton.jit(do_not_specialize=["M", "stride_as", "stride_qs"])
def _fp8_gemm_kernel(a_desc, a_ptr, as_ptr, w_desc, w_ptr, ws_ptr, out_ptr, q_ptr, qs_ptr,
                     M, N, W_ROWS, K, stride_as, stride_ws, stride_om, stride_qs, up_row,
                     K_BLOCKS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GATED: tl.constexpr,
                     PARTIALS: tl.constexpr, QUANT_OUT: tl.constexpr, TMA: tl.constexpr, OUT_TY: tl.constexpr,
                     GROUP_M: tl.constexpr):
    pdl_prologue()
    # Programs walk the tiles GROUP_M rows of tiles at a time, down the rows first: the programs in
    # flight then share a few weight tiles and a few activation tiles (both stay in L2). Walking along
    # N first re-reads every weight tile from HBM once per row of tiles (prefill: 32 times at 2k rows).
    # A decode batch has one row of tiles: pid_n is the program id.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    m0 = pid_m * BM
    n0 = pid_n * BN
    acc, acc_u = fp8_mainloop(a_desc, a_ptr, as_ptr, w_desc, w_ptr, ws_ptr, M, W_ROWS, K, stride_as, stride_ws,
                              m0, n0, pid_k * K_BLOCKS, up_row, K_BLOCKS, BM, BN, GATED, TMA)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    if PARTIALS:
        tl.store(out_ptr + (pid_k * M + rm)[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mask)
    elif GATED:
        # As the unfused pair: gate and up rounded as a GEMM writes them, then silu_and_mul's arithmetic.
        h = silu_mul(acc.to(OUT_TY).to(tl.float32), acc_u.to(OUT_TY).to(tl.float32), OUT_TY).to(OUT_TY)
        if QUANT_OUT:  # BN == 128, n0 a multiple of 128: this tile's columns are one group of each row
            q, s = quantize_groups(tl.where(mask, h.to(tl.float32), 0.0), BM, 1, BN)
            tl.store(q_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], q, mask=mask)
            tl.store(qs_ptr + pid_n * stride_qs + rm[:, None], s, mask=(rm < M)[:, None])
        else:
            tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], h, mask=mask)
    else:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(OUT_TY), mask=mask)


class Fp8GemmConfig(NamedTuple):
    splits: int
    bm: int
    bn: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # rows of tiles walked together (the kernel's GROUP_M); no effect on one row


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _launch(x: QuantizedActivation, weight, scale, out, n, config: Fp8GemmConfig, gated=False, partials=False,
            quant_out: QuantizedActivation | None = None):
    m, k = x.shape
    splits, bm, bn, warps, stages, group_m = config
    k_blocks = triton.cdiv(k, BLOCK_K)
    assert k_blocks % splits == 0, (k, config)
    # TMA operands for 64-row tiles (wgmma from shared memory, Hopper's usual FP8 path); 16-row tiles
    # (mma.sync) keep vLLM's known-good pointer loads.
    tma = bm >= 64 and tma_compatible(x.data) and tma_compatible(weight)
    if tma:
        a_desc = TensorDescriptor.from_tensor(x.data, [bm, BLOCK_K])
        w_desc = TensorDescriptor.from_tensor(weight, [bn, BLOCK_K])
    else:
        a_desc = w_desc = x.data  # TMA=False never reads them
    q, qs = (quant_out.data, quant_out.scale) if quant_out is not None else (out, out)
    _fp8_gemm_kernel[(triton.cdiv(n, bn) * triton.cdiv(m, bm), splits)](
        a_desc, x.data, x.scale, w_desc, weight, scale, out, q, qs,
        m, n, weight.shape[0], k, x.scale.stride(0), scale.stride(0), out.stride(-2), qs.stride(0), n if gated else 0,
        K_BLOCKS=k_blocks // splits, BM=bm, BN=bn, GATED=gated, PARTIALS=partials, QUANT_OUT=quant_out is not None,
        TMA=tma, OUT_TY=_TL_DTYPES[x.dtype], GROUP_M=group_m, num_warps=warps, num_stages=stages, **PDL_LAUNCH)


def _check(x: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor):
    n, k = weight.shape
    assert x.data.shape[1] == k and weight.dtype == x.data.dtype, (x.data.shape, weight.shape, weight.dtype)
    assert scale.shape == (triton.cdiv(n, BLOCK_K), triton.cdiv(k, BLOCK_K)) and scale.stride(-1) == 1, scale.shape
    assert weight.stride(-1) == 1 and x.data.stride(-1) == 1


def fp8_linear(x: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor,
               config: Fp8GemmConfig) -> torch.Tensor:
    """x @ dequant(weight)^T in x.dtype: [rows, N]."""
    _check(x, weight, scale)
    out = torch.empty(x.rows, weight.shape[0], dtype=x.dtype, device=weight.device)
    if x.rows:
        _launch(x, weight, scale, out, weight.shape[0], config._replace(splits=1))
    return out


def fp8_partial_linear(x: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor,
                       config: Fp8GemmConfig) -> SplitKOutput:
    """x @ dequant(weight)^T as `config.splits` fp32 partial products [S, rows, N]."""
    _check(x, weight, scale)
    parts = torch.empty(config.splits, x.rows, weight.shape[0], dtype=torch.float32, device=weight.device)
    if x.rows:
        _launch(x, weight, scale, parts, weight.shape[0], config, partials=True)
    return SplitKOutput(parts, x.dtype)


def fp8_gated_linear(x: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor, config: Fp8GemmConfig,
                     quantize_output: bool) -> torch.Tensor | QuantizedActivation:
    """silu(x @ gate^T) * (x @ up^T) for weight = [gate | up] ([2I, K]) -> [rows, I], in block FP8
    when quantize_output, else in x.dtype. The block-FP8 output comes from the tile's epilogue when
    config.bn == 128 (one group per tile), else from a quantization pass over the x.dtype output."""
    _check(x, weight, scale)
    inter = weight.shape[0] // 2
    assert weight.shape[0] % 2 == 0 and inter % BLOCK_K == 0, weight.shape  # up's blocks start at a block
    config = config._replace(splits=1)
    if quantize_output and config.bn != GROUP_SIZE:
        return per_token_group_quant(fp8_gated_linear(x, weight, scale, config, quantize_output=False))
    if quantize_output:
        out = empty_quantized(x.rows, inter, x.dtype, weight.device)
        if x.rows:
            _launch(x, weight, scale, out.data, inter, config, gated=True, quant_out=out)
        return out
    out = torch.empty(x.rows, inter, dtype=x.dtype, device=weight.device)
    if x.rows:
        _launch(x, weight, scale, out, inter, config, gated=True)
    return out


# ---- tiles -----------------------------------------------------------------------------------
# Fixed tables for the H200, started from vLLM's tuned H200 tables of its block-FP8 Triton GEMM
# (16-row tiles up to 16 rows, 64-row tiles beyond, BK=128) and checked by `scripts/gpu_kernels.py fp8
# --sweep` (2026-12-02, Qwen3-8B shapes, us per call at M=1 table before -> now: gate_up 41.0 -> 34.6
# with 8 warps, down 17.5 -> 16.7 with 8 splits of 64 columns, o 7.9 -> 7.5; at M=2048 walking 32 rows
# of tiles together 2-5% faster than 8 or 1). A decode batch fits one row of tiles (the weights are
# read once); the tiles along N are then as wide as still gives about one program per SM, and where
# no width of 64 or more does, 16 columns, 2 warps and 6 stages (qkv of Qwen3-8B, N=6144, 384
# programs: 13.9 us at M=1 and 14.9 at 16 against 16.2 / 16.8 with 32 columns). The gated form
# computes two products per tile; from 17 rows it quantizes its output per tile: 128 columns (one
# group), 8 warps to hold both fp32 accumulators and a block's products in registers. Up to 16 rows
# that tile gives too few programs (Qwen3-8B gate_up: 96 for 132 SMs, 34.7 us at M=1): 32 columns, 2
# warps and 4 stages, then a quantization pass, take 29.9 (2026-12-04), 0.6B's 11.0 -> 6.2 us.
PREFILL_CONFIG = Fp8GemmConfig(1, 64, 128, 4, 3, 32)  # where the library GEMM is unavailable
_MIN_PROGRAMS = 128


def fp8_dense_config(m: int, n: int) -> Fp8GemmConfig:
    if m > MAX_TRITON_M:
        return PREFILL_CONFIG
    bm, stages = (16, 5) if m <= 16 else (64, 4)
    rows = triton.cdiv(m, bm)
    bn = next((bn for bn in (128, 64) if triton.cdiv(n, bn) * rows >= _MIN_PROGRAMS), None)
    if bn is not None:
        return Fp8GemmConfig(1, bm, bn, 4, stages)
    return Fp8GemmConfig(1, 16, 16, 2, 6) if m <= 16 else Fp8GemmConfig(1, bm, 32, 4, stages)


def fp8_gated_config(m: int) -> Fp8GemmConfig:
    if m <= 16:  # 32 columns: 4x the programs of the 128-column tile that quantizes its own output
        return Fp8GemmConfig(1, 16, 32, 2, 4)
    return Fp8GemmConfig(1, 64, 128, 8, 3, 32 if m > MAX_TRITON_M else 8)


def fp8_splitk_config(m: int, k: int) -> Fp8GemmConfig | None:
    """Split-K tiles for m rows (None: past MAX_SPLITK_M, or K's blocks do not divide)."""
    if m > MAX_SPLITK_M or m == 0:
        return None
    k_blocks = triton.cdiv(k, BLOCK_K)
    if m <= 16:  # deep K (down_proj's 96 blocks): 8 slices keep more loads in flight
        config = Fp8GemmConfig(8, 16, 64, 4, 6) if k_blocks >= 64 and k_blocks % 8 == 0 else Fp8GemmConfig(4, 16, 64, 4, 4)
    else:
        config = Fp8GemmConfig(4 if m <= 64 else 2, 64, 64, 4, 4)
    return config if k_blocks % config.splits == 0 else None


# ---- the library's GEMM ------------------------------------------------------------------------
def library_scaled_mm(x: QuantizedActivation, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequant(weight)^T by torch._scaled_mm with 1x128 activation and 128x128 weight scales:
    a row-major A [M_pad, K], B = weight^T (column-major), scale_a [M_pad, K/128] outer-dim-major
    (x.scale transposed), scale_b [K/128, N/128] = scale^T."""
    out = torch._scaled_mm(x.data, weight.t(), scale_a=x.scale.t(), scale_b=scale.t(), bias=bias,
                           out_dtype=x.dtype)
    return out[:x.rows]


def library_applies(weight: torch.Tensor) -> bool:
    """Shapes cuBLASLt's block-scaled kernels take: K and N in whole blocks (and bf16 activations,
    `library_takes`)."""
    n, k = weight.shape
    return n % BLOCK_K == 0 and k % BLOCK_K == 0 and library_available(weight.device)


def library_takes(x: QuantizedActivation) -> bool:
    """The library GEMM for these rows (a dense or gated product, or one past split-K's sizes): from
    LIBRARY_MIN_M rows, with the bf16 output the start-up check verified (fp16 / fp32 models keep our
    kernel)."""
    return x.rows >= LIBRARY_MIN_M and x.dtype == torch.bfloat16


@functools.lru_cache(maxsize=None)
def library_available(device: torch.device) -> bool:
    """Whether this torch and device run the block-scaled `torch._scaled_mm` and get our reference's
    result (checked once per device on a small product; any error -> False: our kernel serves all sizes)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    from nanovllm.kernels.reference import per_token_group_quant_fp8, w8a8_block_matmul
    gen = torch.Generator(device=device).manual_seed(0)
    try:
        x = torch.randn(20, 512, device=device, generator=gen).to(torch.bfloat16)
        w = (torch.randn(384, 512, device=device, generator=gen) * 8).to(torch.float8_e4m3fn)
        ws = torch.rand(3, 4, device=device, generator=gen) * 1e-2 + 1e-3
        xq = per_token_group_quant(x)
        got = library_scaled_mm(xq, w, ws)
        q, s = per_token_group_quant_fp8(x)
        want = w8a8_block_matmul(q, s, w, ws, torch.float32)
        torch.cuda.synchronize(device)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return bool(torch.allclose(got.float(), want, rtol=2e-2, atol=1e-3 * want.abs().max().item()))
