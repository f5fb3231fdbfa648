"""Decode attention with the work balanced across a fixed number of persistent programs (the engine
uses it only with NANOVLLM_BALANCED_DECODE=1: measured on the H200 it wins alone below ~40 sequences,
but not inside the engine, and it loses for one sequence; `attention/triton_backend.py` has the
figures, `scripts/tune_decode.py --buckets --balanced` times it against `paged_decode.py`).

`paged_decode.py` gives each (sequence, KV head, split) its own program; at 16-127 sequences the
programs are short and few waves deep, and the kernel's start and ragged tail cost 10-40% of its
time (60-90% of copy bandwidth). Here the batch's K/V tiles, in (sequence, KV head, tile) order,
are cut into `num_programs` equal contiguous ranges (stream-K): every program streams the same
number of tiles through one loop, crossing item boundaries without leaving the loop, and every
program ends at about the same time. A program writes each item it covers whole straight to the
output; the at most two items it shares with its neighbours (the one its range starts in and the
one it ends in) go to partials that `_merge_kernel` combines with their log-sum-exp.

The plan needs no host work: every program derives the ranges from `seq_lens` (a prefix sum over
the batch), so the launch depends only on shapes and can be CUDA-graph captured.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged_decode import _LOG2E, _NEG_INIT, _decode_config, _device_sms, attend_tile
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue


@triton.jit
def _plan(seq_lens_ptr, batch, UNITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Per sequence: tiles per item (>= 1: an empty sequence is one masked tile that writes zeros)
    and the index of its first tile in the batch's order; the batch's total."""
    idx = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens_ptr + idx, mask=idx < batch, other=0)
    tiles = tl.where(idx < batch, tl.maximum(tl.cdiv(lens, BLOCK_N), 1), 0)
    ends = tl.cumsum(tiles * UNITS, 0)
    return idx, tiles, ends - tiles * UNITS, tl.sum(tiles * UNITS, 0)


