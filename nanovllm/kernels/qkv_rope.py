"""The qkv projection of a decode batch with the rotary kernel's work in its epilogue: one launch
computes x @ W_qkv^T a head at a time (a program's tile is BM tokens x one head), and instead of
writing the [M, (Hq + 2 Hkv) D] product it normalises (Qwen3's q/k RMSNorm) and rotates q and k,
writes q, and stores the new keys and values straight into the paged KV cache.

The arithmetic is the unfused pair's (our dense GEMM, then `rope.qk_norm_rope_store_kv`): the
product is rounded to the activation dtype as a GEMM output would be, then `norm_rope_math` (the
rotary kernel's own code) runs on it, without FMA contraction. Only the GEMM's fp32 accumulation
order may differ from the unfused pair's tile shape, as between any two GEMM configurations.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.fp8 import FP8_DTYPE, quantize_to_fp8
from nanovllm.kernels.rope import norm_rope_math
from nanovllm.kernels.gemm import MAX_DENSE_K, mainloop, tma_compatible
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_kernel(
    a_desc, w_desc, M,
    pos_ptr, cs_ptr, slot_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr,
    stride_cs, stride_qot, stride_qoh, stride_cb, stride_ct, stride_ch, block_size,
    eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, HAS_NORM: tl.constexpr, KV_FP8: tl.constexpr,
):
    # grid = (Hq + 2 Hkv heads, cdiv(M, BM)). Positions, slots and the cos/sin table are step
    # inputs and constants: read before the programmatic-launch wait.
    head = tl.program_id(0)
    m0 = tl.program_id(1) * BM
    rm = m0 + tl.arange(0, BM)
    row_ok = rm < M
    d = tl.arange(0, HALF)[None, :]
    pos = tl.load(pos_ptr + rm, mask=row_ok, other=0).to(tl.int64)[:, None]
    cos = tl.load(cs_ptr + pos * stride_cs + d).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d).to(tl.float32)
    slot = tl.load(slot_ptr + rm, mask=row_ok, other=-1).to(tl.int64)
    pdl_prologue()
    acc, _ = mainloop(a_desc, w_desc, m0, head * HEAD_DIM, 0, 0, K, BM, HEAD_DIM, BK, False)
    in_ty = a_desc.dtype
    x = acc.to(in_ty).to(tl.float32)  # the projection's output, rounded as the GEMM would write it
    # The two rotate-half halves of the head: columns [0, HALF) and [HALF, HEAD_DIM).
    x1, x2 = tl.split(tl.permute(tl.reshape(x, [BM, 2, HALF]), (0, 2, 1)))
    out_ty = q_out_ptr.dtype.element_ty
    if head < HQ:
        o1, o2 = norm_rope_math(x1, x2, qw_ptr, d, cos, sin, eps, in_ty, HAS_NORM, HALF, BM, out_ty)
        # Each branch names its own destination: Triton merges a name bound in both branches of a
        # runtime `if`, and q's pointer type differs from an FP8 cache's.
        q_dst = q_out_ptr + rm.to(tl.int64)[:, None] * stride_qot + head * stride_qoh + d
        tl.store(q_dst, o1.to(out_ty), mask=row_ok[:, None])
        tl.store(q_dst + HALF, o2.to(out_ty), mask=row_ok[:, None])
    else:
        # Slot < 0: a padding row of a CUDA-graph batch (and rows past M), not stored.
        row = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
        ok = (slot >= 0)[:, None]
        # An FP8 cache holds each head divided by its scale (the store kernels' arithmetic).
        if head < HQ + HKV:
            o1, o2 = norm_rope_math(x1, x2, kw_ptr, d, cos, sin, eps, in_ty, HAS_NORM, HALF, BM, out_ty)
            k_dst = k_cache_ptr + row[:, None] + (head - HQ) * stride_ch + d
            cache_ty = k_cache_ptr.dtype.element_ty
            if KV_FP8:
                s = tl.load(ks_ptr + head - HQ)
                tl.store(k_dst, quantize_to_fp8(o1.to(out_ty).to(tl.float32), s), mask=ok)
                tl.store(k_dst + HALF, quantize_to_fp8(o2.to(out_ty).to(tl.float32), s), mask=ok)
            else:
                tl.store(k_dst, o1.to(out_ty).to(cache_ty), mask=ok)
                tl.store(k_dst + HALF, o2.to(out_ty).to(cache_ty), mask=ok)
        else:
            v_dst = v_cache_ptr + row[:, None] + (head - HQ - HKV) * stride_ch + d
            if KV_FP8:
                s = tl.load(vs_ptr + head - HQ - HKV)
                tl.store(v_dst, quantize_to_fp8(x1, s), mask=ok)
                tl.store(v_dst + HALF, quantize_to_fp8(x2, s), mask=ok)
            else:
                tl.store(v_dst, x1.to(v_cache_ptr.dtype.element_ty), mask=ok)
                tl.store(v_dst + HALF, x2.to(v_cache_ptr.dtype.element_ty), mask=ok)


class QkvRopeConfig(NamedTuple):
    bm: int
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 3


# Only for the hidden sizes measured (kernels/gemm.py's MAX_DENSE_K): a one-head program of a wider
# model would have too many weights to stream. Measured on the H200 (Qwen3-0.6B,
# us per layer, fused / our GEMM + rotary kernel / cuBLAS + rotary kernel): 16 rows 7.0 / 8.3 / 8.5,
# 32: 6.9 / 7.5 / 9.1, 64: 7.2 / 7.7 / 9.1, 128: 7.4 / 7.9 / 8.5; 192: 8.5 / - / 9.8, 256: 8.5 / - / 10.5
# (our plain dense GEMM stops at 128 rows, the fused kernel does not); 16-row tiles up to 64 rows, then 64.
MAX_QKV_ROPE_M = 256


def qkv_rope_config(m: int, k: int, head_dim: int) -> QkvRopeConfig | None:
    """The fused kernel's tiles for m rows, or None where the unfused pair runs. Host-only."""
    # head_dim 256 would need a 64 KB weight tile per stage: 4 stages do not fit in shared memory.
    if not 1 <= m <= MAX_QKV_ROPE_M or k % 128 or k > MAX_DENSE_K or head_dim not in (64, 128):
        return None
    return QkvRopeConfig(16 if m <= 64 else 64, 128, 4, 4)


