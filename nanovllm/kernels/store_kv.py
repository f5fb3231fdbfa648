"""Write freshly computed keys/values into the paged KV cache.

Cache layout (per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token ``i`` of the batch goes to ``slot_mapping[i] = block_id * block_size + offset``.
A negative slot means "skip": CUDA-graph padding rows carry slot -1. An FP8 cache
(float8_e4m3fn) holds k / k_scale and v / v_scale per KV head, quantized here as they are written.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8 import FP8_DTYPE, quantize_to_fp8
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    block_size,
    stride_kn, stride_kh,  # key   [N, H, D], last dim has unit stride
    stride_vn, stride_vh,  # value [N, H, D]
    stride_cb, stride_ct, stride_ch,  # k_cache strides (block, token, head)
    stride_vcb, stride_vct, stride_vch,  # v_cache strides
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    pdl_prologue()
    # One program per token: it copies all [num_kv_heads, head_dim] values.
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    if slot < 0:
        return
    # int64: block_id * stride_cb can exceed 2^31 for large caches.
    blk = slot // block_size
    off = slot % block_size

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # Only mask along head_dim when it is padded: a mask varying along the contiguous
    # dimension prevents 16-byte vector loads/stores.
    if BLOCK_D == HEAD_DIM:
        mask = h[:, None] < NUM_HEADS
    else:
        mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)

    row = i.to(tl.int64)
    k = tl.load(key_ptr + row * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + row * stride_vn + h[:, None] * stride_vh + d[None, :], mask=mask)

    k_dst = k_cache_ptr + blk * stride_cb + off * stride_ct + h[:, None] * stride_ch + d[None, :]
    v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + d[None, :]
    if KV_FP8:
        k_s = tl.load(k_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)[:, None]
        v_s = tl.load(v_scale_ptr + h, mask=h < NUM_HEADS, other=1.0)[:, None]
        tl.store(k_dst, quantize_to_fp8(k.to(tl.float32), k_s), mask=mask)
        tl.store(v_dst, quantize_to_fp8(v.to(tl.float32), v_s), mask=mask)
    else:
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``key``/``value`` ``[N, num_kv_heads, head_dim]`` into the caches at
    ``slot_mapping`` ``[N]`` (int32/int64; slots < 0 are skipped). In place. An FP8 cache needs
    k_scale / v_scale ``[num_kv_heads]`` (fp32): it gets key / k_scale and value / v_scale."""
    n, num_heads, head_dim = key.shape
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    assert not kv_fp8 or (k_scale is not None and v_scale is not None), "an FP8 cache needs k_scale and v_scale"
    assert value.shape == key.shape and slot_mapping.numel() == n
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_heads, head_dim)
    if n == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_h = triton.next_power_of_2(num_heads)
    block_d = triton.next_power_of_2(head_dim)
    # Big rows (many heads x wide dims) get more warps so each thread moves ~16B chunks.
    num_warps = 4 if block_h * block_d <= 4096 else 8
    _store_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping, *((k_scale, v_scale) if kv_fp8 else (k_cache, k_cache)),
        k_cache.shape[1],
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, KV_FP8=kv_fp8,
        num_warps=num_warps, **PDL_LAUNCH)
