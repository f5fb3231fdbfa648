"""Triton kernels for attention over the paged KV cache.

Cache layout per layer: ``k_cache`` / ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; token at absolute position ``p`` of a
sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``.
"""

from nanovllm.kernels.decode_plan import alloc_decode_workspace, choose_num_splits
from nanovllm.kernels.paged_decode import paged_decode_attention
from nanovllm.kernels.paged_prefill import paged_prefill_attention
from nanovllm.kernels.store_kv import store_kv_cache

__all__ = [
    "store_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "choose_num_splits",
    "alloc_decode_workspace",
]
