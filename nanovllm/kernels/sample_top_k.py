"""The top-k (then top-p) draw in three short kernels, for rows whose top_k is at most MAX_TOP_K.

On the H200 the torch path of such draws (`nanovllm.layers.sampler._sample_top_k`: fp32 copies of
the logits, `torch.topk` over the vocabulary, a dozen small ops) costs ~1 ms per decode step at 1-256
rows (BENCHMARKS.md). Here each row is read twice in its own dtype (16-bit, or float32 where
penalties made float32 logits), cut into chunks so that even one row keeps the GPU's memory system
busy. A logit's key is its bits reordered so that integer order is float order. Past k = 128 the
programs read with wider lanes (at least 4k: k lane maxima still bound the row tightly) and the
finish ranks its candidates for top-p by bisection rather than pairwise.

1. Bound: each chunk keeps, per lane, the largest key the lane reads; the k-th largest of those lane
   maxima is k distinct logits of the row, so the row's k-th largest is at or above it. The row's
   bound is the highest over its chunks.
2. Compact: each chunk lists its keys at or above the bound (slots taken with atomics): about
   chunks x k of them (a tight bound needs k << the lanes of a chunk), at most MAX_CANDIDATES.
3. Finish, one program per row: the k-th largest listed key (bisection), and the listed keys above
   it with the lowest ids equal to it, are the top k. Keep the smallest prefix of their softmax at
   1/T (by logit, then lowest id) that reaches top_p (after min-p, where asked), and draw the Gumbel-max
   among the kept with the sampler's noise (`sample.gumbel_max_scores`). A list that overflowed
   (a tie longer than it, e.g. a row of equal logits) is rebuilt exactly by bisecting the key
   with counting passes over the row: slow, never wrong.

The token is the one `_sample_top_k` draws (its order of equal logits is this one: lowest id first),
up to float rounding at the top-p boundary. Greedy rows (T = 0) take the first maximum, as torch.argmax.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.decode_plan import device_sms
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.sample import chunk_of_row, gumbel_max_scores

MAX_TOP_K = 1024
PAIRWISE_MAX_K = 128  # up to this k the finish ranks its candidates by comparing every pair, past it by bisection
MAX_CANDIDATES = 2048  # listed per row (a power of two: the lanes of one program in step 3)


class TopKConfig(NamedTuple):
    programs_per_sm: int  # chunks per row: about this many programs per SM in all (see _num_chunks)
    block: int            # logits per loop iteration of a program, also the lanes of step 1
    num_warps: int


DEFAULT_TOP_K_CONFIG = TopKConfig(16, 1024, 4)


@triton.jit
def _ordered_keys(x):
    """Floats -> int32 keys with the floats' order: 16-bit floats to [0, 65535] (sign flipped for
    positive values, all bits flipped for negative ones), float32 to the whole int32 range (the
    magnitude bits flipped for negative values)."""
    if x.dtype == tl.float32:
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    else:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        key = tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)
    return key


def _key_range(dtype: torch.dtype) -> tuple[int, int]:
    """(least key, key bits) of `_ordered_keys` for logits of this dtype."""
    return (-(1 << 31), 32) if dtype == torch.float32 else (0, 16)


@triton.jit
def _row_k(temps_ptr, top_k_ptr, row, vocab_size):
    """The row's k: its top_k, 1 on greedy rows, never more than the vocabulary."""
    greedy = tl.load(temps_ptr + row) <= 0.0
    return tl.minimum(tl.where(greedy, 1, tl.load(top_k_ptr + row).to(tl.int32)), vocab_size)


@triton.jit
def _kth_largest(values, valid, k, LEAST: tl.constexpr, BITS: tl.constexpr):
    """The k-th largest of the valid lanes of values (in [LEAST, LEAST + 2^BITS)), by bisection: the
    largest t with at least k valid values at or above it (LEAST if there are fewer than k)."""
    lo = tl.full([], LEAST, tl.int64)
    hi = lo + (1 << BITS)
    for _ in range(BITS):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((valid & (values >= mid)).to(tl.int32), axis=0) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo.to(tl.int32)


@triton.jit(do_not_specialize=["chunk"])
def _bound_kernel(logits_ptr, stride_row, vocab_size, chunk, temps_ptr, top_k_ptr, counts_ptr, BLOCK: tl.constexpr,
                  LEAST_KEY: tl.constexpr, KEY_BITS: tl.constexpr):
    pdl_prologue()
    row, lo, hi, base = chunk_of_row(logits_ptr, stride_row, vocab_size, chunk)
    offs = tl.arange(0, BLOCK)
    lane_max = tl.full([BLOCK], LEAST_KEY, tl.int32)  # a lane without logits bounds nothing
    for start in range(lo, hi, BLOCK):
        mask = start + offs < hi
        key = _ordered_keys(tl.load(base + start + offs, mask=mask, other=0.0))
        lane_max = tl.maximum(lane_max, tl.where(mask, key, LEAST_KEY))
    kth = _kth_largest(lane_max, offs >= 0, _row_k(temps_ptr, top_k_ptr, row, vocab_size), LEAST_KEY, KEY_BITS)
    tl.atomic_max(counts_ptr + row * 2, kth, sem="relaxed")


