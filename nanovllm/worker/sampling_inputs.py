"""Per-request sampling parameters gathered into batch tensors for the sampler.

One host loop over the batch decides which optional stages the batch needs; only those get
tensors, and only for the rows that use them (see SamplingMetadata).
"""
import numpy as np
import torch

from nanovllm.engine.sequence import Sequence
from nanovllm.layers.penalties import PenaltyInputs
from nanovllm.layers.sampler import SamplingMetadata, _mix32
from nanovllm.worker.inputs import SEED_MASK, _to_device

_M32 = np.uint64(0xFFFFFFFF)


def build_sampling_metadata(seqs: list[Sequence], device: torch.device, eos_token_ids=(),
                            vocab_size: int | None = None, last_sampled: torch.Tensor | None = None,
                            last_row_of_seq: dict[int, int] | None = None, stage=None) -> SamplingMetadata:
    """eos_token_ids: the engine's eos ids, banned (with each request's stop_token_ids) while a
    sequence has fewer than min_tokens outputs. vocab_size, when given, drops stop ids outside
    the vocabulary instead of letting them index out of range. last_sampled / last_row_of_seq:
    the previous step's sampled tokens (on the device) and each sequence's row in them, for
    penalties over outputs whose newest token the host has not read yet (a placeholder).
    stage: a HostToDevice that moves the per-row arrays every step needs in one copy."""
    num_seqs = len(seqs)
    temps = np.empty(num_seqs, dtype=np.float32)
    seeds = np.empty(num_seqs, dtype=np.uint64)
    offsets = np.empty(num_seqs, dtype=np.int64)
    filter_rows, top_ks, top_ps = [], [], []
    min_p_rows, min_ps = [], []
    penalty_rows = []
    banned_rows, banned_ids = [], []
    max_logprobs = None
    for i, seq in enumerate(seqs):
        sp = seq.sampling_params
        num_out = seq.num_completion_tokens
        offsets[i] = num_out
        seeds[i] = seq.seed & SEED_MASK
        if sp.greedy:
            temps[i] = 0.0  # greedy rows skip the filters: they cannot change an argmax
        else:
            temps[i] = sp.temperature
            if sp.top_k > 0 or sp.top_p < 1.0:
                filter_rows.append(i)
                top_ks.append(max(sp.top_k, 0))
                top_ps.append(sp.top_p)
            if sp.min_p > 0.0:
                min_p_rows.append(i)
                min_ps.append(sp.min_p)
        if sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0 or sp.repetition_penalty != 1.0:
            penalty_rows.append(i)
        if num_out < sp.min_tokens:
            ids = set(sp.stop_token_ids) if sp.ignore_eos else set(sp.stop_token_ids) | set(eos_token_ids)
            if vocab_size is not None:
                ids = [t for t in ids if t < vocab_size]
            banned_rows.extend([i] * len(ids))
            banned_ids.extend(ids)
        if sp.logprobs is not None and (max_logprobs is None or sp.logprobs > max_logprobs):
            max_logprobs = sp.logprobs
    greedy = temps == 0.0
    seeds = seeds.view(np.int64)
    keys = host_row_keys(seeds, offsets)
    if stage is not None:
        temps_t, seeds_t, offsets_t, keys_t = stage(temps, seeds, offsets, keys)
    else:
        temps_t, seeds_t, offsets_t, keys_t = (_to_device(a, device) for a in (temps, seeds, offsets, keys))
    meta = SamplingMetadata(
        temperatures=temps_t,
        seeds=seeds_t,
        offsets=offsets_t,
        row_keys=keys_t,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        max_num_logprobs=max_logprobs,
    )
    if filter_rows:
        meta.filter_rows = _rows(filter_rows, num_seqs, device)
        if any(top_ks):
            meta.top_k = _to_device(np.asarray(top_ks, dtype=np.int64), device)
            meta.max_top_k = max(top_ks)
            meta.top_k_bounded = all(top_ks)
        meta.random_rows_filtered = len(filter_rows) == num_seqs - int(greedy.sum())
        if any(top_ks) and not (meta.top_k_bounded and meta.random_rows_filtered):
            # Rows with a top_k beside random rows without one: the sampler may split the batch.
            with_k = [row for row, k in zip(filter_rows, top_ks) if k > 0]
            others = sorted(set(range(num_seqs)) - set(with_k))
            meta.top_k_rows = _to_device(np.asarray(with_k, dtype=np.int64), device)
            meta.other_rows = _to_device(np.asarray(others, dtype=np.int64), device)
        if any(p < 1.0 for p in top_ps):
            meta.top_p = _to_device(np.asarray(top_ps, dtype=np.float32), device)
    if min_p_rows:
        meta.min_p_rows = _rows(min_p_rows, num_seqs, device)
        meta.min_p = _to_device(np.asarray(min_ps, dtype=np.float32), device)
    if penalty_rows:
        meta.penalties = _penalty_inputs([seqs[i] for i in penalty_rows], _rows(penalty_rows, num_seqs, device),
                                         device, last_sampled, last_row_of_seq)
    if banned_ids:
        meta.banned_rows = _to_device(np.asarray(banned_rows, dtype=np.int64), device)
        meta.banned_ids = _to_device(np.asarray(banned_ids, dtype=np.int64), device)
    return meta


