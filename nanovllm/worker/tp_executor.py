"""Tensor parallelism over torch.distributed: rank 0 in the calling process, ranks 1..N-1 in
spawned worker processes (worker/tp_worker.py), each holding a shard of the model and of the
KV cache.

Each step rank 0 builds the step's `HostInputs` once, pickles those few numpy arrays once, and
writes the bytes down one Pipe per worker; then every rank runs the forward, meeting in the
all-reduces (gloo on the CPU, NCCL on CUDA). Only rank 0 samples; a decode input that the
previous step drew and the host has not read yet reaches the other ranks through a broadcast on
the devices (`ModelRunner._pending_tokens`), so on a GPU steps overlap as they do on one device.
The engine sees the same interface as a `ModelRunner`: `num_blocks`, `execute(batch) ->
StepOutput` (returning at once), `shutdown()`.

Failure handling, so that nothing hangs and nothing is left behind:
- a worker that raises reports its traceback and exits at once; one that is killed just exits.
  Rank 0 checks liveness before each step and, while waiting, either gets an error from gloo
  (the peer's socket closed) or, on CUDA, polls a step's completion (when its tokens are read)
  together with the workers' liveness. Either way `execute` (or
  the step output's `token_ids()`) raises RuntimeError naming the rank, and every worker is
  stopped; the executor is unusable afterwards. An exception in rank 0 itself also stops the
  workers (they are stuck mid-step) and propagates.
- collectives time out (NANOVLLM_TP_TIMEOUT_S, default 300 s) on a peer that is alive but stuck.
- `shutdown()` stops the workers: a stop message, a few seconds' grace, then SIGTERM and
  SIGKILL. So does a finalizer if the executor is dropped or the interpreter exits without
  it. Workers also exit on their own when rank 0's process dies.
"""
import atexit
import contextlib
import os
import pickle
import socket
import threading
import time
import weakref
from multiprocessing import connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanovllm import distributed
from nanovllm.config import Config, torch_threads
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.worker.model_runner import ModelRunner
from nanovllm.worker.step_output import StepOutput
from nanovllm.worker.tp_worker import STOP, rank_device, worker_main

_STOP_GRACE_S = 5.0     # how long a stopping worker may take before it is terminated
_FAILURE_GRACE_S = 2.0  # how long to wait for a failing worker's report once a collective broke
_LIVENESS_PERIOD_S = 0.05


class _Group:
    """What must be undone at the end, kept apart from the executor so that its finalizer does
    not keep the executor alive."""

    def __init__(self):
        self.procs: list = []
        self.conns: list = []
        self.in_process_group = False  # rank 0 joined the torch.distributed group
        self.saved_threads: int | None = None  # rank 0's torch thread count before we took a share
        self.release_graphs = None  # rank 0's ModelRunner.release_graphs, once it exists
        self.torn_down = False


