"""Variable-length causal attention over a paged KV cache (prefill / chunked prefill).

Sequence ``b`` has ``q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new query tokens and
``seq_lens[b]`` total keys (cached prefix + new tokens, all already in the cache).  Query
``i`` sits at absolute position ``seq_lens[b] - q_len + i`` and sees keys ``0..position``.
This one kernel covers plain prefill, chunked prefill, prefix-cache hits and q_len=1 rows.

Grid ``(batch * kv_heads, query tiles)``.  A program handles BLOCK_Q query tokens for ALL
query heads of one KV head: its ``BLOCK_M = BLOCK_Q * GROUP`` rows are (token, head) pairs,
so each K/V tile feeds GROUP heads at once (fewer loads than one program per query head,
and q_len=1 rows still fill the MMA).  Keys are processed in BLOCK_N tiles: first the tiles
every row of the block may see (no mask), then the few tiles crossing the causal diagonal.
Query tiles are launched last-first so the longest programs start earliest.

K/V tiles come either by pointer loads, each key addressed through the block table, or, where a
key tile never crosses a cache block (block size a multiple of BLOCK_N), as TMA boxes of the cache
viewed as a [blocks * block_size, heads * head_dim] matrix: 14-27% faster on the H200 at 128-row
tiles (`MIN_DESC_BLOCK_M`), the pipeline then holding one more K/V tile in flight.

An FP8 cache is dequantized in registers as in paged_decode.py (k_scale in the softmax scale,
v_scale on the output).
"""

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from nanovllm.kernels.gemm import tma_compatible
from nanovllm.kernels.paged_decode import check_cache_dtype, fold_scores
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.replay import launch

_LOG2E = 1.4426950408889634
_NEG_INIT = tl.constexpr(-1.0e30)  # finite running-max init: keeps fully-masked rows free of NaN


