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
from concurrent.futures import ThreadPoolExecutor

MIN_ROWS_PER_THREAD = 16  # a slice's hand-off (~20-50 us) against its rows' work (5-15 us each)


def default_num_threads() -> int:
    """One: on the H200's host (16 cores, 2026-12-02, `bench.py --structured host`) 8 threads cost more
    than one at every batch size from 8 rows (at 256 rows 5.74 ms against 3.31 per step: the fill
    gains 0.8 ms, the accepts lose 3.3 ms to contention). More threads are an option of
    StructuredOutputs(num_threads=...) for hosts where they pay."""
    return 1


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
