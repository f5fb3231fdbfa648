"""The top-p draw without top-k, without sorting the vocabulary.

The torch path (`nanovllm.layers.sampler._top_k_top_p`) sorts every row's fp32 logits, takes the
softmax's running sum in that order, masks the tokens past the nucleus and scatters the row back
before the draw. With the sampler's fixed noise a token wins a draw over a set S if its score
x/T + G (G its Gumbel noise, `sample.gumbel_max_scores`) is the best in S, which allows a draw
over the nucleus N without knowing N:

- first draw (each row cut into chunks, ~16 programs per SM): the row's largest x/T and the winner
  w over the whole row;
- then one program per row: the mass of the tokens ranked before w (larger x/T; equal: lower id)
  against the row's softmax sum tells whether w is in N (what ranks before it holds less than
  top_p). If so, w is N's winner (N is a prefix of the ranking and w won over a superset of it).
  If not, N lies inside the tokens ranked before w: the winner among those is the next to test
  (found in the same pass, or for small batches in a pass of its own after a test without noise).

With min-p (applied before top-p, vLLM's order) N is also cut to the tokens within log(min_p) of
the largest x/T, and the search for the next candidate keeps to those. The top token always belongs
to N, so the loop ends. Without min-p the first draw lands in N with probability mass(N) >= top_p,
so most rows take the first draw and one more pass. Greedy rows take the first maximum, and rows
with top_p = 1 (and no min-p) the plain draw, after the first draw. The token is the torch path's
(which ranks equal logits by lowest id too), up to float rounding at the nucleus's edge.
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.kernels.sample import (DEFAULT_SAMPLE_CONFIG, SampleConfig, _num_splits, best_lane, chunk_of_row,
                                     gumbel_max_scores, keep_best)


@triton.jit
def _no_best(BLOCK: tl.constexpr):
    return tl.full([BLOCK], float("-inf"), tl.float32), tl.zeros([BLOCK], tl.int32)


@triton.jit
def _ranked_before(x, cols, winner_x, winner):
    """Whether tokens rank before the winner: a larger x/T, or an equal one and a lower id."""
    return (x > winner_x) | ((x == winner_x) & (cols < winner))


@triton.jit(do_not_specialize=["chunk", "num_chunks"])
def _first_draw_kernel(logits_ptr, stride_row, vocab_size, chunk, num_chunks, temps_ptr, row_keys_ptr,
                       part_max_ptr, part_score_ptr, part_id_ptr, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr):
    pdl_prologue()
    row, lo, hi, base = chunk_of_row(logits_ptr, stride_row, vocab_size, chunk)
    part = row * num_chunks + tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0.0
    temp = tl.where(greedy, 1.0, temp)
    key = tl.load(row_keys_ptr + row).to(tl.uint32)
    offs = tl.arange(0, BLOCK)
    row_max = tl.full([BLOCK], float("-inf"), tl.float32)
    best, best_id = _no_best(BLOCK)
    for start in range(lo, hi, BLOCK):
        cols = start + offs
        mask = cols < hi
        # Scaled as the torch sampler scales its logits (a division, not a product with 1/T).
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) / temp
        row_max = tl.maximum(row_max, x)
        score = tl.where(mask, gumbel_max_scores(x, key, key >> 7, cols, greedy, 1.0, FAST_LOG), float("-inf"))
        best, best_id = keep_best(best, best_id, score, cols)
    score, winner = best_lane(best, best_id, vocab_size)
    tl.store(part_max_ptr + part, tl.max(row_max, axis=0))
    tl.store(part_score_ptr + part, score)
    tl.store(part_id_ptr + part, winner)


@triton.jit(do_not_specialize=["num_chunks"])
def _nucleus_kernel(logits_ptr, stride_row, vocab_size, num_chunks, temps_ptr, top_p_ptr, log_min_p_ptr, row_keys_ptr,
                    part_max_ptr, part_score_ptr, part_id_ptr, out_ptr, BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
                    TEST_FIRST: tl.constexpr, HAS_MIN_P: tl.constexpr, FAST_LOG: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    temp = tl.load(temps_ptr + row)
    greedy = temp <= 0.0
    temp = tl.where(greedy, 1.0, temp)
    top_p = tl.load(top_p_ptr + row)
    key = tl.load(row_keys_ptr + row).to(tl.uint32)
    offs = tl.arange(0, BLOCK)

    # The first draw's winner: chunks cover increasing ids, so equal scores keep the lowest id.
    c = tl.arange(0, MAX_CHUNKS)
    parts = row * num_chunks + c
    in_row = c < num_chunks
    row_max = tl.max(tl.load(part_max_ptr + parts, mask=in_row, other=float("-inf")), axis=0)
    _, winner = best_lane(tl.load(part_score_ptr + parts, mask=in_row, other=float("-inf")),
                          tl.load(part_id_ptr + parts, mask=in_row, other=vocab_size), vocab_size)
    # min-p (before top-p, vLLM's order): the draw is among x/T >= its largest + log(min_p) only.
    floor = row_max + tl.load(log_min_p_ptr + row) if HAS_MIN_P else float("-inf")
    done = greedy | ((top_p >= 1.0) & (tl.load(base + winner).to(tl.float32) / temp >= floor))
    # Whether a pass also finds the winner among the tokens ranked before the one it tests. Without,
    # the test needs no noise (cheap for the rows that pass it), but a row that fails it pays a
    # search pass; with, every pass pays the noise, and a failing row goes straight to its next test.
    search = not TEST_FIRST
    while not done:
        winner_x = tl.load(base + winner).to(tl.float32) / temp
        total = tl.zeros([BLOCK], tl.float32)
        before = tl.zeros([BLOCK], tl.float32)
        best, best_id = _no_best(BLOCK)
        for start in range(0, vocab_size, BLOCK):
            cols = start + offs
            mask = cols < vocab_size
            x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) / temp
            kept = mask & (x >= floor)
            p = tl.where(kept, tl.exp(x - row_max), 0.0)
            ahead = _ranked_before(x, cols, winner_x, winner) & kept
            total += p
            before += tl.where(ahead, p, 0.0)
            if search:
                score = gumbel_max_scores(x, key, key >> 7, cols, greedy, 1.0, FAST_LOG)
                best, best_id = keep_best(best, best_id, tl.where(ahead, score, float("-inf")), cols)
        done = (winner_x >= floor) & ((top_p >= 1.0) | (tl.sum(before, axis=0) < top_p * tl.sum(total, axis=0)))
        if not done:
            if not search:  # the winner among the tokens ranked before this one, in a pass of its own
                for start in range(0, vocab_size, BLOCK):
                    cols = start + offs
                    mask = cols < vocab_size
                    x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) / temp
                    score = gumbel_max_scores(x, key, key >> 7, cols, greedy, 1.0, FAST_LOG)
                    ahead = _ranked_before(x, cols, winner_x, winner) & mask & (x >= floor)
                    best, best_id = keep_best(best, best_id, tl.where(ahead, score, float("-inf")), cols)
                search = True
            _, winner = best_lane(best, best_id, vocab_size)
    tl.store(out_ptr + row, winner.to(tl.int64))


_MAX_CHUNKS = 64
# Measured on the H200 (151,936-token vocabulary): the one program
# per row of the nucleus test, 4096 logits per tile and 16 warps.
_NUCLEUS_BLOCK, _NUCLEUS_WARPS = 4096, 16
# A test pass without the search pays only where almost no row fails it (H200, one call, rows ->
# us with / without): 1 -> 36 / 57, 16 -> 105 / 93, 64 -> 146 / 121, 128 -> 224 / 193, 256 -> 260 /
# 254. With more rows, some row fails the test, and its search pass makes the kernel's tail.
_TEST_FIRST_MAX_BATCH = 4


def sample_top_p_rows(logits: torch.Tensor, temperatures: torch.Tensor, top_p: torch.Tensor, row_keys: torch.Tensor,
                      out: torch.Tensor | None = None, config: SampleConfig | None = None,
                      test_first: bool | None = None, fast_log: bool | None = None,
                      log_min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] fp16/bf16/fp32 (unit stride on V); temperatures [B] fp32 (0: greedy); top_p [B]
    fp32 in (0, 1]; row_keys [B] int64 (`nanovllm.layers.sampler.row_keys`); log_min_p [B] fp32,
    log(min_p) (-inf: off), or None for no min-p. Returns [B] int64 ids.
    config: the first draw's chunking (`kernels/sample.py`'s, whose tiles it shares); test_first: test
    the first draw without searching the next candidate (default: for batches up to 4 rows)."""
    from nanovllm.kernels.sample import fast_logf
    batch, vocab_size = logits.shape
    assert logits.stride(-1) == 1
    if out is None:
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if fast_log is None:
        fast_log = logits.is_cuda and fast_logf is not None
    config = config or DEFAULT_SAMPLE_CONFIG
    chunks = min(_num_splits(batch, vocab_size, logits.device, config), _MAX_CHUNKS)
    chunk = triton.cdiv(triton.cdiv(vocab_size, chunks), config.block) * config.block
    chunks = triton.cdiv(vocab_size, chunk)
    part_max = torch.empty(batch, chunks, dtype=torch.float32, device=logits.device)
    part_score = torch.empty_like(part_max)
    part_id = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
    row = (logits, logits.stride(0), vocab_size)
    _first_draw_kernel[(batch, chunks)](*row, chunk, chunks, temperatures, row_keys, part_max, part_score, part_id,
                                        BLOCK=config.block, FAST_LOG=fast_log, num_warps=config.num_warps,
                                        **PDL_LAUNCH)
    _nucleus_kernel[(batch,)](*row, chunks, temperatures, top_p, log_min_p if log_min_p is not None else top_p,
                              row_keys, part_max, part_score, part_id, out,
                              BLOCK=min(_NUCLEUS_BLOCK, triton.next_power_of_2(vocab_size)), MAX_CHUNKS=_MAX_CHUNKS,
                              TEST_FIRST=batch <= _TEST_FIRST_MAX_BATCH if test_first is None else test_first,
                              HAS_MIN_P=log_min_p is not None,
                              FAST_LOG=fast_log, num_warps=_NUCLEUS_WARPS, **PDL_LAUNCH)
    return out
