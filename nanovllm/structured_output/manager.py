"""The engine's side of structured outputs: one object, `StructuredOutputs`, that the loop calls the
same way whether or not any request is constrained (each call returns at once when none is).

- `check(params)`: compile the request's constraint (cached), raising ValueError before it is queued.
- `attach(seqs)` / `release(seq)`: a grammar matcher per sequence (n > 1: one each), for its life.
- `needs_masks(seqs)`: whether a step's sampling must wait for masks (see `LLMEngine.step`).
- `advance(seqs, tokens)`: feed each sequence the token the step drew (xgrammar's batched accept).
- `fill_masks(seqs, rows, masks)`: the next token's bitmasks, only for the rows that need one, into
  the runner's pinned buffer (xgrammar's batched fill); rows[i] says which mask row i uses, -1 for
  none.
Both run in slices on threads kept for the engine's life (`threads.py`) once a batch is large enough.

With a reasoning parser, a sequence's grammar waits until the thinking is over (`Phase`): rows that
are still thinking get no mask, and the first token of an output that may or may not think is drawn
from the grammar's tokens plus the opening tag. A grammar that has accepted a stop token allows only
stop tokens (seen with ignore_eos or under min_tokens: the grammar wins); under min_tokens the stop
tokens are taken out of a row's mask unless nothing else is left.
"""
import threading
from enum import IntEnum

import numpy as np

from nanovllm.logger import init_logger
from nanovllm.reasoning import PromptState, reasoning_parser

logger = init_logger(__name__)


class Phase(IntEnum):
    REASONING = 0   # thinking: no mask until the closing tag
    UNDECIDED = 1   # first token: the grammar's, or the opening tag (then REASONING)
    ACTIVE = 2      # every token follows the grammar
    TERMINATED = 3  # the grammar accepted a stop token: only stop tokens from here on


class GrammarState:
    __slots__ = ("matcher", "phase")

    def __init__(self, matcher, phase: Phase):
        self.matcher = matcher
        self.phase = phase

    @property
    def bans_stop_tokens(self) -> bool:
        """Whether the mask, not the sampler's min_tokens bans, keeps stop tokens out (see module)."""
        return self.phase != Phase.REASONING


