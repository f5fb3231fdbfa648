"""xgrammar's batched mask fill and token accept, spread over threads kept for the engine's life.

xgrammar's own multi-threaded fill (`BatchGrammarMatcher(max_threads > 1)`) starts and joins a fresh
pool of threads at every call: 0.15-0.8 ms per call before any work is done (measured on 2 cores;
its "auto" size is half the host's hardware threads, which on a large host is many more than a
container's share), while a row's fill is 5-15 us. Its calls release the GIL, so plain Python
threads run them in parallel: a batch is cut into interleaved slices (row j goes to slice j % k,
which evens out rows of unequal cost), each slice goes through a single-threaded
`BatchGrammarMatcher` on its own thread, the caller's thread taking the first. Batches too small to
repay a hand-off stay on the caller's thread.
"""
import os
from concurrent.futures import ThreadPoolExecutor

MIN_ROWS_PER_THREAD = 16  # a slice's hand-off (~20-50 us) against its rows' work (5-15 us each)


def default_num_threads() -> int:
    """Half the cores this process may run on (xgrammar's own rule, but of the cores it is allowed),
    at most 8: the engine's loop and the device's feeder keep theirs."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


class GrammarThreads:
    def __init__(self, num_threads: int | None = None):
        import xgrammar as xgr
        self.num_threads = num_threads or default_num_threads()
        self._batch = [xgr.BatchGrammarMatcher(1) for _ in range(self.num_threads)]  # one thread each: no pool
        self._accept = xgr.BatchGrammarMatcher.batch_accept_token
        self._pool = (ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="nanovllm-grammar")
                      if self.num_threads > 1 else None)

    def _slices(self, n: int) -> int:
        return max(1, min(self.num_threads, n // MIN_ROWS_PER_THREAD))

    def fill(self, matchers: list, masks, rows: list[int]) -> None:
        """masks[rows[i]] = the next-token bitmask of matchers[i] (masks: a [N, words] int32 CPU tensor)."""
        k = self._slices(len(matchers))
        if k == 1:
            self._batch[0].batch_fill_next_token_bitmask(matchers, masks, rows)
            return
        futures = [self._pool.submit(self._batch[j].batch_fill_next_token_bitmask, matchers[j::k], masks, rows[j::k])
                   for j in range(1, k)]
        self._batch[0].batch_fill_next_token_bitmask(matchers[::k], masks, rows[::k])
        for f in futures:
            f.result()

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        """Feed matchers[i] tokens[i]; whether each accepted it."""
        k = self._slices(len(matchers))
        if k == 1:
            return self._accept(matchers, tokens)
        futures = [self._pool.submit(self._accept, matchers[j::k], tokens[j::k]) for j in range(1, k)]
        accepted = [False] * len(matchers)
        accepted[::k] = self._accept(matchers[::k], tokens[::k])
        for j, f in enumerate(futures, 1):
            accepted[j::k] = f.result()
        return accepted
