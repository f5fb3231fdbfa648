"""Data parallelism in one server: N engine cores, each a process with its own model replica and KV
cache, behind one front end (`nanovllm serve --data-parallel-size N`).

`DataParallelEngine` offers the server what one `AsyncLLMEngine` does (capacity checks, requests,
drain and shutdown, health), over N of them: each request goes to the core that `LoadBalancer`
picks (least loaded, with prefix-cache affinity), then talks to that core alone. Placement: on a
CUDA host core i runs on the devices from cuda:{first + i * tp} on (tp: the tensor-parallel size, so
each core has tensor_parallel_size devices of its own); on the CPU the cores split the host's
cores, each process taking its share of torch threads.

A core that dies (killed, crashed, broken by repeated step failures) fails only its own requests in
flight (`AsyncLLMEngine` answers them with the reason); the others go on serving and new requests
avoid it. The server reports the cores that are down in /health and stays up while one serves.
"""
import copy
import logging
import os

import torch

from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine, RequestHandle
from nanovllm.engine.engine_core import CoreOptions
from nanovllm.engine.load_balancer import LoadBalancer
from nanovllm.engine.request_output import RequestRejected
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm.data_parallel")


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's cpuset, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_data_parallel(config: Config, size: int, uses_cpu_cores: bool = True):
    """Raise ValueError if `size` cores cannot be placed with this config (before any starts).
    uses_cpu_cores=False: the cores compute nothing on the host's CPU (a stand-in device), so the
    host's core count does not bound them."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"data_parallel_size must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    tp = config.tensor_parallel_size
    if config.device.type == "cuda":
        first = config.device.index or 0
        available = torch.cuda.device_count() - first
        if size * tp > available:
            raise ValueError(f"data_parallel_size={size} with tensor_parallel_size={tp} needs {size * tp} CUDA "
                             f"devices from cuda:{first} on, but only {available} are visible")
    else:
        if tp > 1:
            raise ValueError("on the CPU, data_parallel_size > 1 and tensor_parallel_size > 1 cannot be combined "
                             "(both split the host's cores): use one of them")
        cores = usable_cpus()
        if size > cores and uses_cpu_cores:
            raise ValueError(f"data_parallel_size={size} exceeds the {cores} CPU cores this process may use")


def core_config(config: Config, index: int, size: int) -> Config:
    """Core `index`'s config: on CUDA its own first device."""
    if size == 1 or config.device.type != "cuda":
        return config
    placed = copy.copy(config)
    placed.device = torch.device("cuda", (config.device.index or 0) + index * config.tensor_parallel_size)
    return placed


class DataParallelEngine:
    def __init__(self, config: Config, size: int = 1, max_waiting: int = 1024, listeners=None, engine_factory=None,
                 kv_events_endpoint: str | None = None, kv_events_topic: str = "", kv_events_format: str = "array",
                 separate_process: bool = True, uses_cpu_cores: bool = True):
        """listeners: one metrics listener per core (AsyncLLMEngine's `listener`), or None.
        max_waiting is per core: each queues up to max_waiting requests. engine_factory and
        separate_process: as AsyncLLMEngine's (threads: for tests). uses_cpu_cores: as
        check_data_parallel's (False for scripts/bench_frontend.py's stand-in device)."""
        check_data_parallel(config, size, uses_cpu_cores)
        self.config = config
        self.size = size
        self.max_waiting = max_waiting
        threads = max(1, usable_cpus() // size) if size > 1 and config.device.type == "cpu" else None
        self.cores = [AsyncLLMEngine(core_config(config, i, size), max_waiting,
                                     listener=listeners[i] if listeners else None, engine_factory=engine_factory,
                                     separate_process=separate_process,
                                     options=CoreOptions(i, threads, kv_events_endpoint, kv_events_topic,
                                                         kv_events_format))
                      for i in range(size)]
        self.balancer = LoadBalancer(size, slack=max(4, config.max_num_seqs // 8))
        self._forgotten: set[int] = set()  # cores found dead whose prefixes the balancer dropped

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self):
        """Start every core (their models load together) and wait for all; a core that fails to
        load stops the others and its error is raised."""
        try:
            for core in self.cores:  # from this thread, which outlives them (their parent)
                core.launch()
            for i, core in enumerate(self.cores):
                core.wait_ready()
                if core.kv_cache is not None:
                    self.balancer.set_kv_capacity(i, core.kv_cache.num_blocks * core.kv_cache.block_size)
        except BaseException:
            self.shutdown()
            raise

    def begin_shutdown(self):
        """Every core: stop taking requests and finish those in flight now (finish_reason "abort")."""
        for core in self.cores:
            core.begin_shutdown()

    def shutdown(self, timeout: float = 5.0):
        for core in self.cores:
            core.shutdown(timeout)

    # ---- state ----------------------------------------------------------------------------
    def _serving(self) -> list[AsyncLLMEngine]:
        return [core for core in self.cores if core.healthy and core.accepting]

    @property
    def healthy(self) -> bool:
        """At least one core serves."""
        return any(core.healthy for core in self.cores)

    @property
    def accepting(self) -> bool:
        return any(core.accepting for core in self.cores)

    @property
    def dead(self) -> str | None:
        """Why no core serves (None while one does)."""
        if self.healthy:
            return None
        return "; ".join(f"{core.name}: {core.dead or 'stopped'}" for core in self.cores)

    @property
    def num_in_flight(self) -> int:
        return sum(core.num_in_flight for core in self.cores)

    def core_states(self) -> list[tuple[int, str | None]]:
        return [state for core in self.cores for state in core.core_states()]

    # ---- requests (event loop) ------------------------------------------------------------
    def check_capacity(self, num_requests: int = 1):
        """As AsyncLLMEngine.check_capacity, with the waiting room of the cores that serve."""
        if num_requests > self.max_waiting:
            raise RequestRejected(f"this request holds {num_requests} prompts, more than the server queues at once "
                                  f"(the limit is {self.max_waiting}, --max-waiting): send at most "
                                  f"{self.max_waiting} per request", 400)
        serving = self._serving()
        if not serving:
            if self.healthy:
                raise RequestRejected("the server is shutting down", 503)
            raise RequestRejected(f"the engine is unavailable: {self.dead}", 503)
        waiting = sum(core.num_waiting for core in serving)
        if waiting + num_requests > self.max_waiting * len(serving):
            raise RequestRejected(f"the server is overloaded: {waiting} requests are already waiting "
                                  f"(the limit is {self.max_waiting} per engine core, {len(serving)} serving); "
                                  "retry later", 503)

    def add_request(self, token_ids: list[int], params: SamplingParams, stream: bool, out_queue=None) -> RequestHandle:
        """Submit a prompt to the core the balancer picks. Await `handle.accepted`."""
        if self.size == 1:
            return self.cores[0].add_request(token_ids, params, stream, out_queue)
        loads = []
        for i, core in enumerate(self.cores):
            serves = core.healthy and core.accepting and core.num_waiting < self.max_waiting
            loads.append(core.load if serves else None)
            if not core.healthy and i not in self._forgotten:
                self._forgotten.add(i)
                self.balancer.forget(i)
        if all(load is None for load in loads):  # full or down: the least waiting core that serves answers
            serving = self._serving() or self.cores
            return min(serving, key=lambda c: c.num_waiting).add_request(token_ids, params, stream, out_queue)
        return self.cores[self.balancer.choose(loads, token_ids)].add_request(token_ids, params, stream, out_queue)