@triton.jit(do_not_specialize=["batch", "stride_bt"])
def _balanced_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ob, stride_oh, batch,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, UNITS: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, DOT_PREC: tl.constexpr,
):
    # An item is (sequence b, unit) with unit = KV head x head block; its tiles are consecutive.
    p = tl.program_id(0)
    num_programs = tl.num_programs(0)
    idx, tiles, firsts, total = _plan(seq_lens_ptr, batch, UNITS, BLOCK_N, BLOCK_B)
    t0 = (p * total) // num_programs
    t1 = ((p + 1) * total) // num_programs
    # Where t0 falls: sequence b, unit, tile.
    b = tl.sum((firsts + tiles * UNITS <= t0).to(tl.int32), 0)
    nb = tl.sum(tl.where(idx == b, tiles, 0), 0)
    local = t0 - tl.sum(tl.where(idx == b, firsts, 0), 0)
    unit = local // tl.maximum(nb, 1)
    tile = local % tl.maximum(nb, 1)
    seg_start = tile
    first_segment = t0 >= 0  # true: the segment holding t0 is this program's first

    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    g_off = tl.arange(0, BLOCK_G)
    # The current tile's sequence length and block ids are loaded one iteration ahead, carried:
    # read in the iteration that uses them, the K/V loads would be indirect to Triton's pipeliner,
    # which then keeps a single K/V tile in flight (as in paged_decode.py's PREFETCH_BLOCKS).
    bt = block_tables_ptr
    seq_len = tl.where(t0 < t1, tl.load(seq_lens_ptr + tl.minimum(b, batch - 1)), 0)  # else b may be batch
    pos = tile * BLOCK_N + offs_n
    blk = tl.load(bt + b.to(tl.int64) * stride_bt + pos // PAGE_SIZE, mask=pos < seq_len, other=0)
    pdl_prologue()  # q comes from the previous kernel; lengths and block ids are step inputs

    m_i = tl.full([BLOCK_G], _NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t in range(t0, t1):
        nb = tl.maximum(tl.cdiv(seq_len, BLOCK_N), 1)
        kv_head = unit // HEAD_BLOCKS
        g = (unit % HEAD_BLOCKS) * BLOCK_G + g_off
        g_mask = g < GROUP
        q_head = kv_head * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + q_head[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        pos = tile * BLOCK_N + offs_n
        n_mask = pos < seq_len
        row_off = blk.to(tl.int64) * stride_kb + (pos % PAGE_SIZE) * stride_kt
        if BLOCK_D == HEAD_DIM:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_head * stride_kh + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_head * stride_vh + row_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = attend_tile(q, k, v, n_mask, m_i, l_i, acc, qk_scale, DOT_PREC)

        end_item = tile == nb - 1
        if end_item | (t == t1 - 1):
            has_keys = l_i > 0.0
            o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            o_mask = g_mask[:, None] & d_mask[None, :]
            if (seg_start == 0) & end_item:  # the whole item: the final output
                tl.store(out_ptr + b * stride_ob + q_head[:, None] * stride_oh + d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=o_mask)
            else:  # shared with a neighbour: slot 0 if it holds t0, else slot 1 (it holds t1 - 1)
                row = (p * 2 + tl.where(first_segment, 0, 1)) * BLOCK_G + g_off
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
                tl.store(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
                tl.store(part_lse_ptr + row, lse)
            m_i = tl.full([BLOCK_G], _NEG_INIT, tl.float32)
            l_i = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
            first_segment = t < 0
            seg_start = seg_start * 0
        # Next tile: the next unit of the sequence after its last tile, the next sequence after its
        # last unit; its length and block ids now.
        tile = tl.where(end_item, 0, tile + 1)
        unit = tl.where(end_item, unit + 1, unit)
        next_seq = unit == UNITS
        b = tl.where(next_seq, b + 1, b)
        unit = tl.where(next_seq, 0, unit)
        seq_len = tl.where(next_seq, tl.load(seq_lens_ptr + tl.minimum(b, batch - 1)), seq_len)
        pos = tile * BLOCK_N + offs_n
        last = tl.where(t + 1 < t1, seq_len, 0)  # past the range: no loads
        blk = tl.load(bt + b.to(tl.int64) * stride_bt + pos // PAGE_SIZE, mask=pos < last, other=0)


@triton.jit(do_not_specialize=["batch", "num_programs"])
def _merge_kernel(seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, stride_ob, stride_oh, batch, num_programs,
                  GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, UNITS: tl.constexpr, BLOCK_G: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    b = tl.program_id(0)
    unit = tl.program_id(1)
    idx, tiles, firsts, total = _plan(seq_lens_ptr, batch, UNITS, BLOCK_N, BLOCK_B)  # step inputs: before the wait
    pdl_prologue()
    nb = tl.sum(tl.where(idx == b, tiles, 0), 0)
    start = tl.sum(tl.where(idx == b, firsts, 0), 0) + unit * nb
    # The programs holding the item's first and last tile (program p holds [p*T//P, (p+1)*T//P)).
    p_first = ((start + 1) * num_programs - 1) // total
    p_last = ((start + nb) * num_programs - 1) // total
    if p_first != p_last:  # else written whole by p_first
        g = (unit % HEAD_BLOCKS) * BLOCK_G + tl.arange(0, BLOCK_G)
        g_mask = g < GROUP
        d = tl.arange(0, BLOCK_D)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for p in range(p_first, p_last + 1):
            # Slot 1 only where the item is p_first's last segment but not its first.
            slot = tl.where((p == p_first) & ((p * total) // num_programs < start), 1, 0)
            row = (p * 2 + slot) * BLOCK_G + tl.arange(0, BLOCK_G)
            # With more programs than tiles some ranges are empty: their slots hold nothing.
            used = ((p + 1) * total) // num_programs > (p * total) // num_programs
            lse = tl.where(used, tl.load(part_lse_ptr + row), float("-inf"))
            o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=g_mask[:, None] & (d < HEAD_DIM)[None, :],
                        other=0.0)
            o = tl.where(used, o, 0.0)
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            scale_old = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            denom = denom * scale_old + w
            acc = acc * scale_old[:, None] + o * w[:, None]
            m = m_new
        o = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
        q_head = (unit // HEAD_BLOCKS) * GROUP + g
        tl.store(out_ptr + b * stride_ob + q_head[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & (d < HEAD_DIM)[None, :])


def balanced_num_programs(device: torch.device, programs_per_sm: int = 2) -> int:
    """Programs of the balanced kernel: as many as are resident at once, so there is a single wave
    (sm_90, default tiles: 80 KB of shared memory per program, two buffers of K, V and q)."""
    return programs_per_sm * _device_sms(device)


def alloc_balanced_workspace(num_programs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(part_o, part_lse) for `num_programs` programs: two partial segments each (CUDA graphs need
    fixed addresses, so the engine allocates them once)."""
    rows = num_programs * 2 * _decode_config(head_dim, num_q_heads // num_kv_heads)[0]
    return (torch.empty(rows * head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, dtype=torch.float32, device=device))


def paged_decode_attention_balanced(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None,
                                    num_programs: int | None = None, workspace=None, _config=None):
    """Same contract as `paged_decode.paged_decode_attention` (q [B, Hq, D], caches [blocks,
    block_size, Hkv, D], int32 block_tables and seq_lens, 0 = padding row -> zeros), with the
    balanced schedule. workspace: (part_o, part_lse) with room for num_programs x 2 x BLOCK_G
    rows."""
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert num_q_heads % num_kv_heads == 0 and q.dtype == k_cache.dtype == v_cache.dtype
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_g, block_n, num_warps, num_stages, _ = _config or _decode_config(head_dim, group)
    block_d = triton.next_power_of_2(head_dim)
    head_blocks = triton.cdiv(group, block_g)
    units = num_kv_heads * head_blocks
    programs = num_programs or balanced_num_programs(q.device)
    rows = programs * 2 * block_g
    if workspace is None:
        workspace = alloc_balanced_workspace(programs, num_q_heads, num_kv_heads, head_dim, q.device)
    part_o, part_lse = workspace[0].view(-1)[: rows * head_dim], workspace[1].view(-1)[:rows]
    block_b = max(16, triton.next_power_of_2(batch))
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    _balanced_decode_kernel[(programs,)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse, scale * _LOG2E,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), batch,
        GROUP=group, HEAD_BLOCKS=head_blocks, UNITS=units, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=page_size, BLOCK_N=block_n, BLOCK_B=block_b, DOT_PREC=dot_prec,
        num_warps=num_warps, num_stages=num_stages, **PDL_LAUNCH)
    _merge_kernel[(batch, units)](
        seq_lens, out, part_o, part_lse, out.stride(0), out.stride(1), batch, programs,
        GROUP=group, HEAD_BLOCKS=head_blocks, UNITS=units, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_B=block_b, num_warps=4, **PDL_LAUNCH)
    return out
