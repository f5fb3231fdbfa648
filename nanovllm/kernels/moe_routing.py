"""Routing of a mixture-of-experts layer on the GPU: the router's softmax and top-k, then the routed
(token, expert) pairs sorted by expert into blocks of BM rows for the grouped GEMMs (`moe_gemm.py`).

A step of T tokens routes N = T * top_k pairs, numbered `flat = t * top_k + j` (token t's j-th
choice). `sorted_ids` lists them expert by expert (ascending flat order within an expert), each
expert's run padded with the sentinel N up to a multiple of BM, so that every BM-row block belongs
to one expert, `block_expert[block]`; `num_padded` (one int on the device) is the used length. The
buffers are sized for the worst case, N + min(N, E) * (BM - 1) entries, from T alone: no host sync
and static shapes, so CUDA graphs capture both kernels.

- `_moe_topk_kernel` (one program per BT tokens): softmax over the E router logits in fp32, the k
  largest probabilities (ties to the lowest expert id), optionally renormalised to sum to one and
  rounded to the logits' dtype (HF's Qwen routers; Mixtral keeps fp32), and the block's count of
  pairs per expert. Given the step's cache slots, a padding row of a CUDA graph (slot -1) takes the
  experts of its block's first row with weight 0 (expert 0 if that row is padding too): a batch padded
  up to a captured size reads the weights of no expert its real rows do not need (at 17 rows padded
  to 32, a third fewer), and the padding rows' output is exactly 0.
- `_moe_align_kernel` (one program per expert): every expert's total from those counts, the padded
  prefix sum, then its own pairs scattered in order, its padding and its blocks' expert id. Program 0
  writes `num_padded` (and, when recording, the step's number of distinct experts: bench.py's roofline).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue

MAX_EXPERTS = 1024  # the top-k kernel holds a [BT, E] tile of probabilities in registers


class Routing(NamedTuple):
    weights: torch.Tensor       # [T, top_k] float32, each token's weight per choice
    ids: torch.Tensor           # [T, top_k] int32 expert ids
    sorted_ids: torch.Tensor    # [max_padded] int32 flat pair ids by expert, sentinel N as padding
    block_expert: torch.Tensor  # [max_blocks] int32 expert of each BM-row block of sorted_ids
    num_padded: torch.Tensor    # [1] int32 entries of sorted_ids in use (a multiple of BM)
    block_m: int

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Entries of `sorted_ids`: every pair plus at most BM - 1 padding per expert that has one."""
    return num_pairs + min(num_pairs, num_experts) * (block_m - 1)


