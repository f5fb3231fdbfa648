"""Continuous batching without separate prefill and decode phases.

Every sequence has `num_computed_tokens` that catches up with `num_tokens` under a per-step token
budget (vLLM v1's idea): one loop covers decode (one new token), chunked prefill (a slice of a long
prompt), prefix-cache hits (computed tokens adopted at admission, down to the token: the batch
carries the KV copies that the step must make first) and recompute after preemption.
Running sequences are served first, in admission order; when the KV cache runs out, the most
recently admitted sequence is preempted (blocks freed, recomputed later) and put at the head of
the waiting queue, so the oldest request always makes progress and nothing starves.
"""
import time
from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import NO_HIT, BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]         # sequences with query length 1 (decodes) come first
    num_new_tokens: list[int]    # tokens of each sequence computed this step
    num_decodes: int             # leading sequences with exactly one new token
    # (source block, destination block, tokens): KV to copy, every layer, before the step's attention
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step (and so samples the next one)."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, block_manager: BlockManager,
                 max_model_len: int | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # request_id -> first sequence of an n > 1 request whose prompt is not computed yet
        self._prompt_leaders: dict = {}

    def add(self, seq: Sequence):
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        if seq.index == 0 and seq.sampling_params.n > 1:
            self._prompt_leaders[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        self.block_manager.release_pins()  # normally done at launch (advance); this after a failed one
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and self._at_length_limit(seq):
                i += 1  # done once its last token arrives: nothing more to compute
                continue
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            # Fast path (most decodes): the tokens fit in the blocks the sequence already has.
            fits = seq.num_computed_tokens + n <= len(seq.block_table) * block_size
            while not fits and not self.block_manager.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        # Admit new work only when nothing had to be preempted: the cache is tight otherwise.
        deferred = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_shared_prompt(seq):
                deferred.append(self.waiting.popleft())
                continue
            hit = self.block_manager.lookup_prefix(seq) if seq.num_computed_tokens == 0 else NO_HIT
            n = min(seq.num_tokens - hit.num_tokens, budget)
            if not self.block_manager.allocate(seq, n, hit):
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = hit.num_tokens
                self.block_manager.record_prefix_query(seq.num_tokens, hit.num_tokens)
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        if not scheduled:
            if any(s.num_pending_tokens for s in self.running):
                return None  # waiting on the step in flight
            if self.running or self.waiting:
                raise RuntimeError("scheduler made no progress: the KV cache is too small for one sequence")
            return None
        # Decodes first: attention backends run a decode kernel on that leading slice.
        scheduled.sort(key=lambda item: item[1] != 1)
        num_decodes = sum(1 for _, n in scheduled if n == 1)
        return ScheduledBatch([s for s, _ in scheduled], [n for _, n in scheduled], num_decodes,
                              self.block_manager.take_copies())

    def _waits_for_shared_prompt(self, seq: Sequence) -> bool:
        """Siblings of an n > 1 request (index > 0) are admitted only once the first one's prompt
        blocks are published in the prefix cache (computed and their results taken in), so they
        share them instead of each computing and storing the prompt again. Others are admitted
        meanwhile. The leader's entry goes when it finishes (see finish)."""
        leader = self._prompt_leaders.get(seq.request_id)
        if leader is None or leader is seq or seq.num_computed_tokens or seq.num_preemptions:
            return False
        num_shared = seq.num_prompt_tokens - 1  # all but the last token, as lookup_prefix
        if not self.block_manager.enable_prefix_caching or num_shared == 0:
            del self._prompt_leaders[seq.request_id]
            return False
        return self.block_manager.lookup_prefix(seq).num_tokens < num_shared

    def _preempt(self, seq: Sequence):
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _at_length_limit(self, seq: Sequence) -> bool:
        return (seq.num_completion_tokens >= seq.sampling_params.max_tokens
                or (self.max_model_len is not None and seq.num_tokens >= self.max_model_len))

    def advance(self, batch: ScheduledBatch):
        """The step is launched: count its tokens as computed, so the next step can be scheduled
        before this one's results are back."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        self.block_manager.release_pins()  # the step's KV copies are queued: their sources may go

    def publish(self, batch: ScheduledBatch):
        """The step's results are in (every computed token is known): share what it completed
        (finished sequences shared everything when they were freed)."""
        for seq in batch.seqs:
            if not seq.is_finished:
                self.block_manager.publish(seq)

    def finish(self, seq: Sequence, reason: str):
        """Remove seq from the queues (finished, stopped or aborted) and release its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        self.block_manager.forget(seq)
        seq.drop_pending()
        if self._prompt_leaders.get(seq.request_id) is seq:
            del self._prompt_leaders[seq.request_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
