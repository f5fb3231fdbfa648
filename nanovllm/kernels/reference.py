"""Plain-torch reference implementations of the paged-attention kernels (slow, for tests),
plus a helper that builds random paged caches with shuffled block tables, and of the
mixture-of-experts kernels (routing, alignment by expert, the grouped GEMMs)."""

import torch
import torch.nn.functional as F


def store_kv_cache(key, value, k_cache, v_cache, slot_mapping):
    """Reference of ``nanovllm.kernels.store_kv_cache`` (skips slots < 0)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[valid].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[valid].to(v_cache.dtype)


def copy_kv_prefixes(kv_cache, copies, max_tokens=None):
    """Reference of ``nanovllm.kernels.copy_kv.copy_kv_prefixes``: the cache as rows of one
    token's K or V per layer, each destination row gathered from its source row."""
    two, num_layers, num_blocks, block_size = kv_cache.shape[:4]
    rows = kv_cache.view(two * num_layers, num_blocks * block_size, -1)
    src_rows, dst_rows = [], []
    for src, dst, n in copies.t().tolist():
        src_rows += range(src * block_size, src * block_size + n)
        dst_rows += range(dst * block_size, dst * block_size + n)
    if dst_rows:
        rows[:, torch.tensor(dst_rows)] = rows[:, torch.tensor(src_rows)]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: ``[length, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def _attend(q, k, v, q_pos, scale):
    """q [M, Hq, D] at absolute positions q_pos [M]; k/v [L, Hkv, D]; fp32 math."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]  # [M, L]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None, query_len=1, **_):
    """Reference of ``nanovllm.kernels.paged_decode_attention``: sequence b's query_len rows are
    its last positions; a row at a negative position (or of a padding row) is zeros."""
    if out is None:
        out = torch.empty_like(q)
    for b, length in enumerate(seq_lens.tolist()):
        rows = slice(b * query_len, (b + 1) * query_len)
        out[rows] = 0
        if length == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], length)
        v = gather_kv(v_cache, block_tables[b], length)
        q_pos = torch.arange(length - query_len, length, device=q.device)
        seen = q_pos >= 0
        if seen.any():
            first = b * query_len + int((~seen).sum())
            out[first:(b + 1) * query_len] = _attend(q[first:(b + 1) * query_len], k, v, q_pos[seen],
                                                     scale).to(out.dtype)
    return out


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                            max_query_len, scale, out=None, **_):
    """Reference of ``nanovllm.kernels.paged_prefill_attention``."""
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        assert q_len <= max_query_len and q_len <= length
        k = gather_kv(k_cache, block_tables[b], length)
        v = gather_kv(v_cache, block_tables[b], length)
        q_pos = torch.arange(length - q_len, length, device=q.device)
        out[start:end] = _attend(q[start:end], k, v, q_pos, scale).to(out.dtype)
    return out


def random_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device,
                    generator=None, spare_blocks=3, poison=True):
    """Random K/V caches holding ``len(seq_lens)`` sequences in shuffled, non-contiguous
    blocks.  Returns ``(k_cache, v_cache, block_tables)``; block-table padding is -1.
    With ``poison``, every slot that holds no sequence token (spare blocks, the tails of
    last blocks) is NaN, so a kernel that reads past ``seq_len`` produces NaN."""
    counts = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(counts) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if generator is None:  # fast path for big GPU caches: sample directly on the device
        k_cache = torch.randn(shape, device=device, dtype=dtype)
        v_cache = torch.randn(shape, device=device, dtype=dtype)
    else:
        k_cache = torch.randn(shape, generator=generator).to(device, dtype)
        v_cache = torch.randn(shape, generator=generator).to(device, dtype)
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.full((len(seq_lens), max(max(counts, default=1), 1)), -1,
                              dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    i = 0
    for b, (n, c) in enumerate(zip(seq_lens, counts)):
        ids = torch.tensor(perm[i:i + c], dtype=torch.int64)
        i += c
        block_tables[b, :c] = ids.int()
        if poison and c:
            used[ids] = True
            used[ids[-1], n - (c - 1) * block_size:] = False  # tail of the last block
    if poison:
        unused = (~used).flatten().to(device)
        k_cache.view(-1, num_kv_heads, head_dim)[unused] = float("nan")
        v_cache.view(-1, num_kv_heads, head_dim)[unused] = float("nan")
    return k_cache, v_cache, block_tables.to(device)


# ---- block FP8 ---------------------------------------------------------------------------------
FP8_MAX = 448.0


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128, eps: float = 1e-10):
    """Reference of ``kernels.fp8_quant.per_token_group_quant``: x [M, K] -> (float8_e4m3fn [M, K],
    fp32 scales [M, ceil(K / group)]) with x ~= q * scale per group of `group` columns."""
    m, k = x.shape
    groups = -(-k // group)
    xg = F.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = xg.abs().amax(-1).clamp_min(eps)
    # Divided by a tensor: torch on CUDA multiplies by the reciprocal of a Python-number divisor (not
    # the correctly rounded quotient the kernels compute).
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group)[:, :k], scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    """q [M, K] fp8 with scales [M, ceil(K / group)] -> fp32 [M, K]."""
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :q.shape[1]]


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """w [N, K] fp8 with scales [ceil(N / bn), ceil(K / bk)] -> fp32 [N, K]."""
    n, k = w.shape
    s = scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return w.float() * s


def w8a8_block_matmul(q: torch.Tensor, q_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """Reference of the block-scaled FP8 GEMMs: dequantize both operands, multiply in fp32.
    q [M, K] fp8, q_scale [M, ceil(K/128)]; w [N, K] fp8, w_scale [ceil(N/128), ceil(K/128)]."""
    return (dequantize_groups(q, q_scale) @ dequantize_blocks(w, w_scale).T).to(out_dtype)


def quantize_kv_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What an FP8 KV cache stores for x [T, Hkv, D] (in the activation dtype) with per-head scales
    [Hkv]: x / scale, clamped, rounded to float8_e4m3fn."""
    return (x.float() / scale.float()[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def dequantize_kv_cache(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 cache [blocks, block_size, Hkv, D] as the attention kernels read it: cache * scale, in dtype."""
    return (cache.float() * scale.float()[:, None]).to(dtype)


# ---- mixture of experts (kernels/moe_routing.py, kernels/moe_gemm.py) -------------------------
def moe_topk(logits, top_k, renormalize, round_weights):
    """Reference of the top-k kernel: (weights [T, k] fp32, ids [T, k] int32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if round_weights:
        weights = weights.to(logits.dtype).float()
    return weights, ids.int()


def moe_align(ids, num_experts, block_m):
    """Reference of the align kernel: (sorted_ids, block_expert, num_padded) over the used entries:
    each expert's flat pair ids in ascending order, padded with T * k to a multiple of block_m."""
    flat = ids.flatten().long()
    n = flat.numel()
    sorted_ids, block_expert = [], []
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten()
        if len(pairs):
            pad = -len(pairs) % block_m
            sorted_ids += pairs.tolist() + [n] * pad
            block_expert += [e] * ((len(pairs) + pad) // block_m)
    return (torch.tensor(sorted_ids, dtype=torch.int32), torch.tensor(block_expert, dtype=torch.int32),
            len(sorted_ids))


def moe_gate_up(x, w13, ids, dtype=None):
    """Reference of `moe_gate_up`: row t * k + j = silu(x[t] @ gate^T) * (x[t] @ up^T) of expert
    ids[t, j], rounded as the kernel rounds (each product, then the SiLU, then their product) to
    dtype (default x's; dequantized FP8 operands come in fp32)."""
    t, k = ids.shape
    inter = w13.shape[1] // 2
    dtype = dtype or x.dtype
    out = torch.empty(t * k, inter, dtype=dtype, device=x.device)
    flat = ids.flatten().long()
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().flatten()
        gate_up = (x[rows // k].float() @ w13[e].float().T).to(dtype).float()
        silu = F.silu(gate_up[:, :inter]).to(dtype).float()
        out[rows] = (silu * gate_up[:, inter:]).to(dtype)
    return out


def moe_down(act, w2, weights, ids):
    """Reference of `moe_down`: parts [k, T, H] fp32, parts[j, t] = weights[t, j] * act[t * k + j] @ down^T."""
    t, k = ids.shape
    parts = torch.empty(k, t, w2.shape[1], dtype=torch.float32, device=act.device)
    flat = ids.flatten().long()
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().flatten()
        y = (act[rows].float() @ w2[e].float().T) * weights.flatten()[rows, None].float()
        parts[rows % k, rows // k] = y
    return parts
