"""Flash-decoding over a paged KV cache (one query token per sequence, or a few: speculative
verification).

Stage 1 (``_decode_split_kernel``): grid ``(kv_heads * head_blocks, batch, num_splits)``.
Each program owns one KV head and ALL query heads mapped onto it (GQA group), so every
K/V tile is read from HBM once per KV head.  The group's queries form a ``[BLOCK_G, D]``
tile (padded to >= 16 rows) so the scores and the P@V product use ``tl.dot``.
With ``QUERY_LEN`` > 1 (a verification step: the last token and the drafts after it) each
sequence has that many query tokens, the newest last; the tile's rows are (token, head)
pairs, so the K/V tiles are still read once per KV head for all of them, and row (t, h) sees
the keys up to its own position, ``seq_len - QUERY_LEN + t`` (the causal mask inside the
window).  The keys
of a sequence are divided evenly among the splits *inside the kernel* (from ``seq_lens``),
so the launch configuration never depends on GPU data and can be CUDA-graph captured.
An optional ``order`` (a permutation of the batch, longest context first) makes the GPU start
the longest sequences first: on a ragged batch the last wave then holds only short programs
instead of whichever long sequence happened to come last (longest-processing-time-first).

Stage 2 (``_decode_merge_kernel``): grid ``(batch, q_heads)``; combines the per-split
partial outputs with their log-sum-exp.  With a single split, stage 1 writes the final
output directly and stage 2 is skipped.

All softmax math is fp32 in base 2: ``exp(x * scale) == exp2(x * scale * log2(e))``.

An FP8 cache (float8_e4m3fn, holding k / k_scale and v / v_scale per KV head) is dequantized in
registers as its tiles are loaded: K and V become fp16 (exactly; with a bf16 q, q becomes fp16 too:
on the H200 e4m3 -> fp16 is one conversion per pair of values and e4m3 -> bf16 is not, which made the
kernel no faster than over a bf16 cache; fp16 dots 1.2x faster), k_scale joins the softmax scale and
v_scale multiplies the output, so the cache is read once, at one byte per value. V is converted where
it is loaded (fp8.e4m3_to_fp16_as_loaded), not after the change into the P @ V operand layout, which
would read it from shared memory a byte at a time.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_plan import alloc_decode_workspace, choose_num_splits, launch_config, merge_variant
from nanovllm.kernels.fp8 import FP8_DTYPE, e4m3_to_fp16_as_loaded, has_e4m3_pair_conversion
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.replay import launch

_LOG2E = 1.4426950408889634
_NEG_INIT = tl.constexpr(-1.0e30)  # finite running-max init: exp2(-inf - (-inf)) would give NaN


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PREC: tl.constexpr):
    """One K/V tile of the online softmax: the group's queries q [BLOCK_G, D] against keys k and
    values v [BLOCK_N, D] (visible: [1 or BLOCK_G, BLOCK_N], the keys each row may see), folded
    into the running max m_i, sum l_i and output acc. Returns the three updated."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_G, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    return fold_scores(s, v, m_i, l_i, acc, DOT_PREC)