def qkv_rope_store_kv(x: torch.Tensor, weight: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                      k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                      config: QkvRopeConfig | None = None, q_out: torch.Tensor | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """``qk_norm_rope_store_kv(*split(x @ weight^T))`` in one launch: returns q ``[M, Hq, D]``
    (normed with q_weight when given, rotated) and writes k (normed, rotated) and v into the caches
    ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` (slots < 0 skipped; an FP8 cache gets
    them divided by k_scale / v_scale ``[Hkv]``). weight: the fused ``[(Hq + 2 Hkv) D, K]`` projection;
    q_out: q's buffer, else fresh memory. None (nothing done) where no configuration applies."""
    m, k = x.shape
    head_dim = k_cache.shape[-1]
    config = config or qkv_rope_config(m, k, head_dim)
    if config is None or m == 0 or not (tma_compatible(x) and tma_compatible(weight)):
        return None
    assert weight.shape == ((num_q_heads + 2 * num_kv_heads) * head_dim, k) and x.dtype == weight.dtype
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
    has_norm = q_weight is not None
    out_dtype = torch.promote_types(x.dtype, q_weight.dtype) if has_norm else x.dtype
    if q_out is None:
        q = torch.empty(m, num_q_heads, head_dim, dtype=out_dtype, device=x.device)
    else:
        q = q_out
        assert q.shape == (m, num_q_heads, head_dim) and q.dtype == out_dtype and q.stride(-1) == 1, (q.shape, q.dtype)
    if not has_norm:  # HAS_NORM=False never reads them; any valid pointer
        q_weight = k_weight = cos_sin_cache
    bm, bk, warps, stages = config
    _qkv_rope_kernel[(num_q_heads + 2 * num_kv_heads, triton.cdiv(m, bm))](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [head_dim, bk]), m,
        positions.reshape(-1), cos_sin_cache, slot_mapping.reshape(-1), q_weight.contiguous(), k_weight.contiguous(),
        q, k_cache, v_cache, *((k_scale, v_scale) if kv_fp8 else (cos_sin_cache,) * 2),
        cos_sin_cache.stride(0), q.stride(0), q.stride(1), *k_cache.stride()[:3], k_cache.shape[1],
        float(eps),
        HQ=num_q_heads, HKV=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2, K=k, BM=bm, BK=bk, HAS_NORM=has_norm,
        KV_FP8=kv_fp8, num_warps=warps, num_stages=stages, enable_fp_fusion=False, **PDL_LAUNCH)
    return q
