"""An asyncio front end for the engine, for a server.

The engine runs in `EngineCore` (engine/engine_core.py), a message pump that owns the LLMEngine,
either in a process of its own (the default) or on a background thread of this one. In its own
process the engine's host work per step (scheduling, input building, output processing) never waits
for the interpreter lock while the HTTP side encodes hundreds of streams: on the H200 at 256
concurrent streams, a thread's step took ~16 ms against ~6 ms offline (BENCHMARKS.md).

Callers talk to the core through a thread-safe command queue (add, abort, abort all, stop); a
writer forwards commands to the process's pipe, a reader takes the core's event lists and hands
them to the requesters' event loops, one wake-up per loop and read (`call_soon_threadsafe`). In the
engine process (engine_process.py) a sender thread writes the events, so the engine never waits for a
server that is busy encoding streams; the passes that queue up meanwhile go out as one message
with one output per request.
Requests answer through asyncio futures (`accepted`) and queues (outputs).
"""
import asyncio
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
import uuid

from nanovllm.config import Config
from nanovllm.engine.engine_core import CoreOptions, EngineCore
from nanovllm.engine.engine_process import engine_process_main
from nanovllm.engine.request_output import CompletionOutput, EngineStats, RequestOutput, RequestRejected
from nanovllm.sampling_params import SamplingParams

__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineStats", "RequestHandle", "RequestOutput", "RequestRejected"]

logger = logging.getLogger("nanovllm.async_engine")