@triton.jit
def fold_scores(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """The online softmax's update for one tile of base-2 scores s [rows, keys] (-inf: masked) and
    its values v [keys, D]: returns the new running max, sum and output (m_i, l_i, acc). Shared by
    the decode and prefill kernels."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


# Per-step values are not specialised on: one compiled variant serves every batch.
@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, order_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,  # the scales: KV_FP8 only
    qk_scale,  # softmax scale * log2(e)
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,  # k_cache strides: block, token-in-block, head
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    num_q_heads,
    num_splits,  # part_o is contiguous [B * QUERY_LEN, Hq, num_splits, D], part_lse [B * QUERY_LEN, Hq, num_splits]
    GROUP: tl.constexpr,  # query heads per KV head
    QUERY_LEN: tl.constexpr,  # query tokens per sequence (q rows b * QUERY_LEN ...), the newest last
    HEAD_BLOCKS: tl.constexpr,  # programs per KV head along the rows (only when QUERY_LEN * GROUP > BLOCK_G)
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # KV cache block size (tokens)
    BLOCK_N: tl.constexpr,  # keys per tile; tiles may span several cache blocks
    DIRECT_OUT: tl.constexpr,  # num_splits == 1: write the final output here
    HAS_ORDER: tl.constexpr,  # program i of the batch axis serves sequence order[i]
    DOT_PREC: tl.constexpr,
    # Load each tile's block ids one iteration ahead, carried across iterations. Read in the same
    # iteration, they make the K/V loads "indirect" to Triton's pipeliner, which then spends a
    # stage on them: num_stages=3 leaves one K/V buffer (sm_90 TTGIR), and a program has a single
    # tile in flight. Carried, num_stages=3 gives two buffers (72 KB of shared memory instead of 39).
    PREFETCH_BLOCKS: tl.constexpr,
    KV_FP8: tl.constexpr,  # float8_e4m3fn caches holding k / k_scale, v / v_scale of each KV head
    FP16_DOTS: tl.constexpr,  # KV_FP8 with a 16-bit q: the dots in fp16 (q converted)
    E4M3_PAIRS: tl.constexpr,  # FP16_DOTS on a GPU converting e4m3 pairs in one instruction (sm_89+)
):
    # Everything up to the first tile's block ids comes from the step's inputs, not from the
    # previous kernel: it is read before the programmatic-dependent-launch wait (pdl_prologue),
    # so this chain of dependent loads overlaps the predecessor's tail.
    # The head axis varies fastest so that all heads of one sequence are dispatched together.
    if HAS_ORDER:
        b = tl.load(order_ptr + tl.program_id(1))
    else:
        b = tl.program_id(1)
    kv_head = tl.program_id(0) // HEAD_BLOCKS
    hblk = tl.program_id(0) % HEAD_BLOCKS
    split = tl.program_id(2)

    # Row g <-> (query token g // GROUP of the sequence, head kv_head * GROUP + g % GROUP).
    g = hblk * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < QUERY_LEN * GROUP
    q_head = kv_head * GROUP + g % GROUP
    q_tok = b * QUERY_LEN + g // GROUP  # the row's token among q's (and out's) rows
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    # This split's key range; chunks are BLOCK_N-aligned so only the final tile is ragged.
    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH_BLOCKS:
        blk_next = tl.load(bt_row + (start + offs_n) // PAGE_SIZE, mask=start + offs_n < end, other=0)
    pdl_prologue()  # q (and the newest K/V in the cache) come from the previous kernels

    q = tl.load(q_ptr + q_tok[:, None] * stride_qb + q_head[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if QUERY_LEN > 1:  # the last key each row sees: its own position
        last_key = seq_len - QUERY_LEN + g // GROUP
    if KV_FP8:  # dequantized in registers: k's scale joins the softmax scale, v's the output's
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
    if FP16_DOTS:  # clamped: a bf16 q past fp16's range would turn into inf and the output into NaN
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_G], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        # Physical block per key (a tile may cross cache-block boundaries when
        # PAGE_SIZE < BLOCK_N); int64 because block * stride_kb can exceed 2^31.
        if PREFETCH_BLOCKS:
            blk = blk_next.to(tl.int64)
            blk_next = tl.load(bt_row + (pos + BLOCK_N) // PAGE_SIZE, mask=pos + BLOCK_N < end, other=0)
        else:
            blk = tl.load(bt_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = pos % PAGE_SIZE
        # Mask only along keys unless head_dim is padded: a mask varying along head_dim
        # would stop the compiler from emitting 16-byte vector loads.
        if BLOCK_D == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_head + (blk * stride_kb + tok * stride_kt)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_head + (blk * stride_vb + tok * stride_vt)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = e4m3_to_fp16_as_loaded(v, E4M3_PAIRS) if FP16_DOTS else v.to(q.dtype)

        if QUERY_LEN > 1:
            visible = n_mask[None, :] & (pos[None, :] <= last_key[:, None])
        else:
            visible = n_mask[None, :]
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PREC)

    # Empty range (padding row, a split beyond a short sequence, or keys all past a row's
    # position): l_i == 0.
    has_keys = l_i > 0.0
    o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr + kv_head)
    o_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT_OUT:
        tl.store(out_ptr + q_tok[:, None] * stride_ob + q_head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        row = (q_tok * num_q_heads + q_head) * num_splits + split
        tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr, part_o_ptr, part_lse_ptr,
    stride_ob, stride_oh,
    num_q_heads, num_splits,
    BLOCK_S: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pdl_prologue()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row = (b * num_q_heads + h) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    # Empty splits carry lse = -inf and get weight 0; an all-empty row (seq_len 0)
    # ends with denom 0 and is written as zeros.
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def check_cache_dtype(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_scales) -> bool:
    """Whether the caches are FP8 (float8_e4m3fn, with kv_scales); else they must have q's dtype."""
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    if k_cache.dtype == FP8_DTYPE:
        assert kv_scales is not None, "an FP8 KV cache needs its kv_scales (k_scale, v_scale)"
        assert all(s.dtype == torch.float32 and s.shape == (k_cache.shape[2],) for s in kv_scales), kv_scales
        return True
    assert q.dtype == k_cache.dtype, "q and the KV cache must share a dtype (or the cache be float8_e4m3fn)"
    return False


# What a replay of the split kernel takes from (q, k_cache, v_cache, out, kv_scales) (kernels/replay.py).
_SPLIT_SWAPPED = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_scale_ptr", "v_scale_ptr")


def _swap_plain(q, k_cache, v_cache, out, kv_scales):
    return q, k_cache, v_cache, out, k_cache, k_cache


def _swap_fp8(q, k_cache, v_cache, out, kv_scales):
    return (q, k_cache, v_cache, out, *kv_scales)


def _swap_out(q, k_cache, v_cache, out, kv_scales):
    return (out,)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    max_seq_len_hint: int | None = None,
    order: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    _config: tuple | None = None,  # `decode_plan.decode_config`'s tuple, for benchmarks
    query_len: int = 1,
    record: list | None = None,
) -> torch.Tensor:
    """Attention of ``query_len`` query tokens per sequence over its ``seq_lens[b]`` cached keys,
    the queries being the sequence's last ``query_len`` positions (causal among them).

    q: [B * query_len, Hq, D] (sequence b's tokens at rows b * query_len ...); k_cache/v_cache:
    [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks] int32; seq_lens: [B] int32
    (0 = padding row -> zeros; a query row whose position is negative sees no key -> zeros too).
    ``workspace``: optional (part_o, part_lse) from ``alloc_decode_workspace`` with room for
    at least B x query_len x Hq x num_splits entries.  ``order``: optional [B] int32 permutation
    of the sequences, longest context first (any permutation gives the same result).  ``kv_scales``:
    for float8_e4m3fn caches, (k_scale, v_scale) [Hkv] fp32 (the cache holds k / k_scale).  Returns
    ``out`` ([B * query_len, Hq, D]).  ``record``: a list to append the launches to, as Relaunches
    taking (q, k_cache, v_cache, out, kv_scales) (kernels/replay.py; None entries: not replayable).
    """
    num_rows, num_q_heads, head_dim = q.shape
    assert num_rows % query_len == 0, "q holds query_len rows per sequence"
    batch = num_rows // query_len
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[-1] == head_dim
    kv_fp8 = check_cache_dtype(q, k_cache, v_cache, kv_scales)
    group = num_q_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
        record = None  # a replay would be handed the original q
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty(num_rows, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    if batch == 0:
        return out
    assert batch <= 65535, "the batch is grid axis 1 (at most 65535 programs)"

    if num_splits is None:
        num_splits = choose_num_splits(batch, num_q_heads, num_kv_heads, head_dim,
                                       q.device, max_seq_len_hint, query_len)
    block_g, block_n, num_warps, num_stages, prefetch_blocks = _config or launch_config(
        batch, num_q_heads, num_kv_heads, head_dim, q.device, num_splits, query_len, kv_fp8)
    block_d = triton.next_power_of_2(head_dim)
    head_blocks = triton.cdiv(group * query_len, block_g)
    direct = num_splits == 1

    if direct:
        part_o = part_lse = out  # unused placeholders
    else:
        n = num_rows * num_q_heads * num_splits
        if workspace is None:
            workspace = alloc_decode_workspace(num_rows, num_q_heads, head_dim, num_splits, q.device)
        part_o = workspace[0].view(-1)[: n * head_dim]
        part_lse = workspace[1].view(-1)[:n]
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    fp16_dots = kv_fp8 and q.dtype != torch.float32
    launch(_decode_split_kernel, (num_kv_heads * head_blocks, batch, num_splits), (
        q, k_cache, v_cache, block_tables, seq_lens, seq_lens if order is None else order,
        out, part_o, part_lse, *(kv_scales if kv_fp8 else (k_cache, k_cache)),  # placeholders: fixed, aligned
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_q_heads, num_splits), dict(
        GROUP=group, QUERY_LEN=query_len, HEAD_BLOCKS=head_blocks, BLOCK_G=block_g,
        HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=block_n,
        DIRECT_OUT=direct, HAS_ORDER=order is not None, DOT_PREC=dot_prec, PREFETCH_BLOCKS=prefetch_blocks,
        KV_FP8=kv_fp8, FP16_DOTS=fp16_dots, E4M3_PAIRS=fp16_dots and has_e4m3_pair_conversion(q.device),
        num_warps=num_warps, num_stages=num_stages, **PDL_LAUNCH),
        record, _SPLIT_SWAPPED, _swap_fp8 if kv_fp8 else _swap_plain)
    if not direct:
        merge_tile, merge_warps = merge_variant(num_splits, block_d)
        launch(_decode_merge_kernel, (num_rows, num_q_heads), (
            out, part_o, part_lse,
            out.stride(0), out.stride(1),
            num_q_heads, num_splits), dict(
            BLOCK_S=merge_tile, HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=merge_warps, **PDL_LAUNCH),
            record, ("out_ptr",), _swap_out)
    return out
