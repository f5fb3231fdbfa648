"""The final draw of the sampler in one pass over the logits.

For each row: greedy rows (temperature 0) take the argmax of the logits; random rows take the
argmax of logits / T - log(E) with E ~ Exp(1) (the Gumbel-max form of "argmax of p / E": a draw
from softmax(logits / T)), where E is a pure function of (row key, token id) through the same
murmur3 mix as `nanovllm.layers.sampler.exponential_noise`. One read of the logits in their own
dtype replaces the float copy, softmax, noise tensor and division of the torch path.

The vocabulary is split across programs (a row alone is too little parallelism for one SM);
each writes its best (score, index) and a second, tiny pass picks the row's winner.

Structured outputs: rows under a grammar draw only the tokens their bitmask allows (xgrammar's
layout: bit j % 32 of int32 word j // 32 set = token j allowed). The masks are compact (one per
constrained row) and `mask_rows[row]` picks a row's mask, -1 for none: an unconstrained row reads
no mask, and a batch without masks runs the kernel variant that has no mask code at all.
`apply_token_bitmask_` writes the masks into the logits instead, for the sampler's other paths.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.decode_plan import device_sms

try:
    from triton.language.extra.cuda.libdevice import fast_logf
except ImportError:  # a Triton without the CUDA libdevice wrappers: FAST_LOG unavailable
    fast_logf = None


@triton.jit
def _mix32(x):
    # The masks keep the arithmetic mod 2^32 even if a constant promotes x to int64.
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, offset):
    # `nanovllm.layers.sampler.row_keys` for one row: int64 seed and output offset -> uint32 key.
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _mix32(lo ^ _mix32(hi ^ (offset.to(tl.uint32) * 0x9E3779B9)))


@triton.jit
def _exponential_from_bits(bits, FAST_LOG: tl.constexpr):
    # `nanovllm.layers.sampler.exponential_from_bits`: E = -log(1 - w), a series for small w.
    w = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    series = w * (1.0 + w * (0.5 + w * (1.0 / 3.0 + w * 0.25)))
    if FAST_LOG:  # lg2.approx (GPU only): its ~1e-7 absolute error is < 4e-6 of E >= 0.031 here
        log_part = -fast_logf(1.0 - w)
    else:
        log_part = -tl.log(1.0 - w)
    return tl.where(w < 1.0 / 32.0, series, log_part)


@triton.jit
def gumbel_max_scores(x, key, salt, cols, greedy, inv_t, FAST_LOG: tl.constexpr):
    """The draw's score of logits x (fp32) at token ids cols for rows with keys key / salt: x itself
    for greedy rows, else x / T - log(E), E the row's Exp(1) noise at that token (any broadcastable
    shapes)."""
    bits = _mix32(_mix32(key ^ cols.to(tl.uint32)) ^ salt)
    exp1 = _exponential_from_bits(bits, FAST_LOG)
    if FAST_LOG:
        gumbel = -fast_logf(exp1)
    else:
        gumbel = -tl.log(exp1)
    return tl.where(greedy, x, x * inv_t + gumbel)


@triton.jit
def chunk_of_row(logits_ptr, stride_row, vocab_size, chunk):
    """A (row, chunk) program's row, its chunk [lo, hi) of the vocabulary and the row's logits."""
    row = tl.program_id(0)
    lo = tl.program_id(1) * chunk
    return row, lo, tl.minimum(lo + chunk, vocab_size), logits_ptr + row.to(tl.int64) * stride_row


@triton.jit
def keep_best(best, best_id, score, cols):
    """Each lane's best (score, id) so far; strict: the first of equal scores stays, as in torch.argmax."""
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_id)


