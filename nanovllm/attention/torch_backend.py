"""Reference attention on plain torch: correct on any device, fast enough for the CPU."""
import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend, AttentionMetadata


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:length]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        for i in range(nd, meta.num_seqs):
            start, end = qsl[i], qsl[i + 1]
            out[start:end] = self._prefill_one(q[start:end], k_cache, v_cache,
                                               meta.block_tables[i], lens[i], scale)
        return out

    @staticmethod
    def _prefill_one(q, k_cache, v_cache, block_table, seq_len, scale):
        # q: [L, Hq, D] are the last L positions of a context of seq_len tokens.
        q_len = q.shape[0]
        k = gather_context(k_cache, block_table, seq_len)
        v = gather_context(v_cache, block_table, seq_len)
        qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, L|S, D]
        if q_len == seq_len:
            o = _sdpa(qh, kh, vh, None, True, scale)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
            o = _sdpa(qh, kh, vh, mask, False, scale)
        return o.transpose(0, 1)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale):
        # All decode rows at once, padded to the longest context: [B, H, 1|S, D].
        nd = meta.num_decodes
        lens = meta.seq_lens[:nd]
        max_len = max(meta.seq_lens_host[:nd])
        block_size = k_cache.shape[1]
        tables = meta.block_tables[:nd, : -(-max_len // block_size)]
        k = k_cache[tables].flatten(1, 2)[:, :max_len]  # [B, S, Hkv, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len]
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, S]
        o = _sdpa(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), mask[:, None, None, :], False, scale)
        return o.squeeze(2)


def _sdpa(q, k, v, mask, causal, scale):
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: share each KV head
        rep = q.shape[-3] // k.shape[-3]
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    """Write the new tokens' K/V at their slots (this backend never sees padding slots)."""
    hkv, d = k_cache.shape[-2:]
    k_flat = k_cache.view(-1, hkv, d)
    v_flat = v_cache.view(-1, hkv, d)
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))