def _bits(ids, words: int) -> np.ndarray:
    """[words] uint32 with the bits of ids set."""
    row = np.zeros(words, dtype=np.uint32)
    for i in ids:
        row[i >> 5] |= np.uint32(1 << (i & 31))
    return row


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, reasoning_parser_name: str | None = None,
                 num_threads: int | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.stop_token_ids = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)
        # Validated now, so that a server started with a parser its model cannot use fails at start-up.
        self.reasoning = reasoning_parser(reasoning_parser_name, tokenizer) if reasoning_parser_name else None
        self.num_live = 0  # sequences holding a grammar: none, and every call returns at once
        self._compiler = None
        self._num_threads = num_threads  # None: threads.default_num_threads()
        self._threads = None
        self._xgr_batch = threading.local()
        self._narrow = None  # the grammar's masks, where they are narrower than the runner's (see _fill)
        self._clear_buffers: set[int] = set()  # the runner's buffers whose words beyond the grammar's are clear
        self._stop_row = _bits(self.stop_token_ids, self.words)

    @property
    def compiler(self):
        if self._compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer, and this model has none")
            from nanovllm.structured_output.compiler import GrammarCompiler
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._compiler

    @property
    def _stop_words_beyond(self) -> list[int]:
        """The words of the mask holding stop tokens beyond the grammar's vocabulary."""
        return sorted({t >> 5 for t in self.stop_token_ids if t >> 5 >= self.compiler.words})

    @property
    def threads(self):
        if self._threads is None:
            from nanovllm.structured_output.threads import GrammarThreads
            self._threads = GrammarThreads(self._num_threads)
        return self._threads

    # ---- requests ---------------------------------------------------------------------------
    def check(self, params) -> None:
        """Compile params.structured_outputs (if any) now: a ValueError names what is wrong."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def attach(self, seqs) -> None:
        params = seqs[0].sampling_params.structured_outputs
        if params is None:
            return
        import xgrammar as xgr
        compiled = self.compiler.compile(params)
        phase = Phase.ACTIVE
        if self.reasoning is not None:
            state = self.reasoning.prompt_state(seqs[0].prompt_token_ids)
            phase = {PromptState.INSIDE: Phase.REASONING, PromptState.OPEN: Phase.UNDECIDED}.get(state, Phase.ACTIVE)
        for seq in seqs:
            # The stop tokens xgrammar knows: those of the tokenizer's (an eos beyond it only ends a finished grammar).
            matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.compiler.stop_token_ids)
            seq.grammar = GrammarState(matcher, phase)
        self.num_live += len(seqs)

    def release(self, seq) -> None:
        if seq.grammar is not None:
            seq.grammar = None
            self.num_live -= 1

    # ---- steps ------------------------------------------------------------------------------
    def needs_masks(self, seqs) -> bool:
        if not self.num_live:
            return False
        return any(seq.grammar is not None for seq in seqs)

    def advance(self, seqs, tokens) -> list:
        """Feed each live grammar its sequence's new token; returns the sequences whose grammar
        rejected it (never, as long as the masks were applied: the engine ends them)."""
        if not self.num_live:
            return []
        matchers, accepted_tokens, states, owners = [], [], [], []
        reasoning = self.reasoning
        for seq, token in zip(seqs, tokens):
            g = seq.grammar
            if g is None or seq.is_finished:
                continue
            if g.phase == Phase.REASONING:
                if token == reasoning.end_token_id:
                    g.phase = Phase.ACTIVE
                continue
            if g.phase == Phase.UNDECIDED:
                if token == reasoning.start_token_id:
                    g.phase = Phase.REASONING
                    continue
                g.phase = Phase.ACTIVE
            if g.phase == Phase.ACTIVE:
                matchers.append(g.matcher)
                accepted_tokens.append(token)
                states.append(g)
                owners.append(seq)
        if not matchers:
            return []
        accept = self._batch().batch_accept_token  # a static method: no state shared by the threads
        results = [ok for part in self.threads.map(lambda lo, hi: accept(matchers[lo:hi], accepted_tokens[lo:hi]),
                                                   len(matchers)) for ok in part]
        rejected = []
        stops = self.stop_token_ids
        for ok, g, token, seq in zip(results, states, accepted_tokens, owners):
            if not ok:
                logger.error("sequence %s: its grammar rejected token %d; ending it", seq.seq_id, token)
                rejected.append(seq)
            elif token in stops and g.matcher.is_terminated():
                g.phase = Phase.TERMINATED
        return rejected

    def fill_masks(self, seqs, rows: np.ndarray, masks) -> int:
        """Bitmasks for the token each of seqs draws next: masks[k] (a [max_rows, words] int32 CPU
        tensor, pinned on a GPU) for the k-th row that needs one, rows[i] = k or -1. Returns how
        many masks were filled."""
        rows[:len(seqs)] = -1
        if not self.num_live:
            return 0
        num, fill_matchers, fill_rows, terminated, adjust = 0, [], [], [], []
        for i, seq in enumerate(seqs):
            g = seq.grammar
            if g is None or g.phase == Phase.REASONING or seq.is_finished:
                continue
            rows[i] = num
            if g.phase == Phase.TERMINATED:
                terminated.append(num)
            else:
                fill_matchers.append(g.matcher)
                fill_rows.append(num)
            sp = seq.sampling_params
            if g.phase == Phase.UNDECIDED or seq.num_completion_tokens - seq.num_pending_tokens < sp.min_tokens:
                adjust.append((num, g, seq))
            num += 1
        bits = masks.numpy().view(np.uint32)
        if fill_matchers:
            self._fill(fill_matchers, fill_rows, masks, bits, num)
        if terminated:
            bits[terminated] = self._stop_row
        for k, g, seq in adjust:
            row = bits[k]
            if g.phase == Phase.UNDECIDED:
                start = self.reasoning.start_token_id
                row[start >> 5] |= np.uint32(1 << (start & 31))
            if seq.num_completion_tokens - seq.num_pending_tokens < seq.sampling_params.min_tokens:
                stops = self._stop_row | _bits(seq.sampling_params.stop_token_ids, self.words)
                kept = row & ~stops
                if kept.any():
                    row[:] = kept
        return num

    def _batch(self):
        """This thread's single-threaded BatchGrammarMatcher (no pool per call: threads.py)."""
        batch = getattr(self._xgr_batch, "matcher", None)
        if batch is None:
            import xgrammar as xgr
            batch = self._xgr_batch.matcher = xgr.BatchGrammarMatcher(1)
        return batch

    def _fill(self, matchers, fill_rows, masks, bits, num):
        """xgrammar's masks of matchers into masks[fill_rows], in slices on threads. Where the
        grammar's vocabulary (the tokenizer's) is narrower than the model's, xgrammar fills masks of
        its own width, copied into the first words of the rows; the bits beyond (its last word's
        high bits included, which xgrammar leaves set) are never allowed. The words beyond are
        cleared once per buffer: after that only a finished grammar's row writes there (the words
        of the stop tokens beyond the tokenizer), and those words are cleared at every fill."""
        def fill(*args):  # on the slice's own thread: its own matcher
            self._batch().batch_fill_next_token_bitmask(*args)
        words, vocab = self.compiler.words, self.compiler.vocab_size
        if words == self.words:
            self.threads.map(lambda lo, hi: fill(matchers[lo:hi], masks, fill_rows[lo:hi]), len(matchers))
            return
        if self._narrow is None or self._narrow.shape[0] < num:
            import torch
            self._narrow = torch.zeros(masks.shape[0], words, dtype=torch.int32)
        narrow, narrow_bits = self._narrow, self._narrow.numpy().view(np.uint32)
        if masks.data_ptr() not in self._clear_buffers:  # once per buffer (the runner's are few, and kept)
            bits[:, words:] = 0
            self._clear_buffers.add(masks.data_ptr())
        tail = np.uint32((1 << vocab % 32) - 1) if vocab % 32 else None
        dirty = self._stop_words_beyond
        count = len(matchers)

        def fill_slice(lo, hi):
            fill(matchers[lo:hi], narrow, fill_rows[lo:hi])
            first, end = (fill_rows[lo] if lo else 0), (fill_rows[hi] if hi < count else num)  # slices tile [0, num)
            bits[first:end, :words] = narrow_bits[first:end]
            if dirty:
                bits[first:end, dirty] = 0
            if tail is not None:
                bits[first:end, words - 1] &= tail
        self.threads.map(fill_slice, count)