@triton.jit
def best_lane(best, best_id, vocab_size):
    """The best (score, id) over the lanes; equal scores: the lowest id (torch.argmax's tie rule)."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_id, vocab_size), axis=0)


@triton.jit
def token_allowed(mask_row_ptr, cols, in_range):
    """Whether each of cols is allowed by the bitmask row at mask_row_ptr (int32 words); lanes off
    in_range read nothing and count as allowed."""
    words = tl.load(mask_row_ptr + (cols >> 5), mask=in_range, other=-1)
    return ((words >> (cols & 31)) & 1) != 0


@triton.jit(do_not_specialize=["chunk", "num_splits"])  # batch-dependent: one variant
def _sample_split_kernel(logits_ptr, stride_row, temps_ptr, row_keys_ptr, seeds_ptr, offsets_ptr,
                         part_score_ptr, part_idx_ptr, vocab_size, chunk, num_splits,
                         mask_rows_ptr, masks_ptr, mask_words,
                         BLOCK: tl.constexpr, SEEDED: tl.constexpr, FAST_LOG: tl.constexpr,
                         PREFETCH: tl.constexpr, HAS_MASK: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    if SEEDED:  # keys from (seed, offset) here rather than in a host or device pass of their own
        key = _row_key(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row))
    else:
        key = tl.load(row_keys_ptr + row).to(tl.uint32)
    salt = key >> 7
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab_size)
    if HAS_MASK:
        mask_row = tl.load(mask_rows_ptr + row)
        masked = tl.full([BLOCK], mask_row, tl.int32) >= 0  # as a block: the interpreter's loads want one
        mask_row_ptr = masks_ptr + tl.maximum(mask_row, 0).to(tl.int64) * mask_words
    if PREFETCH:  # the next tile's load is in flight while this tile's noise is computed
        x_next = tl.load(base + lo + tl.arange(0, BLOCK), mask=lo + tl.arange(0, BLOCK) < hi, other=float("-inf"))
    for start in range(lo, hi, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < hi
        if PREFETCH:
            x = x_next.to(tl.float32)
            x_next = tl.load(base + cols + BLOCK, mask=cols + BLOCK < hi, other=float("-inf"))
        else:
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if HAS_MASK:
            x = tl.where(token_allowed(mask_row_ptr, cols, mask & masked), x, float("-inf"))
        score = gumbel_max_scores(x, key, salt, cols, greedy, inv_t, FAST_LOG)
        best, best_idx = keep_best(best, best_idx, tl.where(mask, score, float("-inf")), cols)
    top, idx = best_lane(best, best_idx, vocab_size)
    tl.store(part_score_ptr + row * num_splits + split, top)
    tl.store(part_idx_ptr + row * num_splits + split, idx)


@triton.jit(do_not_specialize=["num_splits"])
def _sample_merge_kernel(part_score_ptr, part_idx_ptr, out_ptr, num_splits, vocab_size, BLOCK_S: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    mask = s < num_splits
    score = tl.load(part_score_ptr + row * num_splits + s, mask=mask, other=float("-inf"))
    idx = tl.load(part_idx_ptr + row * num_splits + s, mask=mask, other=vocab_size)
    # Splits cover increasing token ranges: the lowest index among equal maxima wins.
    tl.store(out_ptr + row, best_lane(score, idx, vocab_size)[1].to(tl.int64))


_MAX_SPLITS = 64


class SampleConfig(NamedTuple):
    programs_per_sm: int  # splits of the vocabulary: about this many programs per SM
    block: int            # logits per loop iteration of a program
    num_warps: int
    prefetch: bool        # load tile i + 1 before the noise of tile i
    fast_log: bool        # lg2.approx logs (GPU only): changes a draw only where two scores tie to ~1e-5


# Measured on the H200 (151,936-token vocabulary): the pass is bound by the
# noise's instructions, and approximate logs halve it (256 rows: 151 -> 78 us; 64 rows: 42 -> 23 us).
DEFAULT_SAMPLE_CONFIG = SampleConfig(16, 1024, 4, True, True)


def _num_splits(batch: int, vocab_size: int, device: torch.device, config: SampleConfig) -> int:
    # ~programs_per_sm programs per SM, but no split smaller than a few tiles.
    return max(1, min(triton.cdiv(config.programs_per_sm * device_sms(device), batch),
                      triton.cdiv(vocab_size, 4 * config.block), _MAX_SPLITS))


def sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, row_keys: torch.Tensor | None,
                out: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
                offsets: torch.Tensor | None = None, _config: SampleConfig | None = None,
                mask_rows: torch.Tensor | None = None, masks: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype, unit stride on V); temperatures [B] float32 (0: greedy);
    row_keys [B] int64 from `nanovllm.layers.sampler.row_keys`, or None with seeds and offsets
    [B] int64 to derive them in the kernel (same keys). Returns [B] int64 token ids.
    mask_rows [B] int32 and masks [K, ceil(V / 32)] int32: row i draws only the tokens of
    masks[mask_rows[i]] (all tokens where mask_rows[i] < 0); see the module's docstring.
    _config: another `SampleConfig`, for tuning. On the GPU the default draws with
    approximate logs: a row can then differ from the torch sampler's draw where its two best scores
    tie to ~1e-5 (the noise's float error), never otherwise."""
    batch, vocab_size = logits.shape
    seeded = row_keys is None
    assert not seeded or (seeds is not None and offsets is not None)
    assert logits.stride(-1) == 1
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    config = _config or DEFAULT_SAMPLE_CONFIG
    if config.fast_log and (not logits.is_cuda or fast_logf is None):  # the interpreter has no lg2.approx
        config = config._replace(fast_log=False)
    splits = _num_splits(batch, vocab_size, logits.device, config)
    chunk = triton.cdiv(triton.cdiv(vocab_size, splits), config.block) * config.block
    splits = triton.cdiv(vocab_size, chunk)
    part_score = torch.empty(batch, splits, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(batch, splits, dtype=torch.int32, device=logits.device)
    keys = seeds if seeded else row_keys  # a valid pointer for the argument the variant ignores
    has_mask = masks is not None
    _sample_split_kernel[(batch, splits)](logits, logits.stride(0), temperatures, keys,
                                          seeds if seeded else keys, offsets if seeded else keys,
                                          part_score, part_idx, vocab_size, chunk, splits,
                                          mask_rows if has_mask else keys, masks if has_mask else keys,
                                          masks.shape[1] if has_mask else 0,
                                          BLOCK=config.block, SEEDED=seeded, FAST_LOG=config.fast_log,
                                          PREFETCH=config.prefetch, HAS_MASK=has_mask, num_warps=config.num_warps,
                                          **PDL_LAUNCH)
    _sample_merge_kernel[(batch,)](part_score, part_idx, out, splits, vocab_size,
                                   BLOCK_S=_MAX_SPLITS, num_warps=1, **PDL_LAUNCH)  # one variant for any batch
    return out


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, stride_row, masks_ptr, masked_rows_ptr, mask_words, vocab_size,
                                BLOCK: tl.constexpr):
    pdl_prologue()
    k = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_range = cols < vocab_size
    row = tl.load(masked_rows_ptr + k)
    ptr = logits_ptr + row * stride_row + cols
    allowed = token_allowed(masks_ptr + k.to(tl.int64) * mask_words, cols, in_range)
    tl.store(ptr, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty), mask=in_range & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, masks: torch.Tensor, masked_rows: torch.Tensor) -> torch.Tensor:
    """In place: logits[masked_rows[k], j] = -inf for every token j that masks[k] does not allow.
    logits [B, V] (unit stride on V), masks [K, ceil(V / 32)] int32, masked_rows [K] int64."""
    num, vocab_size = masks.shape[0], logits.shape[1]
    assert logits.stride(-1) == 1
    if num:
        block = 4096
        _apply_token_bitmask_kernel[(num, triton.cdiv(vocab_size, block))](
            logits, logits.stride(0), masks, masked_rows, masks.shape[1], vocab_size, BLOCK=block, num_warps=4,
            **PDL_LAUNCH)
    return logits


@triton.jit
def _resolve_input_ids_kernel(ids_ptr, prev_rows_ptr, sampled_ptr, n, BLOCK: tl.constexpr):
    pdl_prologue()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    prev = tl.load(prev_rows_ptr + i, mask=mask, other=-1)
    from_device = mask & (prev >= 0)
    token = tl.load(sampled_ptr + tl.where(from_device, prev, 0), mask=from_device, other=0)
    tl.store(ids_ptr + i, token, mask=from_device)


def resolve_input_ids(input_ids: torch.Tensor, prev_rows: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """In place: input_ids[i] = sampled[prev_rows[i]] where prev_rows[i] >= 0. A decode step's
    input is often the token its sequence drew in the previous step, which the host has not read
    yet (the steps overlap): it is taken from the device, inside the CUDA graph. All int64."""
    n = input_ids.numel()
    if n:
        block = min(1024, triton.next_power_of_2(n))
        _resolve_input_ids_kernel[(triton.cdiv(n, block),)](input_ids, prev_rows, sampled, n, BLOCK=block, **PDL_LAUNCH)
    return input_ids