class TensorParallelExecutor:
    def __init__(self, config: Config, eos_token_ids: frozenset[int] = frozenset()):
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed process group (another "
                               "tensor-parallel LLM?): shut that one down before starting another; one whose "
                               "worker died on a GPU cannot be released (NCCL waits on the dead peer): use a new process")
        self.config = config
        self.size = config.tensor_parallel_size
        self.timeout_s = float(os.environ.get("NANOVLLM_TP_TIMEOUT_S", "300"))
        config.device = rank_device(config.device, 0)
        self.device = config.device
        self.cuda = self.device.type == "cuda"
        self.runner: ModelRunner | None = None
        self._failure: str | None = None  # set once the group is stopped: no further steps
        self._group = _Group()
        if self.cuda:
            # NVLink multicast (NVLS / symmetric memory) is kept off on the machines we run on.
            os.environ["NCCL_NVLS_ENABLE"] = "0"
            os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
            # A dead peer must become an exception here, not NCCL's watchdog tearing down the
            # caller's process: we watch the workers ourselves.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        else:
            # The ranks share the host's cores: like each worker, rank 0 takes its share only, or
            # the spinning threads of one rank starve another that a collective waits for.
            self._group.saved_threads = torch.get_num_threads()
            torch.set_num_threads(torch_threads(config))
        self._finalizer = weakref.finalize(self, _teardown, self._group)
        # Also an explicit atexit hook: registered after multiprocessing's own, it runs first,
        # before multiprocessing waits for its children at exit.
        atexit.register(self._finalizer)
        try:
            self._start(config, eos_token_ids)
        except BaseException as exc:
            self._fail(exc)
        # Between steps the process-wide TP state reads "no tensor parallelism", so that a
        # single-device LLM in the same process is unaffected; `execute` sets it per step.
        distributed.set_tensor_parallel(0, 1)

    def _start(self, config: Config, eos_token_ids: frozenset[int]):
        port = _free_port()
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, config, port, self.timeout_s, child_end),
                               name=f"nanovllm-tp-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self._group.procs.append(proc)
            self._group.conns.append(parent_end)
        # Join the group only once every worker is up: a worker failing at import would
        # otherwise leave rank 0 waiting in the rendezvous until the timeout.
        self._expect("hello")
        distributed.init_process_group(0, self.size, port, self.device, self.timeout_s)
        self._group.in_process_group = True
        with self._abort_nccl_if_a_worker_dies():
            self.runner = ModelRunner(config, 0, eos_token_ids)  # agrees on num_blocks with the workers
            self._group.release_graphs = self.runner.release_graphs
            blocks = self._expect("ready")
        if any(b != self.runner.num_blocks for b in blocks):
            raise RuntimeError(f"ranks disagree on the number of KV-cache blocks: {[self.runner.num_blocks, *blocks]}")
        self.num_blocks = self.runner.num_blocks

    @contextlib.contextmanager
    def _abort_nccl_if_a_worker_dies(self):
        """While rank 0 builds its shard, NCCL collectives of the memory-profiling warm-up and
        the CUDA-graph capture could wait forever on a worker that died (gloo, on the CPU, fails
        by itself). A watcher thread aborts NCCL then, which fails the waiting call here."""
        if not self.cuda:
            yield
            return
        finished = threading.Event()
        sentinels = [proc.sentinel for proc in self._group.procs]

        def watch():
            while not finished.is_set():
                if connection.wait(sentinels, timeout=_LIVENESS_PERIOD_S):
                    distributed.destroy_process_group(abort=True)
                    return

        watcher = threading.Thread(target=watch, name="nanovllm-tp-startup-watch", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            finished.set()
            watcher.join()

    def _expect(self, kind: str) -> list:
        """Each worker's next message, which must be `kind`; raise if a worker fails first."""
        payloads = []
        for rank, (proc, conn) in enumerate(zip(self._group.procs, self._group.conns), start=1):
            deadline = time.monotonic() + self.timeout_s
            while not conn.poll():  # (also true at EOF, when the worker is gone)
                if not proc.is_alive() and not conn.poll():
                    raise _WorkerFailure(rank, self._reason(rank))
                if time.monotonic() > deadline:
                    raise _WorkerFailure(rank, f"sent no {kind!r} within {self.timeout_s:.0f} s")
                connection.wait([conn, proc.sentinel], timeout=_LIVENESS_PERIOD_S)
            try:
                msg_kind, payload = conn.recv()
            except (EOFError, OSError):
                raise _WorkerFailure(rank, self._reason(rank)) from None
            if msg_kind != kind:
                reason = f"raised:\n{payload}" if msg_kind == "error" else f"sent {msg_kind!r}, not {kind!r}"
                raise _WorkerFailure(rank, reason)
            payloads.append(payload)
        return payloads

    # ---- one step ------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, defer_sampling: bool = False) -> StepOutput:
        """Launch one step on every rank and return at once, as a ModelRunner does; waiting for
        its tokens also watches the workers. A deferred draw (`sample`) is rank 0's alone."""
        self._check_workers()
        # Decode inputs that the step in flight samples are resolved on the devices (rank 0's
        # runner broadcasts its last tokens), by the rows of rank 0's samples.
        host = self.runner.host_inputs(batch)
        seqs = [batch.seqs[i] for i in host.sample_rows]
        blob = pickle.dumps(host, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._group.conns:
                conn.send_bytes(blob)
            distributed.set_tensor_parallel(0, self.size)
            try:
                output = self.runner.run(host, seqs, defer_sampling)
            finally:
                distributed.set_tensor_parallel(0, 1)
        except BaseException as exc:
            self._fail(exc)
        if self.cuda:
            output.wait_for = self._wait_for_device
        return output

    def sample(self, output: StepOutput, fill_masks):
        """A deferred step's draw (ModelRunner.sample): on rank 0, after the forward all ranks ran."""
        try:
            self.runner.sample(output, fill_masks)
        except BaseException as exc:
            self._fail(exc)

    def _wait_for_device(self, done: torch.cuda.Event):
        """Wait for a step's event while watching the workers: if a peer died, the NCCL kernels
        on our stream would wait for it forever. Raises like `execute` when one did."""
        try:
            self._poll(done)
        except BaseException as exc:
            self._fail(exc)

    def _poll(self, done: torch.cuda.Event):
        start = next_check = time.monotonic()
        while not done.query():
            now = time.monotonic()
            if now >= next_check:
                self._check_workers()
                if now - start > self.timeout_s:
                    raise RuntimeError(f"a tensor-parallel step took over {self.timeout_s:.0f} s")
                next_check = now + _LIVENESS_PERIOD_S
            time.sleep(0)

    def _check_workers(self):
        if self._failure is not None:
            remedy = ("NCCL cannot release this group, and GPU work of this process stays blocked behind its "
                      "kernels until the process exits: continue in a new process"
                      if self._group.in_process_group else "create a new LLM")
            if self._group.in_process_group and distributed.one_shot_all_reduce_on():
                # Measured on two H200s: the interpreter's exit then hangs below Python; _exit ends it.
                remedy += (" (with the one-shot all-reduce on, this process cannot finish a normal exit either: "
                           "end it with os._exit or a signal)")
            raise RuntimeError(f"the tensor-parallel group is shut down ({self._failure}); {remedy}")
        for rank, (proc, conn) in enumerate(zip(self._group.procs, self._group.conns), start=1):
            # Between steps a worker sends nothing but an error report (or EOF, when it is gone).
            if not proc.is_alive() or conn.poll():
                self._fail(_WorkerFailure(rank, self._reason(rank)))

    # ---- failure ---------------------------------------------------------------------------
    def _fail(self, exc: BaseException):
        """Stop the whole group after any rank failed, and raise: a RuntimeError naming the
        worker that failed, if one did, else rank 0's own exception."""
        if self._failure is not None:  # already handled (raised from within _fail)
            raise exc
        failure = exc if isinstance(exc, _WorkerFailure) else None
        if failure is None and isinstance(exc, Exception):
            # A collective broke or a pipe closed: find the worker behind it. (Not for
            # KeyboardInterrupt and the like: those are rank 0's own, and urgent.)
            failure = self._find_failed_worker(_FAILURE_GRACE_S)
        self._failure = failure.summary() if failure is not None else f"rank 0 failed: {exc!r}"
        self._stop(graceful=False)
        if failure is None:
            raise exc
        raise RuntimeError(str(failure)) from (None if exc is failure else exc)

    def _find_failed_worker(self, grace_s: float):
        deadline = time.monotonic() + grace_s
        procs, conns = self._group.procs, self._group.conns
        while True:
            for rank, (proc, conn) in enumerate(zip(procs, conns), start=1):
                if not proc.is_alive() or conn.poll():
                    return _WorkerFailure(rank, self._reason(rank))
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            connection.wait([p.sentinel for p in procs] + conns, timeout=min(remaining, _LIVENESS_PERIOD_S))

    def _reason(self, rank: int) -> str:
        """What is known about a failed worker: its error report, else how it ended."""
        proc, conn = self._group.procs[rank - 1], self._group.conns[rank - 1]
        try:
            while conn.poll():
                kind, payload = conn.recv()
                if kind == "error":
                    return f"raised:\n{payload}"
        except (EOFError, OSError):
            pass
        proc.join(_FAILURE_GRACE_S)
        code = proc.exitcode
        if code is None:
            return "stopped responding"
        return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"

    # ---- lifecycle ---------------------------------------------------------------------------
    def _stop(self, graceful: bool):
        self._finalizer.detach()
        atexit.unregister(self._finalizer)
        # After a failure on CUDA, rank 0's NCCL kernels may wait on the dead peer forever. Aborting
        # the communicator does not help: with NCCL 2.28 (torch 2.11) ncclCommAbort never returned
        # after a peer was SIGKILLed mid-collective, and the thread it was left in made the
        # interpreter's exit abort (SIGABRT); destroying the group waits on those kernels too, and
        # so did other work on rank 0's GPU, even on a stream of its own (tests/gpu). So the
        # communicator and rank 0's memory (freeing it would synchronize the device) are left to the
        # process's exit, which the driver's context teardown completes.
        _teardown(self._group, graceful=graceful, leave_group=graceful or not self.cuda)
        if self.runner is not None and (graceful or not self.cuda):
            self.runner.shutdown()

    def shutdown(self):
        if self._failure is None:
            self._failure = "shut down"
            self._stop(graceful=True)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [proc.pid for proc in self._group.procs]

    def __getattr__(self, name):
        # Anything else (block_bytes, backend, num_kv_heads, ...) is rank 0's runner's.
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)


class _WorkerFailure(Exception):
    def __init__(self, rank: int, reason: str):
        super().__init__(f"tensor-parallel worker rank {rank} {reason}")
        self.rank = rank

    def summary(self) -> str:
        """One line: the first, plus the exception's own line of a traceback."""
        lines = str(self).strip().splitlines()
        return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _teardown(group: _Group, graceful: bool = True, leave_group: bool = True):
    """Stop every worker process, leave the process group (unless `leave_group` is False: see
    `_stop`) and give rank 0 its threads back."""
    if group.torn_down:  # e.g. at exit, then again from LLM.__del__
        return
    group.torn_down = True
    release_graphs, group.release_graphs = group.release_graphs, None
    if graceful:
        # Every rank frees its CUDA graphs before leaving the group (ModelRunner.release_graphs
        # says why); rank 0 first, so that no worker's exit waits on it.
        if release_graphs is not None and leave_group:
            try:
                release_graphs()
            except Exception:  # a device error: do not wait on the group's collectives either
                leave_group = False
        for conn in group.conns:
            try:
                conn.send_bytes(STOP)
            except OSError:
                pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for proc in group.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in group.procs:
        if proc.is_alive():
            proc.terminate()
    for proc in group.procs:
        proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in group.conns:
        conn.close()
    if group.in_process_group and leave_group:
        group.in_process_group = False
        distributed.disable_one_shot_all_reduce()
        try:
            distributed.destroy_process_group()
        except Exception:
            pass
    distributed.set_tensor_parallel(0, 1)
    if group.saved_threads is not None:
        torch.set_num_threads(group.saved_threads)
        group.saved_threads = None
