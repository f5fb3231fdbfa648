"""Which of a server's data-parallel engine cores serves a request: the least loaded one, unless a core
that probably holds the prompt's prefix in its KV cache is not much busier (prefix-cache affinity).

Load is a core's running and waiting completions, as the front end counts them when it submits and
when they are answered (`AsyncLLMEngine.load`: always current, with no wait for the core's stats).

Affinity without asking the cores: the balancer remembers, per core, the prompt prefixes it sent
there recently, as hashes of the prompt's first L tokens at a ladder of lengths L (every 32 tokens
up to 512, then doubling, up to 32768): ~25 hashes of one streaming pass over the prompt, however
long. A core's memory is an LRU bounded by what its KV cache holds (in tokens per rung of 32), so
what it remembers is roughly what the core can still have cached. A request goes to the core with
the longest remembered prefix when that prefix covers at least `min_match` of the prompt and the
core is not overloaded: its load exceeds the least loaded core's by no more than `slack`, or by no
more than half. Otherwise (and among equals) the least loaded core takes it, ties in turn.
"""
from array import array
from collections import OrderedDict

import xxhash

_RUNG = 32                 # tokens between the shorter prefix lengths that are hashed
_LINEAR_UP_TO = 512        # then the lengths double
_MAX_PREFIX = 1 << 15      # prefixes beyond this length are not told apart
_DEFAULT_CAPACITY = 1 << 16  # entries per core until its KV cache's size is known


def prefix_lengths(num_tokens: int) -> list[int]:
    """The prefix lengths hashed for a prompt of num_tokens tokens (the whole prompt never: its last
    token is always computed, so only a strict prefix can be a hit)."""
    lengths = list(range(_RUNG, min(num_tokens - 1, _LINEAR_UP_TO) + 1, _RUNG))
    length = _LINEAR_UP_TO * 2
    while length < num_tokens and length <= _MAX_PREFIX:
        lengths.append(length)
        length *= 2
    return lengths


def prefix_hashes(token_ids) -> list[tuple[int, int]]:
    """(length, hash of the first `length` tokens) for each length of the ladder, shortest first."""
    lengths = prefix_lengths(len(token_ids))
    if not lengths:
        return []
    data = memoryview(array("q", token_ids[:lengths[-1]]).tobytes())
    h = xxhash.xxh64()
    out, start = [], 0
    for length in lengths:
        h.update(data[start * 8:length * 8])
        out.append((length, h.intdigest()))
        start = length
    return out


class LoadBalancer:
    def __init__(self, num_cores: int, slack: int = 8, min_match: float = 0.3):
        self.num_cores = num_cores
        self.slack = slack
        self.min_match = min_match
        self.recent: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_cores)]
        self.capacity = [_DEFAULT_CAPACITY] * num_cores
        self._turn = 0  # where the search for the least loaded core starts (ties in turn)

    def set_kv_capacity(self, core: int, num_tokens: int):
        """Bound core's memory of prefixes by what its KV cache holds."""
        self.capacity[core] = max(16, num_tokens // _RUNG)

    def forget(self, core: int):
        """core stopped serving: it holds nothing any more."""
        self.recent[core].clear()

    def choose(self, loads: list[int | None], token_ids) -> int:
        """The core for a prompt; loads[i] is core i's load, None where it takes no requests (at
        least one must). The choice is remembered as holding the prompt's prefixes."""
        n = self.num_cores
        start = self._turn
        least = None
        for k in range(n):  # the least loaded, the first one from this turn's start among equals
            i = (start + k) % n
            if loads[i] is not None and (least is None or loads[i] < loads[least]):
                least = i
        self._turn = (start + 1) % n
        if n == 1:
            return least
        hashes = prefix_hashes(token_ids)
        choice = least
        if hashes:
            best, best_len = self._longest_prefix(loads, hashes)
            if best is not None and best_len >= self.min_match * len(token_ids) and best != least:
                excess = loads[best] - loads[least]
                if excess <= self.slack or loads[best] <= 1.5 * loads[least]:
                    choice = best
        self._remember(choice, hashes)
        return choice

    def _longest_prefix(self, loads, hashes) -> tuple[int | None, int]:
        """The serving core that remembers the longest of these prefixes (the least loaded among
        equals), and that prefix's length."""
        best, best_len = None, 0
        for core, recent in enumerate(self.recent):
            if loads[core] is None or not recent:
                continue
            matched = 0
            for length, h in hashes:
                if h not in recent:
                    break
                matched = length
            if matched > best_len or (matched == best_len and matched and loads[core] < loads[best]):
                best, best_len = core, matched
        return best, best_len

    def _remember(self, core: int, hashes):
        recent = self.recent[core]
        # Longest first, so that the shorter prefixes, which more prompts share, are evicted last.
        for _, h in reversed(hashes):
            recent[h] = None
            recent.move_to_end(h)
        while len(recent) > self.capacity[core]:
            recent.popitem(last=False)