@triton.jit(do_not_specialize=["chunk"])
def _compact_kernel(logits_ptr, stride_row, vocab_size, chunk, counts_ptr, cand_key_ptr, cand_id_ptr,
                    BLOCK: tl.constexpr, CAP: tl.constexpr):
    pdl_prologue()
    row, lo, hi, base = chunk_of_row(logits_ptr, stride_row, vocab_size, chunk)
    offs = tl.arange(0, BLOCK)
    bound = tl.load(counts_ptr + row * 2)
    for start in range(lo, hi, BLOCK):
        mask = start + offs < hi
        key = _ordered_keys(tl.load(base + start + offs, mask=mask, other=0.0))
        listed = mask & (key >= bound)
        num_listed = tl.sum(listed.to(tl.int32), axis=0)
        if num_listed > 0:
            slot = (tl.atomic_add(counts_ptr + row * 2 + 1, num_listed, sem="relaxed")
                    + tl.cumsum(listed.to(tl.int32), 0) - 1)
            fits = listed & (slot < CAP)
            tl.store(cand_key_ptr + row * CAP + slot, key, mask=fits)
            tl.store(cand_id_ptr + row * CAP + slot, start + offs, mask=fits)


@triton.jit
def _count_at_or_above(base, vocab_size, threshold, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    count = 0
    for start in range(0, vocab_size, BLOCK):
        mask = start + offs < vocab_size
        key = _ordered_keys(tl.load(base + start + offs, mask=mask, other=0.0))
        count += tl.sum((mask & (key >= threshold)).to(tl.int32), axis=0)
    return count


@triton.jit
def _list_exactly_k(base, vocab_size, k, bound, cand_key, cand_id, BLOCK: tl.constexpr, LEAST_KEY: tl.constexpr,
                    KEY_BITS: tl.constexpr):
    """The k best keys of a row (ties: lowest ids) into the list, from the row itself: the k-th
    largest key by bisection (at least k keys at or above `bound`), then one pass to list them."""
    lo = bound.to(tl.int64)
    hi = tl.full([], LEAST_KEY, tl.int64) + (1 << KEY_BITS)
    for _ in range(KEY_BITS):
        mid = lo + (hi - lo) // 2
        enough = _count_at_or_above(base, vocab_size, mid, BLOCK) >= k
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    num_above = _count_at_or_above(base, vocab_size, lo + 1, BLOCK)
    offs = tl.arange(0, BLOCK)
    seen_above = 0
    seen_equal = 0
    for start in range(0, vocab_size, BLOCK):
        mask = start + offs < vocab_size
        key = _ordered_keys(tl.load(base + start + offs, mask=mask, other=0.0))
        above = mask & (key > lo)
        equal = mask & (key == lo)
        rank_equal = seen_equal + tl.cumsum(equal.to(tl.int32), 0) - 1
        slot = tl.where(above, seen_above + tl.cumsum(above.to(tl.int32), 0) - 1, num_above + rank_equal)
        take = above | (equal & (num_above + rank_equal < k))
        tl.store(cand_key + slot, key, mask=take)
        tl.store(cand_id + slot, start + offs, mask=take)
        seen_above += tl.sum(above.to(tl.int32), axis=0)
        seen_equal += tl.sum(equal.to(tl.int32), axis=0)


@triton.jit
def _nucleus(v, ids, p, valid, top_p, ID_BITS: tl.constexpr):
    """The valid lanes the top-p prefix keeps (mass ranked before them < top_p, inf: all; ranked by v,
    equal v by lowest id), found by bisection instead of pairwise comparisons: the lowest key t of v whose
    strictly larger values hold less than top_p, then among the lanes at t the highest id bound."""
    key = _ordered_keys(v)  # v is float32: keys over the whole int32 range
    lo = tl.full([], -(1 << 31) - 1, tl.int64)  # everything lies above lo: mass >= top_p
    hi = tl.full([], (1 << 31) - 1, tl.int64)   # nothing lies above hi: mass 0 < top_p
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        light = tl.sum(tl.where(valid & (key > mid), p, 0.0), axis=0) < top_p
        hi = tl.where(light, mid, hi)
        lo = tl.where(light, lo, mid)
    above = tl.sum(tl.where(valid & (key > hi), p, 0.0), axis=0)
    tied = valid & (key == hi)
    last_id = tl.full([], 1 << ID_BITS, tl.int64)  # one lane at t: it is kept
    if tl.sum(tied.to(tl.int32), axis=0) > 1:
        # The largest b with above + (mass of the tied ids below b) < top_p: ids up to b stay.
        lo_id = tl.full([], 0, tl.int64)
        hi_id = tl.full([], (1 << ID_BITS) + 1, tl.int64)
        for _ in range(ID_BITS + 1):
            mid = (lo_id + hi_id) // 2
            light = above + tl.sum(tl.where(tied & (ids < mid), p, 0.0), axis=0) < top_p
            lo_id = tl.where(light, mid, lo_id)
            hi_id = tl.where(light, hi_id, mid)
        last_id = lo_id
    return valid & ((key > hi) | (tied & (ids <= last_id)))


@triton.jit
def _finish_kernel(logits_ptr, stride_row, vocab_size, temps_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, row_keys_ptr,
                   counts_ptr, cand_key_ptr, cand_id_ptr, out_ptr, BLOCK: tl.constexpr, CAP: tl.constexpr,
                   MAX_K: tl.constexpr, ID_BITS: tl.constexpr, LEAST_KEY: tl.constexpr, KEY_BITS: tl.constexpr,
                   HAS_TOP_P: tl.constexpr, HAS_MIN_P: tl.constexpr, FAST_LOG: tl.constexpr,
                   BISECT_TOP_P: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    cand_key = cand_key_ptr + row * CAP
    cand_id = cand_id_ptr + row * CAP
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0.0
    temp = tl.where(greedy, 1.0, temp)
    k = _row_k(temps_ptr, top_k_ptr, row, vocab_size)
    num_listed = tl.load(counts_ptr + row * 2 + 1)
    if num_listed > CAP:  # the list overflowed: rebuild it with exactly the k best
        _list_exactly_k(base, vocab_size, k, tl.load(counts_ptr + row * 2), cand_key, cand_id, BLOCK, LEAST_KEY,
                        KEY_BITS)
        num_listed = k
        tl.debug_barrier()  # the list written by every thread of this program, read below

    # The candidates: the listed keys above the k-th largest, then the lowest ids equal to it.
    c = tl.arange(0, CAP)
    listed = c < num_listed
    key = tl.load(cand_key + c, mask=listed, other=LEAST_KEY)
    ids = tl.load(cand_id + c, mask=listed, other=vocab_size)
    kth = _kth_largest(key, listed, k, LEAST_KEY, KEY_BITS)
    above = listed & (key > kth)
    equal = listed & (key == kth)
    needed = k - tl.sum(above.to(tl.int32), axis=0)
    last_id = vocab_size  # usually every key equal to the k-th is needed
    if tl.sum(equal.to(tl.int32), axis=0) > needed:
        # The needed-th lowest id among the equal: the needed-th largest of (vocab - 1 - id).
        last_id = vocab_size - 1 - _kth_largest(vocab_size - 1 - ids, equal, needed, 0, ID_BITS)
    chosen = above | (equal & (ids <= last_id))
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.debug_barrier()  # every thread has read the list: its first k slots now take the candidates
    tl.store(cand_id + slot, ids, mask=chosen)
    tl.debug_barrier()
    c = tl.arange(0, MAX_K)
    top = c < k
    ids = tl.load(cand_id + c, mask=top, other=vocab_size)
    # Scaled as the torch sampler scales its logits (a division, not a product with 1/T).
    v = tl.load(base + ids, mask=top, other=float("-inf")).to(tl.float32) / temp
    keep = top
    if HAS_MIN_P:  # min-p first (vLLM's order): probabilities below min_p times the largest go
        keep = top & (v >= tl.max(v, axis=0) + tl.load(log_min_p_ptr + row))
        v = tl.where(keep, v, float("-inf"))
    if HAS_TOP_P:  # the smallest prefix (by logit, then lowest id) whose softmax reaches top_p
        p = tl.exp(v - tl.max(v, axis=0))
        p = p / tl.sum(p, axis=0)
        top_p = tl.load(top_p_ptr + row)
        top_p = tl.where(top_p >= 1.0, float("inf"), top_p)
        if BISECT_TOP_P:  # too many lanes to compare every pair
            keep = _nucleus(v, ids, p, keep, top_p, ID_BITS)
        else:
            ahead = (v[None, :] > v[:, None]) | ((v[None, :] == v[:, None]) & (ids[None, :] < ids[:, None]))
            before = tl.sum(tl.where(ahead, p[None, :], 0.0), axis=1)
            keep = keep & (before < top_p)

    # The draw among the kept (greedy rows: the single candidate); equal scores: the lowest id.
    seed_key = tl.load(row_keys_ptr + row).to(tl.uint32)
    score = gumbel_max_scores(v, seed_key, seed_key >> 7, ids, greedy, 1.0, FAST_LOG)
    score = tl.where(keep, score, float("-inf"))
    best = tl.max(score, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(score == best, ids, vocab_size), axis=0).to(tl.int64))


def _num_chunks(batch: int, vocab_size: int, max_top_k: int, device: torch.device, programs_per_sm: int,
                block: int) -> int:
    """~programs_per_sm programs per SM, but no chunk shorter than two tiles, and few enough that the
    list keeps well under MAX_CANDIDATES (about chunks x k keys reach the bound while k is at most a
    quarter of the lanes)."""
    return max(1, min(triton.cdiv(programs_per_sm * device_sms(device), batch),
                      triton.cdiv(vocab_size, 2 * block), MAX_CANDIDATES // (2 * max_top_k)))


def sample_top_k_rows(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor | None, row_keys: torch.Tensor, max_top_k: int = MAX_TOP_K,
                      out: torch.Tensor | None = None, config: TopKConfig | None = None,
                      fast_log: bool | None = None, log_min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp16/bf16/fp32 (unit stride on V); temperatures [B] fp32 (0: greedy); top_k [B] in
    [1, max_top_k] (any value on greedy rows), max_top_k <= MAX_TOP_K; top_p [B] fp32 in (0, 1], or
    None for no top-p; row_keys [B] int64 (`nanovllm.layers.sampler.row_keys`); log_min_p [B] fp32,
    log(min_p) (-inf: off), or None for no min-p. Returns [B] int64 token ids. config: another
    `TopKConfig`, for tuning."""
    from nanovllm.kernels.sample import fast_logf
    batch, vocab_size = logits.shape
    assert logits.dtype in (torch.float16, torch.bfloat16, torch.float32) and logits.stride(-1) == 1
    assert 0 < max_top_k <= MAX_TOP_K
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    config = config or DEFAULT_TOP_K_CONFIG
    wide = max_top_k > PAIRWISE_MAX_K
    block = config.block
    if wide:  # lanes enough that k of their maxima bound the row tightly (see _num_chunks)
        block = max(block, min(4096, triton.next_power_of_2(4 * max_top_k)))
    assert block >= max_top_k  # step 1 needs k lanes
    chunks = _num_chunks(batch, vocab_size, max_top_k, logits.device, config.programs_per_sm, block)
    chunk = triton.cdiv(triton.cdiv(vocab_size, chunks), block) * block
    chunks = triton.cdiv(vocab_size, chunk)
    least_key, key_bits = _key_range(logits.dtype)
    counts = torch.zeros(batch, 2, dtype=torch.int32, device=logits.device)  # bound, number listed
    if least_key:
        counts[:, 0] = least_key
    cand_key = torch.empty(batch, MAX_CANDIDATES, dtype=torch.int32, device=logits.device)
    cand_id = torch.empty(batch, MAX_CANDIDATES, dtype=torch.int32, device=logits.device)
    if fast_log is None:
        fast_log = logits.is_cuda and fast_logf is not None
    row = (logits, logits.stride(0), vocab_size)
    launch = dict(num_warps=config.num_warps, **PDL_LAUNCH)
    keys_of = dict(LEAST_KEY=least_key, KEY_BITS=key_bits)
    _bound_kernel[(batch, chunks)](*row, chunk, temperatures, top_k, counts, BLOCK=block, **keys_of, **launch)
    _compact_kernel[(batch, chunks)](*row, chunk, counts, cand_key, cand_id, BLOCK=block, CAP=MAX_CANDIDATES, **launch)
    _finish_kernel[(batch,)](*row, temperatures, top_k, top_p if top_p is not None else temperatures,
                             log_min_p if log_min_p is not None else temperatures, row_keys, counts, cand_key, cand_id,
                             out, BLOCK=block, CAP=MAX_CANDIDATES, MAX_K=MAX_TOP_K if wide else PAIRWISE_MAX_K,
                             ID_BITS=max(1, (vocab_size - 1).bit_length()), **keys_of, HAS_TOP_P=top_p is not None,
                             HAS_MIN_P=log_min_p is not None, FAST_LOG=fast_log, BISECT_TOP_P=wide,
                             num_warps=8 if wide else 4, **PDL_LAUNCH)  # 1,024 lanes: 4 warps would spill
    return out
