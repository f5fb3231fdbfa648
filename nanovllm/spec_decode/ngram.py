"""Prompt lookup (n-gram) drafts: where the sequence's last n tokens occurred before, propose the
tokens that followed them (vLLM's rule: the longest n in [prompt_lookup_min, prompt_lookup_max],
its earliest occurrence). Free to compute and right wherever the answer copies from the prompt
(code edits, quoting, extraction, a conversation's earlier turns)."""
import numpy as np

from nanovllm.worker.sampling_inputs import settled_tokens


def ngram_lookup(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to k tokens that followed the earliest earlier occurrence of tokens' longest suffix
    of min_n..max_n tokens (a view of tokens; empty when there is none). The longest suffix first,
    each one byte-substring search of the history in C (numpy took several calls per n, each
    dearer than the whole scan). The shortest goes first: every occurrence of a longer suffix
    holds one of it, so a history without it (most steps of most sequences) costs one scan."""
    total = len(tokens)
    if total <= min_n or k <= 0:
        return tokens[:0]
    history = tokens.tobytes()  # one copy: the suffixes are slices of it, not copies of their own
    width = tokens.itemsize
    before_last = (total - 1) * width  # an occurrence ends before the last token

    def earliest(n: int) -> int:  # the first token of the earliest occurrence of the n-token suffix, or -1
        suffix = history[-n * width:]
        at = history.find(suffix, 0, before_last)
        while at > 0 and at % width:  # a match across token boundaries is none: look further
            at = history.find(suffix, at + 1, before_last)
        return at // width if at >= 0 else -1

    shortest = earliest(min_n)
    if shortest < 0:
        return tokens[:0]
    for n in range(min(max_n, total - 1), min_n, -1):
        at = earliest(n)
        if at >= 0:
            return tokens[at + n:at + n + k]
    return tokens[shortest + min_n:shortest + min_n + k]


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def likely(self, seq) -> bool:
        """Whether seq's known tokens (all but one still being computed) end with an n-gram seen
        before: a cheap forecast of a draft once the newest token is known."""
        return ngram_lookup(settled_tokens(seq), self.min_n, self.max_n, 1).size > 0

    def propose(self, seqs, caps: list[int], block_manager=None) -> list[list[int]]:
        """Up to caps[i] draft tokens for each of seqs (whose tokens are all known)."""
        return [ngram_lookup(settled_tokens(seq), self.min_n, self.max_n, cap).tolist() for seq, cap in zip(seqs, caps)]

    def release(self, seq):
        pass

    def shutdown(self):
        pass