@triton.jit
def _load_kv(ptrs, n_mask, d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASK_N: tl.constexpr):
    """Load a [BLOCK_N, BLOCK_D] K/V tile.  Masks are only emitted where needed: a mask
    that varies along head_dim would stop the compiler from using 16-byte vector loads."""
    if BLOCK_D == HEAD_DIM:
        if MASK_N:
            x = tl.load(ptrs, mask=n_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        if MASK_N:
            x = tl.load(ptrs, mask=n_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        else:
            x = tl.load(ptrs, mask=d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _attend_tile(q, acc, m_i, l_i, n0, offs_n, bt_row, k_head, v_head, d, q_pos,
                 kv_end, qk_scale, stride_kb, stride_kt, stride_vb, stride_vt,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 MASKED: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr):
    """One online-softmax step over the keys n0 .. n0 + BLOCK_N."""
    pos = n0 + offs_n
    n_mask = pos < kv_end
    if MASKED:
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
    # A tile may span several cache blocks: address each key through its own block id.
    tok = pos % PAGE_SIZE
    k = _load_kv(k_head + (blk * stride_kb + tok * stride_kt)[:, None] + d[None, :],
                 n_mask, d, HEAD_DIM, BLOCK_D, MASKED)
    v = _load_kv(v_head + (blk * stride_vb + tok * stride_vt)[:, None] + d[None, :],
                 n_mask, d, HEAD_DIM, BLOCK_D, MASKED)
    if KV_FP8:  # the scales are in qk_scale and applied to the output
        k, v = k.to(q.dtype), v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        causal = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(causal, s, float("-inf"))
    m_i, l_i, acc = fold_scores(s, v, m_i, l_i, acc, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _attend_tile_desc(q, acc, m_i, l_i, n0, offs_n, blk, k_desc, v_desc, col, q_pos, kv_end, qk_scale,
                      PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
                      KV_FP8: tl.constexpr):
    """`_attend_tile` with K/V through TMA tensor descriptors over the cache viewed as
    [blocks * PAGE_SIZE, heads * D]: a key tile lies in one cache block (blk), so it is one box."""
    pos = n0 + offs_n
    row = blk * PAGE_SIZE + n0 % PAGE_SIZE
    k = k_desc.load([row, col])
    v = v_desc.load([row, col])
    if KV_FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
    if MASKED:
        n_mask = pos < kv_end
        s = tl.where((pos[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
        # Slots past the sequence hold anything (NaN included): 0 * NaN would reach the output.
        v = tl.where(n_mask[:, None], v, 0.0)
    m_i, l_i, acc = fold_scores(s, v, m_i, l_i, acc, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _attend_range_desc(q, acc, m_i, l_i, lo, hi, blk, bt_row, offs_n, k_desc, v_desc, col, q_pos, kv_end, qk_scale,
                       BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
                       DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr):
    """`_attend_tile_desc` over the key tiles lo, lo + BLOCK_N, .. < hi. blk: the first tile's block
    id; each next one is loaded a tile ahead and carried, so the descriptor loads do not depend on a
    load of their own iteration (the pipeliner would spend a stage on it). Returns the block id of
    the tile at hi too, for a range that continues there."""
    for n0 in range(lo, hi, BLOCK_N):
        nxt = n0 + BLOCK_N
        blk_next = tl.load(bt_row + nxt // PAGE_SIZE, mask=nxt < kv_end, other=0)
        acc, m_i, l_i = _attend_tile_desc(q, acc, m_i, l_i, n0, offs_n, blk, k_desc, v_desc, col, q_pos,
                                          kv_end, qk_scale, PAGE_SIZE, MASKED, DOT_PREC, KV_FP8)
        blk = blk_next
    return acc, m_i, l_i, blk


# The block-table width changes every step, and the engine passes the slices of seq_lens and
# block_tables after its decode rows (any alignment): neither is specialised on, so one compiled
# variant serves every batch instead of recompiling inside a request.
@triton.jit(do_not_specialize=["stride_bt"],
            do_not_specialize_on_alignment=["cu_seqlens_q_ptr", "seq_lens_ptr", "block_tables_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,  # the scales: KV_FP8 only
    qk_scale,  # softmax scale * log2(e)
    num_kv_heads,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,  # k_cache strides: block, token-in-block, head
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    k_desc, v_desc,  # KV_DESC: TMA descriptors of the caches as [blocks * PAGE_SIZE, heads * HEAD_DIM]
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # query tokens per program (BLOCK_M // GROUP)
    BLOCK_M: tl.constexpr,  # (token, head) rows per program; BLOCK_Q * GROUP <= BLOCK_M
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    KV_DESC: tl.constexpr,  # K/V tiles through k_desc/v_desc (needs PAGE_SIZE % BLOCK_N == 0, BLOCK_D == HEAD_DIM)
    KV_FP8: tl.constexpr,  # float8_e4m3fn caches holding k / k_scale, v / v_scale of each KV head
):
    # The layout (step inputs, no kernel's output) is read before the programmatic-launch wait.
    b = tl.program_id(0) // num_kv_heads
    kv_head = tl.program_id(0) % num_kv_heads
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (latest) tiles first

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    first_tok = tile * BLOCK_Q
    if first_tok >= q_len:  # shorter sequence than the grid's longest one
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len  # keys already cached before this chunk
    pdl_prologue()

    # Row r <-> (token first_tok + r // GROUP, head kv_head * GROUP + r % GROUP).
    r = tl.arange(0, BLOCK_M)
    tok = first_tok + r // GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    q_head = kv_head * GROUP + r % GROUP
    q_pos = prefix + tok
    d = tl.arange(0, BLOCK_D)
    io_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_row[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)
    if KV_FP8:  # dequantized in registers: k's scale joins the softmax scale, v's the output's
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)

    m_i = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    # Keys < full_end are visible to every row (all rows sit at positions >= prefix +
    # first_tok); keys in [full_end, kv_end) need the causal mask.
    full_end = (prefix + first_tok + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix + tl.minimum(first_tok + BLOCK_Q, q_len)
    if KV_DESC:
        col = kv_head * HEAD_DIM
        acc, m_i, l_i, blk = _attend_range_desc(q, acc, m_i, l_i, 0, full_end, tl.load(bt_row), bt_row, offs_n,
                                                k_desc, v_desc, col, q_pos, kv_end, qk_scale,
                                                BLOCK_N, PAGE_SIZE, False, DOT_PREC, KV_FP8)
        acc, m_i, l_i, blk = _attend_range_desc(q, acc, m_i, l_i, full_end, kv_end, blk, bt_row, offs_n,
                                                k_desc, v_desc, col, q_pos, kv_end, qk_scale,
                                                BLOCK_N, PAGE_SIZE, True, DOT_PREC, KV_FP8)
    else:
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, offs_n, bt_row, k_head, v_head, d,
                                         q_pos, kv_end, qk_scale,
                                         stride_kb, stride_kt, stride_vb, stride_vt,
                                         HEAD_DIM, BLOCK_D, PAGE_SIZE, False, DOT_PREC, KV_FP8)
        for n0 in range(full_end, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, n0, offs_n, bt_row, k_head, v_head, d,
                                         q_pos, kv_end, qk_scale,
                                         stride_kb, stride_kt, stride_vb, stride_vt,
                                         HEAD_DIM, BLOCK_D, PAGE_SIZE, True, DOT_PREC, KV_FP8)

    # Every stored row saw key 0, so l_i > 0 there; the guard only protects padded rows.
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr + kv_head)
    tl.store(out_ptr + q_row[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=io_mask)


def _prefill_config(head_dim: int, group: int, max_query_len: int, kv_desc: bool = False,
                    q_bytes: int = 2):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): fixed table (no autotuning). kv_desc: K/V tiles
    can come through TMA descriptors (`_desc_applies`). q_bytes: 4 for fp32 queries (tests and
    references), whose 256-row Q tile alone would take 128 KB of shared memory."""
    block_d = triton.next_power_of_2(head_dim)
    rows = max_query_len * group
    if rows <= 16:  # decode-like / tiny chunks: small tiles, no wasted MMA rows
        block_m, num_warps = 16, 4
    elif rows <= 32:
        block_m, num_warps = 32, 4
    elif rows <= 64:
        block_m, num_warps = 64, 4
    elif rows <= 256 or triton.next_power_of_2(head_dim) > 128 or kv_desc or q_bytes > 2:
        # 2 warpgroups x m64 wgmma on Hopper; 4 warps would need ~250 regs/thread. With K/V through
        # TMA, as fast as or faster than 256-row tiles at every shape `scripts/tune.py prefill` runs.
        block_m, num_warps = 128, 8
    else:  # long prompts, K/V by pointers: 4 warpgroups, 13-21% faster than 128 rows (scripts/tune.py prefill)
        block_m, num_warps = 256, 16
    block_m = max(block_m, triton.next_power_of_2(group))
    if block_d <= 128:
        block_n, num_stages = 64, 3
    else:  # head_dim 256: keep Q + 2 stages of K/V within shared memory
        block_n, num_stages = 32, 2
    return block_m, block_n, num_warps, num_stages


# K/V tiles through TMA descriptors where they apply, for tiles of at least this many rows. Measured on
# the H200 (scripts/tune.py prefill, Qwen3-0.6B heads, us, pointer loads with the old table's tiles ->
# TMA with (128, 64, 8 warps, 3 stages)): the benchmark's first prefill (27 prompts, 16k tokens) 240.9
# -> 215.8, 8 x 2048 429.8 -> 368.0, 1 x 8192 717.9 -> 574.6 (478 TFLOP/s), 4 x 512-token chunks on
# 3584-token prefixes 197.8 -> 144.1. With 64-row tiles (4 warps) TMA was slower (251.0 -> 287.5).
MIN_DESC_BLOCK_M = 128


def _desc_applies(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, block_n: int = 64) -> bool:
    """Whether K/V tiles of block_n keys can come through TMA descriptors: each key tile inside one
    cache block, each cache a contiguous [blocks * page_size, heads * D] matrix with 16-byte aligned
    rows, and a power-of-two head_dim (the box is the whole head)."""
    return (k_cache.is_cuda and page_size % block_n == 0 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and triton.next_power_of_2(k_cache.shape[-1]) == k_cache.shape[-1]
            and all(tma_compatible(c.view(c.shape[0] * page_size, -1)) for c in (k_cache, v_cache)))


def _kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int):
    """TMA descriptors of the caches as [blocks * block_size, heads * head_dim] matrices."""
    rows, head_dim = k_cache.shape[0] * k_cache.shape[1], k_cache.shape[-1]
    return (TensorDescriptor.from_tensor(k_cache.view(rows, -1), [block_n, head_dim]),
            TensorDescriptor.from_tensor(v_cache.view(rows, -1), [block_n, head_dim]))


# What a replay of the kernel takes from (q, k_cache, v_cache, out, kv_scales) (kernels/replay.py).
_SWAPPED = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "k_scale_ptr", "v_scale_ptr", "k_desc", "v_desc")


class _Swap:
    __slots__ = ("kv_desc", "kv_fp8", "block_n")

    def __init__(self, kv_desc: bool, kv_fp8: bool, block_n: int):
        self.kv_desc, self.kv_fp8, self.block_n = kv_desc, kv_fp8, block_n

    def __call__(self, q, k_cache, v_cache, out, kv_scales):
        scales = kv_scales if self.kv_fp8 else (k_cache, k_cache)
        descs = _kv_descriptors(k_cache, v_cache, self.block_n) if self.kv_desc else (k_cache, k_cache)
        return (q, k_cache, v_cache, out, *scales, *descs)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    _config: tuple | None = None,  # (BLOCK_M, BLOCK_N, num_warps, num_stages), for benchmarks
    _kv_desc: bool | None = None,  # K/V through TMA descriptors (None: where `_desc_applies`), for benchmarks
    record: list | None = None,
) -> torch.Tensor:
    """Causal (with prefix offset) attention of packed queries over the paged cache.

    q: [total_q, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    cu_seqlens_q: [B+1] int32; seq_lens: [B] int32 (>= each sequence's q_len);
    block_tables: [B, max_blocks] int32; max_query_len: host int >= every q_len.
    kv_scales: for float8_e4m3fn caches, (k_scale, v_scale) [Hkv] fp32 (the cache holds k / k_scale).
    Returns ``out`` ([total_q, Hq, D], q's dtype).  ``record``: a list to append the launch to, as a
    Relaunch taking (q, k_cache, v_cache, out, kv_scales) (kernels/replay.py; None: not replayable).
    """
    total_q, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    assert num_q_heads % num_kv_heads == 0 and k_cache.shape[-1] == head_dim
    kv_fp8 = check_cache_dtype(q, k_cache, v_cache, kv_scales)
    group = num_q_heads // num_kv_heads
    batch = seq_lens.shape[0]
    assert cu_seqlens_q.shape[0] == batch + 1
    if q.stride(-1) != 1:
        q = q.contiguous()
        record = None  # a replay would be handed the original q
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    if out is None:
        out = torch.empty(total_q, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.stride(-1) == 1
    if total_q == 0 or batch == 0 or max_query_len <= 0:
        return out

    desc_ok = _desc_applies(k_cache, v_cache, page_size)
    block_m, block_n, num_warps, num_stages = _config or _prefill_config(
        head_dim, group, max_query_len, desc_ok, q.element_size())
    block_q = max(1, block_m // group)
    grid = (batch * num_kv_heads, triton.cdiv(max_query_len, block_q))
    kv_desc = _kv_desc
    if kv_desc is None:
        kv_desc = desc_ok and block_m >= MIN_DESC_BLOCK_M and page_size % block_n == 0
    if kv_desc:
        k_desc, v_desc = _kv_descriptors(k_cache, v_cache, block_n)
    else:
        k_desc = v_desc = k_cache  # KV_DESC=False never reads them
    launch(_prefill_kernel, grid, (
        q, k_cache, v_cache, out,
        cu_seqlens_q, seq_lens, block_tables, *(kv_scales if kv_fp8 else (k_cache, k_cache)),  # placeholders: aligned
        scale * _LOG2E,
        num_kv_heads,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        k_desc, v_desc), dict(
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", KV_DESC=kv_desc, KV_FP8=kv_fp8,
        num_warps=num_warps, num_stages=num_stages, **PDL_LAUNCH),
        record, _SWAPPED, _Swap(kv_desc, kv_fp8, block_n))
    return out
