"""Attention on the GPU with our Triton kernels: paged KV store, flash-decoding for the decode
rows and a varlen paged prefill kernel for the rest (chunks, prefix hits, whole prompts).

The first layer of a step records its launches on the step's metadata and the other layers replay
them with their own q, caches and output (kernels/replay.py): on steps that run attention eagerly
(between piecewise graphs) that spares each layer the launch preparation.
"""

from nanovllm.attention.base import AttentionBackend, AttentionMetadata
from nanovllm.kernels import paged_decode_attention, paged_prefill_attention, store_kv_cache
from nanovllm.kernels.decode_plan import alloc_decode_workspace, choose_num_splits
from nanovllm.kernels.replay import replay_key


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    fuses_kv_store = True  # the attention kernels read keys/values only from the cache

    def __init__(self):
        self.workspace = None

    def setup(self, max_num_seqs, num_q_heads, num_kv_heads, head_dim, max_model_len, device, max_decode_query_len=1):
        # Split partials for the worst batch size (B x Q x splits(B) peaks at some B), for every
        # query length up to the largest, allocated once so that CUDA graphs capture fixed addresses.
        rows = max(b * q * choose_num_splits(b, num_q_heads, num_kv_heads, head_dim, device, max_model_len, q)
                   for b in range(1, max_num_seqs + 1) for q in range(1, max_decode_query_len + 1))
        self.workspace = alloc_decode_workspace(rows, num_q_heads, head_dim, 1, device)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        store_kv_cache(k, v, k_cache, v_cache, slot_mapping, *(kv_scales or ()))

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, kv_scales=None):
        record = self._replayed("decode", q, k_cache, v_cache, out, meta, kv_scales)
        if record is None:
            return
        nd, query_len = meta.num_decodes, meta.decode_query_len
        hint = meta.max_seq_len_bound or meta.max_seq_len
        splits = choose_num_splits(nd, q.shape[1], k_cache.shape[2], q.shape[2], q.device, hint, query_len)
        paged_decode_attention(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                               out=out, num_splits=splits, workspace=self.workspace, order=meta.decode_order,
                               query_len=query_len, kv_scales=kv_scales, record=record[1])

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, kv_scales=None):
        record = self._replayed("prefill", q, k_cache, v_cache, out, meta, kv_scales)
        if record is None:
            return
        nd = meta.num_decodes
        paged_prefill_attention(q, k_cache, v_cache, meta.prefill_query_start_loc, meta.seq_lens[nd:],
                                meta.block_tables[nd:], meta.max_query_len, scale, out=out, kv_scales=kv_scales,
                                record=record[1])

    @staticmethod
    def _replayed(kind: str, q, k_cache, v_cache, out, meta: AttentionMetadata, kv_scales):
        """Replay this step's recorded `kind` launches with these tensors and return None; or, where
        none fit (the step's first layer), a fresh (key, launches) record kept on the metadata for
        the launcher to fill (its entries None where launches cannot be replayed)."""
        key = replay_key(q, k_cache, out, kv_scales)
        if meta.launches is None:
            meta.launches = {}
        kept = meta.launches.get(kind)
        if kept is not None and kept[0] == key and kept[1] and None not in kept[1]:
            for relaunch in kept[1]:
                relaunch(q, k_cache, v_cache, out, kv_scales)
            return None
        record = meta.launches[kind] = (key, [])
        return record
