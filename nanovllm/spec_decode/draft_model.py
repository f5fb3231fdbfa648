"""Draft-model proposals: a smaller model with the target's vocabulary drafts k tokens per sequence,
one forward pass per token, before the target verifies them in one.

The draft runs on its own `ModelRunner` (the first device; its own CUDA graphs) with its own KV
cache of as many blocks as the target's, addressed through the target's block tables: the draft's
KV of a sequence's position p sits in the same block and slot as the target's, so the block
manager, preemption and the prefix cache need nothing of their own for it. What the draft has
computed of each sequence is kept here: a sequence's first proposal computes its whole context
(the prefix cache shares the target's KV, not necessarily the draft's), later ones only what was
accepted since; after a preemption it starts over.

The drafts are drawn with the target's sampling noise for their positions (the same seed and
output position, temperature or greedy): the coupling that makes a draft agree with the target's
own draw as often as their distributions allow, without bearing on exactness (speculator.py).
"""
import copy
from typing import NamedTuple

import numpy as np
import torch

from nanovllm.distributed import single_device
from nanovllm.layers.sampling_metadata import SamplingMetadata
from nanovllm.sampling_params import GREEDY_BELOW
from nanovllm.worker.inputs import SEED_MASK, HostInputs
from nanovllm.worker.sampling_inputs import host_row_keys


def draft_runner_config(config, num_blocks: int):
    """The draft model's Config: the target's, on its first device, with the draft's weights and a
    cache of num_blocks blocks; CUDA graphs for the batch sizes that speculate."""
    spec = config.speculative_config
    draft = copy.copy(config)
    draft.model, draft.hf_config = spec.model, spec.draft_hf_config
    draft.tensor_parallel_size = 1
    draft.speculative_config = None
    draft.num_kvcache_blocks = num_blocks
    draft.kv_cache_memory_bytes = None
    draft.max_num_seqs = min(config.max_num_seqs, spec.disable_by_batch_size)
    from nanovllm.layers.quantization import resolve_quantization  # the draft's weights as its checkpoint has them
    draft.quant_config = resolve_quantization(config.quantization, spec.draft_hf_config, config.load_format)
    return draft


class DraftModelProposer:
    def __init__(self, config, target_runner):
        from nanovllm.worker.model_runner import ModelRunner
        self.k = config.speculative_config.num_speculative_tokens
        self.max_tokens = config.max_num_batched_tokens
        with single_device():  # the draft is not split, whatever the target's tensor parallelism
            self.runner = ModelRunner(draft_runner_config(config, target_runner.num_blocks))
        self.device = self.runner.device
        self.block_size = config.kvcache_block_size
        # seq_id -> (tokens the draft had computed, the drafts written after them, preemptions then)
        self._state: dict[int, tuple[int, list[int], int]] = {}

    def likely(self, seq) -> bool:
        return True  # a draft model always drafts

    # ---- what the draft has computed ------------------------------------------------------------
    def _computed(self, seq) -> int:
        """Leading tokens of seq whose KV in the draft's cache is seq's own: what it computed last
        time, and the drafts written then that the target has accepted since."""
        state = self._state.get(seq.seq_id)
        if state is None or state[2] != seq.num_preemptions:
            return 0
        known, drafts, _ = state
        written = drafts[:-1]  # the last draft was never an input
        accepted = 0
        for token, draft in zip(seq.token_ids[known:known + len(written)], written):
            if token != draft:
                break
            accepted += 1
        return min(known + accepted, seq.num_computed_tokens)

    # ---- proposing ------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs, caps: list[int], block_manager) -> list[list[int]]:
        """Up to caps[i] drafts for each of seqs (every token known, all but the last computed by
        the target). The drafts' KV needs room in the sequence's blocks: where the cache has none
        left, that sequence gets no drafts."""
        chosen, chosen_caps = [], []
        for seq, cap in zip(seqs, caps):
            if block_manager.allocate(seq, cap):  # positions up to the last draft's input
                chosen.append(seq)
                chosen_caps.append(cap)
        out = {}
        if chosen:
            with single_device():
                drafts = self._draft(chosen, chosen_caps)
            for seq, draft in zip(chosen, drafts):
                out[seq.seq_id] = draft
                self._state[seq.seq_id] = (seq.num_tokens, draft, seq.num_preemptions)
        return [out.get(seq.seq_id, []) for seq in seqs]

    def _draft(self, seqs, caps: list[int]) -> list[list[int]]:
        # Step 0 draws the first drafts; step j (j >= 1) feeds the sequences that take more than j
        # their previous draft (read on the device) at position num_tokens + j - 1.
        draws = self._catch_up(seqs)
        rows = list(range(len(seqs)))  # rows[r]: the sequence of row r of draws
        steps = [(draws, rows)]
        for j in range(1, max(caps)):
            row_of = {i: r for r, i in enumerate(rows)}
            live = [i for i in rows if caps[i] > j]
            spans = [_Span(seqs[i], seqs[i].num_tokens + j - 1, None, row_of[i]) for i in live]
            logits = self.runner.forward(_host_inputs(spans, self.block_size), last_sampled=draws)
            draws, rows = self._sample(logits, [seqs[i] for i in live], j), live
            steps.append((draws, rows))
        drafts = [[] for _ in seqs]
        for values, (_, step_rows) in zip(_to_host([t for t, _ in steps]), steps):
            for r, i in enumerate(step_rows):
                drafts[i].append(int(values[r]))
        return drafts

    def _catch_up(self, seqs) -> torch.Tensor:
        """The draft's forward over what it has not computed of each sequence, up to its last token,
        in passes of at most the token budget: returns each sequence's draw after its last token
        ([len(seqs)] on the device)."""
        starts = [self._computed(seq) for seq in seqs]
        drawn = [None] * len(seqs)
        while True:
            batch, budget = [], self.max_tokens
            for i, seq in enumerate(seqs):
                n = min(seq.num_tokens - starts[i], budget)
                if n > 0:
                    batch.append((i, n))
                    budget -= n
            if not batch:
                break
            batch.sort(key=lambda item: item[1] != 1)  # decodes first
            spans = [_Span(seqs[i], starts[i], seqs[i].token_ids[starts[i]:starts[i] + n], -1,
                           starts[i] + n == seqs[i].num_tokens) for i, n in batch]
            logits = self.runner.forward(_host_inputs(spans, self.block_size))
            ending = [i for (i, _), span in zip(batch, spans) if span.samples]
            if ending:
                tokens = self._sample(logits, [seqs[i] for i in ending], 0)
                for r, i in enumerate(ending):
                    drawn[i] = tokens[r:r + 1]
            for i, n in batch:
                starts[i] += n
        return torch.cat(drawn)

    def _sample(self, logits: torch.Tensor, seqs, ahead: int) -> torch.Tensor:
        """The draft's draw for each of seqs at its output position num_completion_tokens + ahead:
        the target's temperature (greedy where the target is greedy) and noise."""
        n = len(seqs)
        temps = np.fromiter((s.sampling_params.temperature for s in seqs), np.float32, n)
        temps[temps < GREEDY_BELOW] = 0.0
        seeds = np.fromiter((s.seed & SEED_MASK for s in seqs), np.uint64, n).view(np.int64)
        offsets = np.fromiter((s.num_completion_tokens + ahead for s in seqs), np.int64, n)
        temps_t, seeds_t, offsets_t, keys_t = self.runner.stage(temps, seeds, offsets, host_row_keys(seeds, offsets))
        greedy = temps == 0.0
        meta = SamplingMetadata(temperatures=temps_t, seeds=seeds_t, offsets=offsets_t, row_keys=keys_t,
                                all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()))
        return self.runner.sampler.sample(logits, meta).token_ids

    # ---- lifecycle ------------------------------------------------------------------------------
    def release(self, seq):
        self._state.pop(seq.seq_id, None)

    def shutdown(self):
        runner, self.runner = self.runner, None
        if runner is not None:
            with single_device():
                runner.shutdown()


