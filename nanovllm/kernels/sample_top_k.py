"""The top-k (then top-p) draw in one kernel: one program per row.

On the H200 the torch path of such draws (`nanovllm.layers.sampler._sample_top_k`: fp32 copies of
the logits, `torch.topk` over the vocabulary, a dozen small ops) costs ~0.85 ms per decode step at
256 rows, device time that a CUDA graph does not remove (BENCHMARKS.md). Here each row is read in
its own 16-bit dtype three times:

1. a histogram of the high byte of each logit's order-preserving 16-bit key finds the byte of the
   k-th largest;
2. a histogram of the low byte among the logits with that high byte finds the k-th largest key;
3. the logits above it, and the first of those equal to it (lowest token id), are gathered: exactly k.

The k candidates, scaled by 1/T, then keep the smallest prefix of their softmax (in descending order)
that reaches top_p, and the draw is the Gumbel-max among the kept with the sampler's noise
(`sample.gumbel_max_scores`): the token `_sample_top_k` draws, up to the order of equal logits and
float rounding at the top-p boundary. Greedy rows (T = 0) take the first maximum, as torch.argmax.

Written without device time: tested under the Triton interpreter, not yet run or timed on a GPU, and
not yet called by the sampler.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.sample import gumbel_max_scores

MAX_TOP_K = 128  # candidates per row (a power of two: the top-p pass compares them pairwise)


@triton.jit
def _ordered_keys(x):
    """16-bit floats -> int32 keys in [0, 65535] with the floats' order (sign flipped for positive
    values, all bits flipped for negative ones)."""
    bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return tl.where(bits >= 0x8000, 0xFFFF - bits, bits | 0x8000)


@triton.jit
def _byte_of_kth(hist, k, bins):
    """Given a 256-bin histogram of a byte and a rank k (1 = largest), the byte value holding the
    k-th largest and how many values rank above that byte."""
    at_or_above = tl.cumsum(hist, axis=0, reverse=True)
    byte = tl.max(tl.where(at_or_above >= k, bins, -1), axis=0)
    above = tl.sum(tl.where(bins == byte, at_or_above - hist, 0), axis=0)
    return byte, above


@triton.jit
def _top_k_sample_kernel(logits_ptr, stride_row, vocab_size, temps_ptr, top_k_ptr, top_p_ptr, row_keys_ptr,
                         cand_val_ptr, cand_id_ptr, out_ptr,
                         BLOCK: tl.constexpr, MAX_K: tl.constexpr, FAST_LOG: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0.0
    k = tl.where(greedy, 1, tl.load(top_k_ptr + row).to(tl.int32))
    bins = tl.arange(0, 256)
    offs = tl.arange(0, BLOCK)

    # 1. The high byte of the k-th largest key. Lanes past the vocabulary count in bin 0; taken out after.
    hist = tl.zeros([256], tl.int32)
    for start in range(0, vocab_size, BLOCK):
        mask = start + offs < vocab_size
        key = _ordered_keys(tl.load(base + start + offs, mask=mask, other=0.0))
        hist += tl.histogram(tl.where(mask, key >> 8, 0), 256)
    padding = tl.cdiv(vocab_size, BLOCK) * BLOCK - vocab_size
    hist -= tl.where(bins == 0, padding, 0)
    high, above_high = _byte_of_kth(hist, k, bins)

    # 2. Its low byte, among the keys with that high byte.
    hist = tl.zeros([256], tl.int32)
    others = 0
    for start in range(0, vocab_size, BLOCK):
        mask = start + offs < vocab_size
        key = _ordered_keys(tl.load(base + start + offs, mask=mask, other=0.0))
        take = mask & ((key >> 8) == high)
        hist += tl.histogram(tl.where(take, key & 0xFF, 0), 256)
        others += BLOCK - tl.sum(take.to(tl.int32), axis=0)
    hist -= tl.where(bins == 0, others, 0)
    low, above_low = _byte_of_kth(hist, k - above_high, bins)
    kth = high * 256 + low
    num_equal = k - above_high - above_low  # how many keys equal to the k-th one make the k (>= 1)
    num_above = k - num_equal

    # 3. Gather the k candidates: every key above the k-th, then the first num_equal equal to it.
    # Scaled as the torch sampler scales its logits (a division, not a product with 1/T).
    temp = tl.where(greedy, 1.0, temp)
    seen_above = 0
    seen_equal = 0
    cand_val = cand_val_ptr + row * MAX_K
    cand_id = cand_id_ptr + row * MAX_K
    for start in range(0, vocab_size, BLOCK):
        mask = start + offs < vocab_size
        x = tl.load(base + start + offs, mask=mask, other=0.0)
        key = _ordered_keys(x)
        is_above = mask & (key > kth)
        is_equal = mask & (key == kth)
        rank_above = seen_above + tl.cumsum(is_above.to(tl.int32), axis=0) - 1
        rank_equal = seen_equal + tl.cumsum(is_equal.to(tl.int32), axis=0) - 1
        keep = is_above | (is_equal & (rank_equal < num_equal))
        slot = tl.where(is_above, rank_above, num_above + rank_equal)
        tl.store(cand_val + slot, x.to(tl.float32) / temp, mask=keep)
        tl.store(cand_id + slot, start + offs, mask=keep)
        seen_above += tl.sum(is_above.to(tl.int32), axis=0)
        seen_equal += tl.sum(is_equal.to(tl.int32), axis=0)
    tl.debug_barrier()  # the candidates written by every thread of this program, read below

    # 4. Top-p over the candidates: keep those whose more likely candidates (ties: the earlier slot)
    # hold less than top_p of their softmax; the most likely always stays.
    c = tl.arange(0, MAX_K)
    valid = c < k
    v = tl.load(cand_val + c, mask=valid, other=float("-inf"))
    ids = tl.load(cand_id + c, mask=valid, other=0)
    p = tl.exp(v - tl.max(v, axis=0))
    p = p / tl.sum(p, axis=0)
    ahead = (v[None, :] > v[:, None]) | ((v[None, :] == v[:, None]) & (c[None, :] < c[:, None]))
    before = tl.sum(tl.where(ahead, p[None, :], 0.0), axis=1)
    top_p = tl.load(top_p_ptr + row)
    keep = valid & (before < tl.where(top_p >= 1.0, float("inf"), top_p))

    # 5. The draw among the kept (greedy rows: the single candidate, the first maximum).
    key = tl.load(row_keys_ptr + row).to(tl.uint32)
    score = gumbel_max_scores(v, key, key >> 7, ids, greedy, 1.0, FAST_LOG)
    score = tl.where(keep, score, float("-inf"))
    best = tl.max(score, axis=0)
    winner = tl.min(tl.where(score == best, c, MAX_K), axis=0)
    tl.store(out_ptr + row, tl.sum(tl.where(c == winner, ids, 0), axis=0).to(tl.int64))


def sample_top_k_rows(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      row_keys: torch.Tensor, out: torch.Tensor | None = None, block: int = 2048,
                      fast_log: bool | None = None) -> torch.Tensor:
    """logits [B, V] fp16/bf16 (unit stride on V); temperatures [B] fp32 (0: greedy); top_k [B] in
    [1, MAX_TOP_K] (any value on greedy rows); top_p [B] fp32 in (0, 1]; row_keys [B] int64
    (`nanovllm.layers.sampler.row_keys`). Returns [B] int64 token ids."""
    from nanovllm.kernels.sample import fast_logf
    batch, vocab_size = logits.shape
    assert logits.dtype in (torch.float16, torch.bfloat16) and logits.stride(-1) == 1
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    cand_val = torch.empty(batch, MAX_TOP_K, dtype=torch.float32, device=logits.device)
    cand_id = torch.empty(batch, MAX_TOP_K, dtype=torch.int32, device=logits.device)
    if fast_log is None:
        fast_log = logits.is_cuda and fast_logf is not None
    _top_k_sample_kernel[(batch,)](
        logits, logits.stride(0), vocab_size, temperatures, top_k, top_p, row_keys,
        cand_val, cand_id, out, BLOCK=min(block, triton.next_power_of_2(vocab_size)), MAX_K=MAX_TOP_K,
        FAST_LOG=fast_log, num_warps=4, **PDL_LAUNCH)
    return out
