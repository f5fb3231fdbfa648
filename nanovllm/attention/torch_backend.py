"""Reference attention on plain torch: correct on any device, fast enough for the CPU."""
import torch
import torch.nn.functional as F

from nanovllm.attention.base import AttentionBackend, AttentionMetadata


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return _index_select(cache, block_table[:num_blocks]).flatten(0, 1)[:length]


def _index_select(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache.index_select(0, index); an FP8 cache's rows as bytes (not every device's index ops take fp8)."""
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8).index_select(0, index).view(cache.dtype)
    return cache.index_select(0, index)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
        store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, kv_scales=None):
        out.copy_(self._decode(q, k_cache, v_cache, meta, scale, kv_scales))

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out, kv_scales=None):
        nd, nt = meta.num_decodes, meta.num_decode_tokens  # q starts after the decode tokens
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        for i in range(nd, meta.num_seqs):
            start, end = qsl[i] - nt, qsl[i + 1] - nt
            out[start:end] = self._prefill_one(q[start:end], k_cache, v_cache, meta.block_tables[i], lens[i], scale,
                                               kv_scales)

    @staticmethod
    def _prefill_one(q, k_cache, v_cache, block_table, seq_len, scale, kv_scales):
        # q: [L, Hq, D] are the last L positions of a context of seq_len tokens.
        q_len = q.shape[0]
        k = gather_context(k_cache, block_table, seq_len)
        v = gather_context(v_cache, block_table, seq_len)
        if kv_scales is not None:
            k, v = dequantize_kv(k, kv_scales[0], q.dtype), dequantize_kv(v, kv_scales[1], q.dtype)
        qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))  # [H, L|S, D]
        if q_len == seq_len:
            o = _sdpa(qh, kh, vh, None, True, scale)
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
            o = _sdpa(qh, kh, vh, mask, False, scale)
        return o.transpose(0, 1)

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale, kv_scales):
        # All decode rows at once, padded to the longest context. Keys are gathered by slot (not by
        # whole block: a 256-token block of a short context is mostly unused), and the query heads
        # of each KV head form the "query length" of one SDPA call: [B, Hkv, group, D], so GQA
        # needs no copy of the keys per query head.
        nd = meta.num_decodes
        if meta.decode_query_len > 1:
            return TorchAttentionBackend._multi_query_decode(q, k_cache, v_cache, meta, scale, kv_scales)
        num_kv_blocks, block_size, hkv, d = k_cache.shape
        if meta.decode_gather is None:
            max_len = max(meta.seq_lens_host[:nd])
            pos = torch.arange(max_len, device=q.device)
            tables = meta.block_tables[:nd, : -(-max_len // block_size)]
            rows = (tables[:, pos // block_size].long() * block_size + pos % block_size).view(-1)  # [B * S]
            mask = (pos[None, :] < meta.seq_lens[:nd, None])[:, None, None, :]  # [B, 1, 1, S]
            meta.decode_gather = rows, mask
        rows, mask = meta.decode_gather
        # index_select copies whole rows: much faster on the CPU than advanced indexing by [B, S] slots.
        k = _index_select(k_cache.view(-1, hkv * d), rows).view(nd, -1, hkv, d)  # [B, S, Hkv, D]
        v = _index_select(v_cache.view(-1, hkv * d), rows).view(nd, -1, hkv, d)
        if kv_scales is not None:
            k, v = dequantize_kv(k, kv_scales[0], q.dtype), dequantize_kv(v, kv_scales[1], q.dtype)
        qg = q.reshape(nd, hkv, -1, d)  # query head h belongs to KV head h // group
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
        return o.reshape(q.shape)

    @staticmethod
    def _multi_query_decode(q, k_cache, v_cache, meta, scale, kv_scales):
        """decode_query_len tokens per sequence, the last positions of its context (a row at a
        negative position, or of a padding row, gives zeros as the Triton kernel does)."""
        query_len = meta.decode_query_len
        out = torch.zeros_like(q)
        for i, length in enumerate(meta.seq_lens_host[:meta.num_decodes]):
            first = max(query_len - length, 0)  # rows before the context's start see nothing
            if first < query_len:
                rows = slice(i * query_len + first, (i + 1) * query_len)
                out[rows] = TorchAttentionBackend._prefill_one(q[rows], k_cache, v_cache, meta.block_tables[i],
                                                               length, scale, kv_scales)
        return out


def _sdpa(q, k, v, mask, causal, scale):
    # Grouped-query attention: SDPA shares each KV head among its query heads (enable_gqa).
    gqa = k.shape[-3] != q.shape[-3]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales=None):
    """Write the new tokens' K/V at their slots (this backend never sees padding slots); into an FP8
    cache as k / k_scale and v / v_scale per head, as bytes (CPU torch has no fp8 index_copy_)."""
    hkv, d = k_cache.shape[-2:]
    if kv_scales is not None:
        k, v = quantize_kv(k, kv_scales[0]).view(torch.uint8), quantize_kv(v, kv_scales[1]).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_flat = k_cache.view(-1, hkv, d)
    v_flat = v_cache.view(-1, hkv, d)
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_FP8_MAX = 448.0


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] -> float8_e4m3fn x / scale (per head), clamped: what the Triton store kernels write."""
    return (x.float() / scale[:, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cached fp8 rows [..., Hkv, D] -> x * scale (per head) in dtype."""
    return (x.float() * scale[:, None]).to(dtype)