class RequestHandle:
    """The caller's side of one engine request. `accepted` resolves to the prompt's token count once
    the engine has validated and queued it (or raises RequestRejected); outputs then arrive on
    `queue` (a queue may be shared by the several requests of one HTTP request)."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, out_queue: asyncio.Queue, stream: bool,
                 num_seqs: int = 1):
        self.engine = engine
        self.request_id = request_id
        self.num_seqs = num_seqs  # its completions (n): what it weighs in the engine's load
        self.loop = asyncio.get_running_loop()
        self.accepted: asyncio.Future = self.loop.create_future()
        self.queue = out_queue
        self.stream = stream
        self.finished = False
        self.arrival_time = time.perf_counter()

    def abort(self):
        """Stop generating and free the request's KV blocks (a no-op once it has finished)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLMEngine:
    def __init__(self, config: Config, max_waiting: int = 1024, listener=None, engine_factory=None,
                 separate_process: bool = True, options: CoreOptions | None = None):
        """listener: optional object with `record(events, received)` (server metrics), called off the
        event loop with each dispatch's events for metrics, in order: the core's "stats", "tokens",
        "first_tokens", "token_gaps" and "finished" events (engine_core.py), whatever kinds it adds,
        and ("dead", reason) once the core stops serving unasked; received: when this process got
        them (`time.perf_counter()`), the end of a TTFT and of a request's latency as vLLM times them.
        engine_factory: builds the LLMEngine from the config (default LLMEngine; picklable when
        separate_process). separate_process=False runs the core on a thread of this process.
        options: the core's index among a server's cores, its CPU threads, KV events (CoreOptions)."""
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        self.config = config
        self.max_waiting = max_waiting
        self.listener = listener
        self.separate_process = separate_process
        self.options = options or CoreOptions()
        self.name = f"engine core {self.options.index}"
        self.kv_cache = None  # the core's KVCacheInfo, once it is ready
        self._engine_factory = engine_factory
        self.stats = EngineStats()
        self.accepting = False
        self.dead: str | None = None  # why the engine stopped serving, if it broke
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # reentrant: safe from signal handlers
        self._handles: dict[str, RequestHandle] = {}  # requests the core may still answer
        # Requests on their way to the core: sent - lost - stats.num_requests_received, where
        # both counts of the core's side come from the same snapshot as its num_waiting.
        self._num_sent = 0       # "add" commands queued (event loop side)
        self._num_lost = 0       # of them, never delivered (writer thread side)
        self._seqs_sent = 0      # completions of the requests submitted (event loop side)
        self._seqs_done = 0      # of them, answered for good (dispatching thread side)
        self._core: EngineCore | None = None  # thread mode only
        self._workers: list[threading.Thread] = []
        self._process = None
        self._conn = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None

    # ---- lifecycle (caller's thread) ------------------------------------------------------
    def start(self):
        """Start the engine (process or thread) and wait until the model is loaded; re-raises a
        load error."""
        self.launch()
        self.wait_ready()

    def launch(self):
        """Start the engine without waiting for it (so that several load their models together)."""
        if self.separate_process:
            ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
            self._conn, child = ctx.Pipe()
            self._process = ctx.Process(target=engine_process_main, name=f"nanovllm-engine-{self.options.index}",
                                        args=(child, self.config, self._engine_factory, logging.getLogger().level,
                                              self.options))
            self._process.start()
            child.close()
            self._workers = [threading.Thread(target=self._read_events, name="nanovllm-engine-reader", daemon=True),
                             threading.Thread(target=self._write_commands, name="nanovllm-engine-writer",
                                              daemon=True)]
        else:
            self._core = EngineCore(self.config, self._commands, self._dispatch, self._engine_factory, self.options)
            self._workers = [threading.Thread(target=self._core.run, name="nanovllm-engine", daemon=True)]
        for worker in self._workers:
            worker.start()

    def wait_ready(self):
        """Wait until the launched engine has loaded its model; re-raises a load error."""
        self._ready.wait()
        if self._startup_error is not None:
            self._stop_workers(timeout=5.0)
            raise self._startup_error
        self.accepting = True

    def begin_shutdown(self):
        """Stop taking requests and finish the ones in flight now, with what they generated so far
        and finish_reason "abort". Safe to call from a signal handler."""
        self.accepting = False
        self._commands.put(("abort_all", None))

    def shutdown(self, timeout: float = 5.0):
        """Abort everything, stop the engine and release it."""
        if not self._workers:
            return
        self.accepting = False
        self._stop_workers(timeout)

    def _stop_workers(self, timeout: float):
        self._commands.put(("stop", None))
        deadline = time.monotonic() + timeout
        if self._process is not None:
            self._process.join(timeout)
            if self._process.is_alive():
                logger.warning("the engine process did not stop within %.1fs: killing it", timeout)
                self._process.kill()  # it ignores SIGTERM (see engine_process.engine_process_main)
                self._process.join()
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            if worker.is_alive():
                logger.warning("%s did not stop within %.1fs (it is a daemon thread)", worker.name, timeout)
        if self._conn is not None:
            self._conn.close()
        self._workers, self._process, self._conn = [], None, None

    @property
    def healthy(self) -> bool:
        """Whether the core serves. Asked several times per request: it makes no system call. The
        first worker is the core's thread, or in process mode the reader, which ends once the
        process's pipe closes (a Process.is_alive() waitpid lets go of the interpreter lock, and
        the event loop then waited for the reader thread to hand it back: ~0.2 ms per request)."""
        if self.dead is not None or not self._workers:
            return False
        return self._workers[0].is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests submitted that the engine has not finished answering."""
        return len(self._handles)

    @property
    def load(self) -> int:
        """Completions submitted and not yet answered: the core's running and waiting sequences,
        and those on their way to it, counted here as they are submitted (for a load balancer)."""
        return self._seqs_sent - self._seqs_done

    def core_states(self) -> list[tuple[int, str | None]]:
        """(index, None while it serves, else why not) of each engine core: here, one."""
        if self.healthy:
            return [(self.options.index, None)]
        return [(self.options.index, self.dead or "stopped")]

    @property
    def engine(self):
        """The LLMEngine, when it runs on a thread of this process (tests reach into it)."""
        return self._core.engine if self._core is not None else None

    # ---- requests (event loop) ------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests waiting for a batch slot: queued in the engine, or on their way to it."""
        stats = self.stats  # one snapshot: its counts agree with each other
        return stats.num_waiting + max(0, self._num_sent - self._num_lost - stats.num_requests_received)

    def check_capacity(self, num_requests: int = 1):
        """Raise RequestRejected: 400 when num_requests together could never be queued (more
        than max_waiting), 503 when the engine cannot take them right now."""
        if num_requests > self.max_waiting:
            raise RequestRejected(f"this request holds {num_requests} prompts, more than the server queues at once "
                                  f"(the limit is {self.max_waiting}, --max-waiting): send at most "
                                  f"{self.max_waiting} per request", 400)
        if self.dead is not None:
            raise RequestRejected(f"the engine is unavailable: {self.dead}", 503)
        if not self.accepting:
            raise RequestRejected("the server is shutting down", 503)
        waiting = self.num_waiting
        if waiting + num_requests > self.max_waiting:
            raise RequestRejected(f"the server is overloaded: {waiting} requests are already waiting "
                                  f"(the limit is {self.max_waiting}); retry later", 503)

    def add_request(self, token_ids: list[int], params: SamplingParams, stream: bool,
                    out_queue: asyncio.Queue | None = None) -> RequestHandle:
        """Submit a prompt (token ids; validated by the engine). Await `handle.accepted`."""
        out_queue = out_queue if out_queue is not None else asyncio.Queue()
        handle = RequestHandle(self, uuid.uuid4().hex, out_queue, stream, params.n)
        if not self.healthy:  # nobody would answer
            handle.accepted.set_exception(RequestRejected(f"the engine is unavailable: {self.dead or 'stopped'}", 503))
            return handle
        self._num_sent += 1
        self._seqs_sent += handle.num_seqs
        self._handles[handle.request_id] = handle
        self._commands.put(("add", handle.request_id, token_ids, params, stream, handle.arrival_time))
        return handle

    def abort(self, request_id: str):
        """Thread-safe and non-blocking; the engine frees the request's blocks."""
        self._commands.put(("abort", request_id))

    # ---- events from the core (engine thread, or the reader thread) ------------------------
    def _dispatch(self, events: list, received: float | None = None):
        """Apply one pass's events: statistics and metrics at once, deliveries to the event loops
        after them (one wake-up per loop), so a delivered acceptance is already counted. received:
        when the reader got them (default: now)."""
        by_loop: dict = {}
        for_listener = []
        for event in events:
            kind = event[0]
            if kind == "stats":
                self.stats = event[1]  # one assignment: readers always see a consistent snapshot
                for_listener.append(event)
            elif kind in ("accept", "reject", "output"):
                handle = self._handles.get(event[1])
                if handle is None:
                    continue
                if kind == "reject":
                    self._answered(event[1])
                    value = RequestRejected(event[2], event[3])
                elif kind == "output":
                    value = event[2]
                    if value.finished:
                        self._answered(event[1])
                else:
                    value = event[2]
                by_loop.setdefault(handle.loop, []).append((handle, kind, value))
            elif kind == "aborted":
                self._answered(event[1])
            elif kind == "dead":
                if self.dead is None:
                    logger.error("%s stopped serving: %s", self.name, event[1])
                self.dead = event[1]
                self.accepting = False
                for_listener.append(event)
            elif kind == "ready":
                self.kv_cache = event[1]
                self._ready.set()
            elif kind == "startup_error":
                self._startup_error = event[1]
                self._ready.set()
            else:  # for metrics: "tokens", "ttft", "token_gaps", "finished", ...
                for_listener.append(event)
        if for_listener and self.listener is not None:
            self.listener.record(for_listener, time.perf_counter() if received is None else received)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

    def _answered(self, request_id: str):
        """The core owes request_id nothing more."""
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self._seqs_done += handle.num_seqs

    def _read_events(self):
        """Reader thread (process mode): the core's event lists, until the process goes away. Lists
        that queued up in the pipe while this thread waited for the interpreter lock are taken in
        one dispatch, so the reader keeps pace with the core however busy the event loop is."""
        conn = self._conn
        closed = False
        while not closed:
            try:
                events = conn.recv()
            except (EOFError, OSError):
                break
            received = time.perf_counter()
            try:
                while conn.poll():
                    events += conn.recv()
            except (EOFError, OSError):  # what came before the end is still delivered
                closed = True
            self._dispatch(events, received)
        if not self._ready.is_set():
            self._startup_error = RuntimeError("the engine process exited while loading the model")
            self._ready.set()
        if self.dead is None and self.accepting:  # not a shutdown we asked for
            self._fail_orphans(f"{self.name}'s process exited unexpectedly ({self._exit_status()})")

    def _exit_status(self) -> str:
        process = self._process
        if process is None:
            return "no process"
        process.join(2.0)  # its pipe closes as it exits, a moment before it can be reaped
        code = process.exitcode
        if code is None:
            return f"pid {process.pid}, still running"
        if code < 0:
            try:
                return f"pid {process.pid}, killed by signal {signal.Signals(-code).name}"
            except ValueError:
                return f"pid {process.pid}, killed by signal {-code}"
        return f"pid {process.pid}, exit code {code}"

    def _write_commands(self):
        """Writer thread (process mode): commands from any thread, in order, onto the pipe."""
        while True:
            command = self._commands.get()
            try:
                self._conn.send(command)
            except (OSError, ValueError, pickle.PicklingError) as e:
                if command[0] == "add":
                    self._num_lost += 1
                    self._dispatch([("reject", command[1], f"the request could not be sent to the engine: {e}", 500)])
                if isinstance(e, OSError):
                    return
            if command[0] == "stop":
                return

    def _fail_orphans(self, reason: str):
        """The engine died: answer every request it still owed an answer."""
        logger.error("%s stopped serving: %s; failing its %d requests in flight", self.name, reason,
                     len(self._handles))
        self.dead = reason
        self.accepting = False
        events = [("dead", reason)]
        for request_id, handle in list(self._handles.items()):
            if handle.accepted.done():
                events.append(("output", request_id, RequestOutput(request_id, finished=True,
                                                                   error=RequestRejected(reason, 500))))
            else:
                events.append(("reject", request_id, reason, 503))
        self._dispatch(events)


def _deliver(items):
    """Runs on the event loop."""
    for handle, kind, value in items:
        if kind == "output":
            if value.finished:
                handle.finished = True
            handle.queue.put_nowait(value)
        elif handle.accepted.done():
            continue  # the waiter was cancelled
        elif kind == "accept":
            handle.accepted.set_result(value)
        else:
            handle.finished = True
            handle.accepted.set_exception(value)
