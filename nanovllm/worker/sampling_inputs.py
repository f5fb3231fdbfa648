"""Per-request sampling parameters gathered into batch tensors for the sampler.

One host loop over the batch decides which optional stages the batch needs; only those get
tensors, and only for the rows that use them (see SamplingMetadata).
"""
import weakref

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.penalties import PenaltyInputs
from nanovllm.layers.sampling_metadata import SamplingMetadata
from nanovllm.worker.inputs import SEED_MASK, _to_device

# murmur3's constants and the offset's multiplier (layers/sampler.py), as uint32 scalars: in uint32
# lanes every product wraps mod 2^32 by itself, so no op needs the int64 form's masks.
_C1, _C2, _GOLDEN = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35), np.uint32(0x9E3779B9)
_SHIFT13, _SHIFT16, _SHIFT32 = np.uint32(13), np.uint32(16), np.uint64(32)


def build_sampling_metadata(seqs: list[Sequence], device: torch.device, eos_token_ids=(),
                            vocab_size: int | None = None, last_sampled: torch.Tensor | None = None,
                            last_row_of_seq: dict[int, int] | None = None, stage=None,
                            drafts: list[list[int]] | None = None) -> SamplingMetadata:
    """eos_token_ids: the engine's eos ids, banned (with each request's stop_token_ids) while a
    sequence has fewer than min_tokens outputs. vocab_size, when given, drops stop ids outside
    the vocabulary instead of letting them index out of range. last_sampled / last_row_of_seq:
    the previous step's sampled tokens (on the device) and each sequence's row in them, for
    penalties over outputs whose newest token the host has not read yet (a placeholder).
    stage: a HostToDevice that moves the per-row arrays every step needs in one copy.

    drafts (speculative verification): per sequence the draft tokens the step verifies; sequence
    i then has len(drafts[i]) + 1 rows, row j drawing output position num_completion_tokens + j
    as if drafts[i][:j] had been generated: its noise, min_tokens bans and penalty history are
    that position's, so every row draws what plain decoding would draw there."""
    num_seqs = len(seqs)
    row_counts = None if drafts is None else [len(d) + 1 for d in drafts]
    num_rows = num_seqs if row_counts is None else sum(row_counts)
    temps = np.empty(num_rows, dtype=np.float32)
    seeds = np.empty(num_rows, dtype=np.uint64)
    # With drafts, row r of a sequence whose rows start at `row` draws output position num_out + r - row:
    # num_out - row here, + r after the loop.
    offsets = np.empty(num_rows, dtype=np.int64)
    filter_rows, top_ks, top_ps = [], [], []
    min_p_rows, min_ps = [], []
    penalty_rows, penalty_seqs, penalty_extras = [], [], []
    banned_rows, banned_ids = [], []
    bias_rows, bias_ids, bias_values = [], [], []
    max_logprobs = None
    row = num_greedy = 0
    # One pass over the sequences: a verifying sequence's rows share its parameters and differ only
    # in their output position (its first row's, + j), so its per-row values are slices.
    for i, seq in enumerate(seqs):
        rows = 1 if row_counts is None else row_counts[i]
        end = row + rows
        sp = seq.sampling_params
        num_out = seq.num_completion_tokens
        offsets[row:end] = num_out - row if row_counts is not None else num_out
        seeds[row:end] = seq.seed & SEED_MASK
        if sp.greedy:
            temps[row:end] = 0.0  # greedy rows skip the filters: they cannot change an argmax
            num_greedy += rows
        else:
            temps[row:end] = sp.temperature
            if sp.top_k > 0 or sp.top_p < 1.0:
                filter_rows.extend(range(row, end))
                top_ks.extend([max(sp.top_k, 0)] * rows)
                top_ps.extend([sp.top_p] * rows)
            if sp.min_p > 0.0:
                min_p_rows.extend(range(row, end))
                min_ps.extend([sp.min_p] * rows)
        if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0:
            penalty_rows.extend(range(row, end))
            penalty_seqs.extend([seq] * rows)
            if drafts is not None:
                penalty_extras.extend(drafts[i][:j] for j in range(rows))
        # Under a grammar, its mask keeps stop tokens out instead (structured_output/manager.py).
        if num_out < sp.min_tokens and (seq.grammar is None or not seq.grammar.bans_stop_tokens):
            ids = set(sp.stop_token_ids) if sp.ignore_eos else set(sp.stop_token_ids) | set(eos_token_ids)
            if vocab_size is not None:
                ids = [t for t in ids if t < vocab_size]
            for r in range(row, min(end, row + sp.min_tokens - num_out)):  # the rows under min_tokens
                banned_rows.extend([r] * len(ids))
                banned_ids.extend(ids)
        if sp.logit_bias is not None:
            for r in range(row, end):
                bias_rows.extend([r] * len(sp.logit_bias))
                bias_ids.extend(sp.logit_bias)
                bias_values.extend(sp.logit_bias.values())
        if sp.logprobs is not None and (max_logprobs is None or sp.logprobs > max_logprobs):
            max_logprobs = sp.logprobs
        row = end
    if row_counts is not None:
        offsets += np.arange(num_rows)
    all_greedy = num_greedy == num_rows
    seeds = seeds.view(np.int64)
    # A greedy row's draw reads no noise, so an all-greedy batch's keys are never read.
    keys = np.zeros(num_rows, dtype=np.int64) if all_greedy else host_row_keys(seeds, offsets)
    per_row = [temps, seeds, offsets, keys]
    histories = None
    if penalty_rows:  # their arrays travel in the same copy
        histories = PenaltyHistories(penalty_seqs, last_row_of_seq, penalty_extras if drafts is not None else None)
        per_row += histories.arrays
    if stage is not None:
        on_device = stage(*per_row)
    else:
        on_device = [_to_device(a, device) for a in per_row]
    temps_t, seeds_t, offsets_t, keys_t = on_device[:4]
    meta = SamplingMetadata(
        temperatures=temps_t,
        seeds=seeds_t,
        offsets=offsets_t,
        row_keys=keys_t,
        all_greedy=all_greedy,
        all_random=num_greedy == 0,
        max_num_logprobs=max_logprobs,
    )
    if filter_rows:
        meta.filter_rows = _rows(filter_rows, num_rows, device)
        if any(top_ks):
            meta.top_k = _to_device(np.asarray(top_ks, dtype=np.int64), device)
            meta.max_top_k = max(top_ks)
            meta.top_k_bounded = all(top_ks)
        meta.random_rows_filtered = len(filter_rows) == num_rows - num_greedy
        if any(top_ks) and not (meta.top_k_bounded and meta.random_rows_filtered):
            # Rows with a top_k beside random rows without one: the sampler may split the batch.
            with_k = [row for row, k in zip(filter_rows, top_ks) if k > 0]
            others = sorted(set(range(num_rows)) - set(with_k))
            meta.top_k_rows = _to_device(np.asarray(with_k, dtype=np.int64), device)
            meta.other_rows = _to_device(np.asarray(others, dtype=np.int64), device)
        if any(p < 1.0 for p in top_ps):
            meta.top_p = _to_device(np.asarray(top_ps, dtype=np.float32), device)
    if min_p_rows:
        meta.min_p_rows = _rows(min_p_rows, num_rows, device)
        meta.min_p = _to_device(np.asarray(min_ps, dtype=np.float32), device)
    if histories is not None:
        meta.penalties = histories.inputs(on_device[4:], _rows(penalty_rows, num_rows, device), last_sampled)
    if bias_ids:
        meta.bias_rows = _to_device(np.asarray(bias_rows, dtype=np.int64), device)
        meta.bias_ids = _to_device(np.asarray(bias_ids, dtype=np.int64), device)
        meta.bias_values = _to_device(np.asarray(bias_values, dtype=np.float32), device)
    if banned_ids:
        meta.banned_rows = _to_device(np.asarray(banned_rows, dtype=np.int64), device)
        meta.banned_ids = _to_device(np.asarray(banned_ids, dtype=np.int64), device)
    return meta