class _Span(NamedTuple):
    """Tokens of one sequence in a draft forward pass: ids from position start on, or (ids None)
    one token, the previous pass's draw at row src; samples: the pass draws after its last token."""
    seq: object
    start: int
    ids: list[int] | None
    src: int = -1
    samples: bool = True


def _to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The steps' draws on the host, in one copy (one wait for the device)."""
    flat = torch.cat(tensors).cpu().numpy()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.shape[0]])
        start += t.shape[0]
    return out


def _host_inputs(spans: list[_Span], block_size: int) -> HostInputs:
    """One draft forward pass's inputs (`worker.inputs.HostInputs`), the one-token spans first."""
    n = len(spans)
    lens = np.fromiter((1 if s.ids is None else len(s.ids) for s in spans), np.int64, n)
    starts = np.fromiter((s.start for s in spans), np.int64, n)
    nd = int(np.argmax(lens != 1)) if (lens != 1).any() else n
    ids = np.concatenate([np.zeros(1, np.int64) if s.ids is None else np.asarray(s.ids, np.int64) for s in spans])
    positions = np.concatenate([np.arange(a, a + m) for a, m in zip(starts.tolist(), lens.tolist())])
    seq_lens = starts + lens
    width = max(len(s.seq.block_table) for s in spans)
    tables = np.zeros((n, width), dtype=np.int32)
    for i, s in enumerate(spans):
        tables[i, :len(s.seq.block_table)] = s.seq.block_table
    seq_of_token = np.repeat(np.arange(n), lens)
    slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    query_start = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(lens, out=query_start[1:])
    sample_rows = [i for i, s in enumerate(spans) if s.samples]
    pending = [i for i, s in enumerate(spans) if s.ids is None]
    return HostInputs(
        input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=query_start,
        seq_lens=seq_lens.astype(np.int32), block_tables=tables, num_decodes=nd,
        logits_indices=query_start[1:][sample_rows].astype(np.int64) - 1, sample_rows=sample_rows,
        pending_dst=np.asarray(query_start[pending], dtype=np.int64) if pending else None,
        pending_src=np.asarray([spans[i].src for i in pending], dtype=np.int64) if pending else None,
        decode_order=np.argsort(-seq_lens[:nd], kind="stable").astype(np.int32) if nd else None)
