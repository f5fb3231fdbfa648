"""Attention on the GPU with our Triton kernels: paged KV store, flash-decoding for the decode
rows and a varlen paged prefill kernel for the rest (chunks, prefix hits, whole prompts)."""

import os

from nanovllm.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache
from nanovllm.kernels.paged_decode import alloc_decode_workspace, choose_num_splits
from nanovllm.kernels.paged_decode_balanced import (alloc_balanced_workspace, balanced_num_programs,
                                                    paged_decode_attention_balanced)

# Decode batches of up to this many sequences would run the balanced schedule (kernels/paged_decode_balanced.py:
# the batch's tiles cut into equal ranges over one wave of programs), larger ones the split kernel.
# Off (0) by default: one layer alone it wins below ~40 sequences (scripts/tune_decode.py --buckets
# --balanced, H200, Qwen3-0.6B, us, balanced at 2 programs per SM / split kernel: 8: 15.0 / 16.5,
# 16: 24.7 / 27.5, 32: 44.3 / 47.1, 48: 57.4 / 56.5, 96: 88.3 / 84.4, 256: 148.8 / 141.7), but inside
# the engine up to 40 sequences it gained nothing (bench.py, decode 16-63: 2.95, 2.94 vs 3.00, 2.95 ms
# per step) and cost the single request 22% (789, 772 vs 994, 1,023 tok/s: one wave of 264 programs
# for one sequence). NANOVLLM_BALANCED_DECODE=1 runs it at every batch size.
BALANCED_DECODE_MAX_BATCH = 1 << 30 if os.environ.get("NANOVLLM_BALANCED_DECODE", "0") == "1" else 0


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    fuses_kv_store = True  # the attention kernels read keys/values only from the cache

    def __init__(self):
        self.workspace = None
        self.balanced = None  # (programs, workspace) when the balanced schedule may run
        self.balanced_max_batch = 0  # decode batches up to this size take it

    def setup(self, max_num_seqs, num_q_heads, num_kv_heads, head_dim, max_model_len, device):
        # Split partials for the worst batch size (B x splits(B) peaks at some B), allocated once
        # so that CUDA graphs capture fixed addresses.
        rows = max(b * choose_num_splits(b, num_q_heads, num_kv_heads, head_dim, device, max_model_len)
                   for b in range(1, max_num_seqs + 1))
        self.workspace = alloc_decode_workspace(rows, num_q_heads, head_dim, 1, device)
        if BALANCED_DECODE_MAX_BATCH > 0:
            programs = balanced_num_programs(device)
            self.balanced = (programs, alloc_balanced_workspace(programs, num_q_heads, num_kv_heads, head_dim, device))
            self.balanced_max_batch = BALANCED_DECODE_MAX_BATCH

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out):
        nd = meta.num_decodes
        if self.balanced is not None and nd <= self.balanced_max_batch:
            programs, workspace = self.balanced
            paged_decode_attention_balanced(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                                            out=out, num_programs=programs, workspace=workspace)
            return
        hint = meta.max_seq_len_bound or meta.max_seq_len
        splits = choose_num_splits(nd, q.shape[1], k_cache.shape[2], q.shape[2], q.device, hint)
        paged_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                               out=out, num_splits=splits, workspace=self.workspace, order=meta.decode_order)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out):
        nd = meta.num_decodes
        paged_prefill_attention(q, k_cache, v_cache, meta.prefill_query_start_loc, meta.seq_lens[nd:],
                                meta.block_tables[nd:], meta.max_query_len, scale, out=out)
