"""Attention on the GPU with our Triton kernels: paged KV store, flash-decoding for the decode
rows and a varlen paged prefill kernel for the rest (chunks, prefix hits, whole prompts)."""

from nanovllm.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache
from nanovllm.kernels.paged_decode import alloc_decode_workspace, choose_num_splits


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    fuses_kv_store = True  # the attention kernels read keys/values only from the cache

    def __init__(self):
        self.workspace = None

    def setup(self, max_num_seqs, num_q_heads, num_kv_heads, head_dim, max_model_len, device):
        # Split partials for the worst batch size (B x splits(B) peaks at some B), allocated once
        # so that CUDA graphs capture fixed addresses.
        rows = max(b * choose_num_splits(b, num_q_heads, num_kv_heads, head_dim, device, max_model_len)
                   for b in range(1, max_num_seqs + 1))
        self.workspace = alloc_decode_workspace(rows, num_q_heads, head_dim, 1, device)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping, *(kv_scales or ()))

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, kv_scales=None):
        nd = meta.num_decodes
        hint = meta.max_seq_len_bound or meta.max_seq_len
        splits = choose_num_splits(nd, q.shape[1], k_cache.shape[2], q.shape[2], q.device, hint)
        paged_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                               out=out, num_splits=splits, workspace=self.workspace, order=meta.decode_order,
                               kv_scales=kv_scales)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, kv_scales=None):
        nd = meta.num_decodes
        paged_prefill_attention(q, k_cache, v_cache, meta.prefill_query_start_loc, meta.seq_lens[nd:],
                                meta.block_tables[nd:], meta.max_query_len, scale, out=out, kv_scales=kv_scales)
