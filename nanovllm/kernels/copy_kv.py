"""Copy the leading tokens of cache blocks into other blocks, in every layer, keys and values: how
a request whose prefix-cache hit ends inside a block (256 tokens by default) starts its own block.

The KV cache is one tensor ``[2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]``
(worker/model_runner.py), so the first n tokens of a block in one layer's keys (or values) are
n * num_kv_heads * head_dim contiguous elements: one launch makes all of a step's copies in all
layers. Each program moves a tile of whole tokens of one copy in one (K/V, layer) plane.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue


@triton.jit(do_not_specialize=["num_copies"])
def _copy_kv_prefix_kernel(
    kv_ptr, copies_ptr,  # copies [3, C] int64: source blocks, destination blocks, tokens
    num_copies, plane_stride, block_stride,
    TOKEN_ELEMS: tl.constexpr,  # num_kv_heads * head_dim: one token's elements in one plane
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    pdl_prologue()  # the source blocks were written by earlier kernels
    c = tl.program_id(0)
    plane = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_T
    n = tl.load(copies_ptr + 2 * num_copies + c)
    if t0 >= n:
        return
    src = tl.load(copies_ptr + c)
    dst = tl.load(copies_ptr + num_copies + c)
    t = t0 + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    # Masked along tokens only, unless a token's elements are padded: a mask that varies along the
    # contiguous dimension would prevent 16-byte vector loads and stores.
    if BLOCK_E == TOKEN_ELEMS:
        mask = t[:, None] < n
    else:
        mask = (t[:, None] < n) & (e[None, :] < TOKEN_ELEMS)
    offs = t[:, None] * TOKEN_ELEMS + e[None, :]
    base = kv_ptr + plane.to(tl.int64) * plane_stride  # int64: a cache can exceed 2^31 elements
    x = tl.load(base + src * block_stride + offs, mask=mask)
    tl.store(base + dst * block_stride + offs, x, mask=mask)


def copy_kv_prefixes(kv_cache: torch.Tensor, copies: torch.Tensor, max_tokens: int) -> None:
    """For each column (src, dst, n) of ``copies`` ([3, C] int64, on the cache's device), copy the
    first n tokens of block src into block dst, in every layer, K and V; ``max_tokens`` is the
    largest n (it sizes the grid). No block may be both a source and a destination. In place."""
    two, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    assert kv_cache.is_contiguous() and copies.dtype == torch.int64 and copies.shape[0] == 3
    num_copies = copies.shape[1]
    if num_copies == 0 or max_tokens <= 0:
        return
    assert max_tokens <= block_size
    if kv_cache.element_size() == 1:  # an FP8 cache: its bytes, never a conversion
        kv_cache = kv_cache.view(torch.uint8)
    token_elems = num_kv_heads * head_dim
    block_e = triton.next_power_of_2(token_elems)
    block_t = max(1, min(triton.next_power_of_2(block_size), 8192 // block_e))
    grid = (num_copies, two * num_layers, triton.cdiv(max_tokens, block_t))
    _copy_kv_prefix_kernel[grid](
        kv_cache, copies.contiguous(), num_copies, kv_cache.stride(1), kv_cache.stride(2),
        TOKEN_ELEMS=token_elems, BLOCK_T=block_t, BLOCK_E=block_e,
        num_warps=4 if block_t * block_e <= 4096 else 8, **PDL_LAUNCH)
