"""The host's grammar work of a step (xgrammar's batched mask fill and token accept) spread over
threads kept for the engine's life.

xgrammar's own multi-threaded fill (`BatchGrammarMatcher(max_threads > 1)`) starts and joins a fresh
pool of threads at every call: 0.15-0.8 ms per call before any work is done (measured on 2 cores;
its "auto" size is half the host's hardware threads, which on a large host is many more than a
container's share), while a row's fill is 5-15 us. Its calls, and numpy's copies, release the GIL,
so plain Python threads run them in parallel: `map` cuts a batch into contiguous slices, one per
thread, the caller's thread taking the first. Batches too small to repay a hand-off stay on the
caller's thread.
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
        self.num_threads = num_threads or default_num_threads()
        self._pool = (ThreadPoolExecutor(self.num_threads - 1, thread_name_prefix="nanovllm-grammar")
                      if self.num_threads > 1 else None)

    def map(self, work, n: int) -> list:
        """[work(lo, hi) for contiguous slices (lo, hi) covering range(n)], in order, the slices
        run in parallel."""
        k = max(1, min(self.num_threads, n // MIN_ROWS_PER_THREAD))
        if k == 1:
            return [work(0, n)]
        bounds = [n * j // k for j in range(k + 1)]
        futures = [self._pool.submit(work, bounds[j], bounds[j + 1]) for j in range(1, k)]
        return [work(0, bounds[1])] + [f.result() for f in futures]