def host_row_keys(seeds: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`nanovllm.layers.sampler.row_keys` on the host, so no small kernels run per step."""
    s = seeds.view(np.uint64)
    o = offsets.astype(np.uint64)
    with np.errstate(over="ignore"):  # the same mix as on the device, in uint64 lanes
        keys = _mix32((s & _M32) ^ _mix32(((s >> np.uint64(32)) & _M32) ^ ((o * np.uint64(0x9E3779B9)) & _M32)))
    return keys.astype(np.int64)


def _rows(rows: list[int], num_seqs: int, device: torch.device) -> torch.Tensor | None:
    """Index tensor of a stage's rows; None when that is every row, so the stage skips the gather."""
    if len(rows) == num_seqs:
        return None
    return _to_device(np.asarray(rows, dtype=np.int64), device)


def _padded(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = np.fromiter((len(t) for t in lists), dtype=np.int64, count=len(lists))
    tokens = np.zeros((len(lists), int(lens.max(initial=0))), dtype=np.int64)
    for row, ids in enumerate(lists):
        tokens[row, :len(ids)] = ids
    return _to_device(tokens, device), _to_device(lens, device)


def _penalty_inputs(seqs: list[Sequence], rows: torch.Tensor | None, device: torch.device,
                    last_sampled: torch.Tensor | None, last_row_of_seq: dict[int, int] | None) -> PenaltyInputs:
    params = [s.sampling_params for s in seqs]
    rep = np.asarray([p.repetition_penalty for p in params], dtype=np.float32)
    freq = np.asarray([p.frequency_penalty for p in params], dtype=np.float32)
    pres = np.asarray([p.presence_penalty for p in params], dtype=np.float32)
    outputs = [s.token_ids[s.num_prompt_tokens:] for s in seqs]
    # Tokens still in flight are placeholders at the end of token_ids (at most one per sequence):
    # fill them from the previous step's samples on the device, without waiting for them.
    pending = [(row, len(out) - 1, last_row_of_seq[s.seq_id]) for row, (s, out) in enumerate(zip(seqs, outputs))
               if getattr(s, "num_pending_tokens", 0)]
    for row, col, _ in pending:
        outputs[row][col] = 0
    output_tokens, output_lens = _padded(outputs, device)
    if pending:
        width = output_tokens.shape[1]
        dst = _to_device(np.asarray([r * width + c for r, c, _ in pending], dtype=np.int64), device)
        src = _to_device(np.asarray([p for _, _, p in pending], dtype=np.int64), device)
        output_tokens.view(-1).index_copy_(0, dst, last_sampled[src])
    inputs = PenaltyInputs(rows, output_tokens, output_lens, None, None, None, None, None)
    if (rep != 1.0).any():
        inputs.prompt_tokens, inputs.prompt_lens = _padded([s.token_ids[:s.num_prompt_tokens] for s in seqs], device)
        inputs.repetition = _to_device(rep, device)
    if freq.any():
        inputs.frequency = _to_device(freq, device)
    if pres.any():
        inputs.presence = _to_device(pres, device)
    return inputs