def topk_block(num_tokens: int, num_experts: int) -> int:
    """Tokens per program of the top-k kernel: the [BT, E] tile within ~8k registers' worth, and
    large prefills in fewer, larger blocks (the align kernel sums one count row per block)."""
    e_pow2 = triton.next_power_of_2(num_experts)
    bt = min(16, triton.next_power_of_2(num_tokens)) if num_tokens <= 1024 else 64
    return max(1, min(bt, 8192 // e_pow2))


def topk_warps(block_tokens: int, num_experts: int) -> int:
    """Warps of a top-k program. Its k rounds of row maxima are a chain of ~4k reductions, each
    through shared memory and a barrier when the tile spans several warps: with one warp they stay
    in registers and shuffles (a decode step's [16, 128] tile: one warp, 64 values a lane)."""
    return 1 if block_tokens * triton.next_power_of_2(num_experts) <= 2048 else 4


@triton.jit(do_not_specialize=["T"])
def _moe_topk_kernel(logits_ptr, slot_ptr, weights_ptr, ids_ptr, counts_ptr, T, stride_l,
                     E: tl.constexpr, E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                     RENORMALIZE: tl.constexpr, ROUND_WEIGHTS: tl.constexpr, HAS_SLOTS: tl.constexpr,
                     BT: tl.constexpr):
    pdl_prologue()
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    cols = tl.arange(0, E_POW2)
    row_ok = rows < T
    valid = cols < E
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                mask=row_ok[:, None] & valid[None, :], other=0.0).to(tl.float32)
    x = tl.where(valid[None, :], x, float("-inf"))
    # softmax(logits, dtype=float32), as HF's routers compute it
    # (div_rn: torch's IEEE division; Triton's "/" is approximate)
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = tl.div_rn(p, tl.broadcast_to(tl.sum(p, axis=1)[:, None], [BT, E_POW2]))
    p = tl.where(valid[None, :], p, -1.0)  # padding columns are never chosen
    slots = tl.arange(0, K_POW2)
    top_w = tl.zeros([BT, K_POW2], tl.float32)
    top_i = tl.zeros([BT, K_POW2], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        pick = tl.min(tl.where(p == best[:, None], cols[None, :], E_POW2), axis=1)
        pick = tl.minimum(pick, E - 1)  # a NaN row matches nothing: keep its ids in range
        top_w = tl.where(slots[None, :] == j, best[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, pick[:, None], top_i)
        p = tl.where(cols[None, :] == pick[:, None], -1.0, p)
    if RENORMALIZE:
        top_w = tl.div_rn(top_w, tl.broadcast_to(tl.sum(top_w, axis=1)[:, None], [BT, K_POW2]))  # zeros past TOP_K
    if ROUND_WEIGHTS:
        top_w = top_w.to(logits_ptr.dtype.element_ty).to(tl.float32)
    if HAS_SLOTS:
        pad = row_ok & (tl.load(slot_ptr + rows, mask=row_ok, other=0) < 0)
        first = tl.arange(0, BT) == 0
        lead = tl.sum(tl.where(first[:, None], top_i, 0), axis=0)  # the block's first row's experts
        lead = tl.where(tl.sum((first & pad).to(tl.int32), axis=0) > 0, 0, lead)
        top_i = tl.where(pad[:, None], lead[None, :], top_i)
        top_w = tl.where(pad[:, None], 0.0, top_w)
    counts = tl.zeros([E_POW2], tl.int32)
    for j in tl.static_range(TOP_K):
        expert = tl.sum(tl.where(slots[None, :] == j, top_i, 0), axis=1)
        counts += tl.sum(((cols[None, :] == expert[:, None]) & row_ok[:, None]).to(tl.int32), axis=0)
    out = rows.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)
    tl.store(counts_ptr + pid * E_POW2 + cols, counts)


@triton.jit(do_not_specialize=["N", "num_tblocks"])
def _moe_align_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, distinct_ptr, step_ptr,
                      N, num_tblocks, E_POW2: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr,
                      CB: tl.constexpr, RECORD: tl.constexpr, RING: tl.constexpr):
    pdl_prologue()
    e = tl.program_id(0)
    cols = tl.arange(0, E_POW2)
    totals = tl.zeros([E_POW2], tl.int32)
    for b0 in range(0, num_tblocks, CB):
        rows = b0 + tl.arange(0, CB)
        block_counts = tl.load(counts_ptr + rows[:, None] * E_POW2 + cols[None, :],
                               mask=(rows < num_tblocks)[:, None], other=0)
        totals += tl.sum(block_counts, axis=0)
    padded = (totals + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    mine = cols == e
    count = tl.sum(tl.where(mine, totals, 0), axis=0)
    size = tl.sum(tl.where(mine, padded, 0), axis=0)
    begin = tl.sum(tl.where(mine, ends, 0), axis=0) - size
    if e == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))
        if RECORD:
            step = tl.load(step_ptr)
            tl.store(distinct_ptr + step % RING, tl.sum((totals > 0).to(tl.int32), axis=0))
            tl.store(step_ptr, step + 1)
    if count > 0:
        lanes = tl.arange(0, BLOCK)
        first_block = begin // BM
        for b in range(0, size // BM, BLOCK):
            tl.store(block_expert_ptr + first_block + b + lanes, tl.full([BLOCK], 0, tl.int32) + e,
                     mask=b + lanes < size // BM)
        seen = count * 0
        for start in range(0, N, BLOCK):
            offs = start + lanes
            hit = (tl.load(ids_ptr + offs, mask=offs < N, other=-1) == e).to(tl.int32)
            rank = seen + tl.cumsum(hit, axis=0) - 1
            tl.store(sorted_ptr + begin + rank, offs, mask=hit > 0)
            seen += tl.sum(hit, axis=0)
        pad = tl.arange(0, BM)
        tl.store(sorted_ptr + begin + count + pad, tl.full([BM], 0, tl.int32) + N, mask=pad < size - count)


def route(logits: torch.Tensor, top_k: int, block_m: int, renormalize: bool, round_weights: bool,
          stats: tuple[torch.Tensor, torch.Tensor] | None = None, slots: torch.Tensor | None = None) -> Routing:
    """Top-k routing of logits [T, E] and the pairs sorted by expert into BM-row blocks. stats:
    (distinct [ring] int32, step [1] int32) to record the step's number of distinct experts at
    distinct[step % ring] and count the step (layers/fused_moe.RoutingStats). slots: the step's
    [T] cache slots, -1 on padding rows (routed to the experts of a real row, with weight 0)."""
    t, e = logits.shape
    assert logits.stride(-1) == 1 and 1 <= top_k <= e <= MAX_EXPERTS, (logits.shape, top_k)
    device = logits.device
    n = t * top_k
    e_pow2 = triton.next_power_of_2(e)
    bt = topk_block(t, e)
    num_tblocks = triton.cdiv(t, bt)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=device)
    counts = torch.empty(num_tblocks, e_pow2, dtype=torch.int32, device=device)
    padded = max_padded(n, e, block_m)
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=device)
    block_expert = torch.empty(triton.cdiv(padded, block_m), dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    if t == 0:
        num_padded.zero_()
        return Routing(weights, ids, sorted_ids, block_expert, num_padded, block_m)
    assert slots is None or slots.shape == (t,), (None if slots is None else slots.shape, t)
    _moe_topk_kernel[(num_tblocks,)](
        logits, logits if slots is None else slots, weights, ids, counts, t, logits.stride(0),
        E=e, E_POW2=e_pow2, TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        ROUND_WEIGHTS=round_weights, HAS_SLOTS=slots is not None, BT=bt, num_warps=topk_warps(bt, e),
        **PDL_LAUNCH)
    block = min(4096, max(triton.next_power_of_2(n), 128))
    recording = stats is not None
    distinct, step = stats if recording else (num_padded, num_padded)  # unused pointers when not recording
    _moe_align_kernel[(e,)](
        ids, counts, sorted_ids, block_expert, num_padded, distinct, step, n, num_tblocks,
        E_POW2=e_pow2, BM=block_m, BLOCK=block, CB=max(1, min(64, 4096 // e_pow2)), RECORD=recording,
        RING=distinct.numel() if recording else 1, num_warps=4 if block <= 1024 else 8, **PDL_LAUNCH)
    return Routing(weights, ids, sorted_ids, block_expert, num_padded, block_m)