def host_row_keys(seeds: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`nanovllm.layers.sampler.row_keys` on the host, so no small kernels run per step. In place
    on uint32 lanes: a step's rows are few, and each numpy call costs far more than its lanes."""
    s = seeds.view(np.uint64)
    x = offsets.astype(np.uint32)  # the product mod 2^32 depends on the offset's low 32 bits only
    x *= _GOLDEN
    x ^= (s >> _SHIFT32).astype(np.uint32)
    x = _mix32_(x)
    x ^= s.astype(np.uint32)
    return _mix32_(x).astype(np.int64)


def _mix32_(x: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser (layers/sampler.py's _mix32), in place on uint32."""
    x ^= x >> _SHIFT16
    x *= _C1
    x ^= x >> _SHIFT13
    x *= _C2
    x ^= x >> _SHIFT16
    return x


def _rows(rows: list[int], num_seqs: int, device: torch.device) -> torch.Tensor | None:
    """Index tensor of a stage's rows; None when that is every row, so the stage skips the gather."""
    if len(rows) == num_seqs:
        return None
    return _to_device(np.asarray(rows, dtype=np.int64), device)


class _Mirror:
    """A sequence's settled tokens (all but the pending ones, which never change again) as int32
    numpy, extended as its output grows."""
    __slots__ = ("tokens", "size")

    def __init__(self):
        self.tokens = np.empty(0, dtype=np.int32)
        self.size = 0


# Per sequence, for as long as it lives: rebuilding every history from its Python list each step
# costs ~30 us per 1,000 tokens, milliseconds per step at a few hundred rows.
_mirrors: "weakref.WeakKeyDictionary[Sequence, _Mirror]" = weakref.WeakKeyDictionary()


def settled_tokens(seq: Sequence) -> np.ndarray:
    """seq.token_ids without its pending tokens, as int32 numpy (a view: read it before the next step)."""
    n = len(seq.token_ids) - seq.num_pending_tokens
    mirror = _mirrors.get(seq)
    if mirror is None:
        mirror = _mirrors[seq] = _Mirror()
    if mirror.size < n:
        if len(mirror.tokens) < n:
            grown = np.empty(max(2 * n, 64), dtype=np.int32)
            grown[:mirror.size] = mirror.tokens[:mirror.size]
            mirror.tokens = grown
        mirror.tokens[mirror.size:n] = seq.token_ids[mirror.size:n]
        mirror.size = n
    return mirror.tokens[:n]


class PenaltyHistories:
    """The token histories of a batch's penalised rows, flattened on the host (`arrays`, to copy to
    the device with the step's other inputs), then `inputs` for the sampler. A token still in
    flight (at most one per sequence, the last) is a placeholder here, filled on the device from
    the previous step's samples without waiting for them. extras: tokens that follow each row's
    history (a verification row's drafts; such a step has nothing in flight)."""

    def __init__(self, seqs: list[Sequence], last_row_of_seq: dict[int, int] | None,
                 extras: list[list[int]] | None = None):
        params = [s.sampling_params for s in seqs]
        repetition = np.asarray([p.repetition_penalty for p in params], dtype=np.float32)
        frequency = np.asarray([p.frequency_penalty for p in params], dtype=np.float32)
        presence = np.asarray([p.presence_penalty for p in params], dtype=np.float32)
        settled = [settled_tokens(s) for s in seqs]
        pending = np.asarray([getattr(s, "num_pending_tokens", 0) for s in seqs], dtype=np.int64)
        starts = np.asarray([s.num_prompt_tokens for s in seqs], dtype=np.int64)
        output_lens = np.fromiter((len(t) for t in settled), dtype=np.int64, count=len(seqs)) - starts + pending
        if extras is not None:
            assert not pending.any(), "a verification step has no token in flight"
            output_lens += np.fromiter(map(len, extras), dtype=np.int64, count=len(seqs))
        ends = np.cumsum(output_lens)
        output = np.zeros(int(ends[-1]), dtype=np.int32)
        for i, (tokens, start, end, n) in enumerate(zip(settled, starts, ends, output_lens)):
            output[end - n:end - n + len(tokens) - start] = tokens[start:]
            if extras is not None and extras[i]:
                output[end - len(extras[i]):end] = extras[i]
        in_flight = pending.nonzero()[0]
        self.num_pending = len(in_flight)
        pending_src = np.asarray([last_row_of_seq[seqs[i].seq_id] for i in in_flight], dtype=np.int64)
        self.arrays = [output, output_lens, ends[in_flight] - 1, pending_src]
        # The penalties some row uses, in the order their arrays follow those four.
        self.penalties = []
        if (repetition != 1.0).any():
            prompts = np.concatenate([t[:n] for t, n in zip(settled, starts)])
            self.arrays += [prompts, starts, repetition]  # the prompts' lengths are their starts
            self.penalties.append("repetition")
        for name, values in (("frequency", frequency), ("presence", presence)):
            if values.any():
                self.arrays.append(values)
                self.penalties.append(name)

    def inputs(self, on_device: list[torch.Tensor], rows: torch.Tensor | None,
               last_sampled: torch.Tensor | None) -> PenaltyInputs:
        """on_device: `arrays` on the device, in order."""
        output, output_lens, dst, src, *rest = on_device
        output = output.long()
        if self.num_pending:
            output.index_copy_(0, dst, last_sampled[src])
        inputs = PenaltyInputs(rows, output, _row_of_each(output_lens, output.shape[0]), None, None, None, None, None)
        for name in self.penalties:
            if name == "repetition":
                prompt, prompt_lens, inputs.repetition, *rest = rest
                inputs.prompt_tokens, inputs.prompt_rows = prompt.long(), _row_of_each(prompt_lens, prompt.shape[0])
            else:
                values, *rest = rest
                setattr(inputs, name, values)
        return inputs


def _row_of_each(lens: torch.Tensor, total: int) -> torch.Tensor:
    """[sum(lens)]: i repeated lens[i] times (the size given, so that no host sync is needed)."""
    return torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens, output_size=total)
