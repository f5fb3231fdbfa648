"""An asyncio front end for the synchronous LLMEngine, for a server.

The engine is not thread-safe, so it lives on ONE background thread that builds it and makes every
call on it. Other threads talk to that thread through a thread-safe command queue (add, abort,
abort all, stop); it answers through asyncio futures and queues, scheduled onto the requester's
event loop with `call_soon_threadsafe`. The thread blocks on the command queue while there is
nothing to run (no busy-waiting) and otherwise alternates: take in commands (new requests join the
running batch at the next step), run one step, push every request's new output to its consumer.
"""
import asyncio
import logging
import queue
import threading
import time
import uuid
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request_output import CompletionOutput, EngineStats, RequestOutput, RequestRejected
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger("nanovllm.async_engine")

__all__ = ["AsyncLLMEngine", "CompletionOutput", "EngineStats", "RequestHandle", "RequestOutput", "RequestRejected"]

_MAX_CONSECUTIVE_STEP_ERRORS = 3  # after this many failed steps in a row the engine counts as broken


class RequestHandle:
    """The caller's side of one engine request. `accepted` resolves to the prompt's token count once
    the engine has validated and queued it (or raises RequestRejected); outputs then arrive on
    `queue` (a queue may be shared by the several requests of one HTTP request)."""

    def __init__(self, engine: "AsyncLLMEngine", request_id: str, out_queue: asyncio.Queue, stream: bool):
        self.engine = engine
        self.request_id = request_id
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


class _Tracked:
    """The engine thread's record of a request it is serving."""
    __slots__ = ("handle", "seqs", "sent", "sent_logprobs", "done")

    def __init__(self, handle: RequestHandle, seqs: list[Sequence]):
        self.handle = handle
        self.seqs = seqs
        self.sent = [0] * len(seqs)           # completion tokens already counted/pushed, per sequence
        self.sent_logprobs = [0] * len(seqs)  # logprob entries already pushed, per sequence
        self.done = [False] * len(seqs)


class AsyncLLMEngine:
    def __init__(self, config: Config, max_waiting: int = 1024, listener=None, engine_factory=None):
        """listener: optional object with `request_added(num_prompt_tokens)`, `tokens_generated(n)`
        and `sequence_finished(seq, now)`, called on the engine thread (server metrics)."""
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise ValueError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        self.config = config
        self.max_waiting = max_waiting
        self.listener = listener
        self._engine_factory = engine_factory
        self.engine = None  # built on, and only touched by, the engine thread
        self.stats = EngineStats()
        self.accepting = False
        self.dead: str | None = None  # why the engine thread stopped serving, if it broke
        self._commands: queue.SimpleQueue = queue.SimpleQueue()  # reentrant: safe from signal handlers
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: list = []  # deliveries gathered during one pass of the loop
        self._num_unacked = 0    # requests submitted but not yet taken in (touched on the event loop only)
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._consecutive_errors = 0
        self._timing = [0, 0.0, 0.0]  # steps, seconds in engine.step(), seconds in _collect()

    # ---- lifecycle (caller's thread) ------------------------------------------------------
    def start(self):
        """Start the engine thread and wait until the model is loaded; re-raises a load error."""
        self._thread = threading.Thread(target=self._thread_main, name="nanovllm-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error
        self.accepting = True

    def begin_shutdown(self, reason: str = "the server is shutting down"):
        """Stop taking requests and fail the ones in flight. Safe to call from a signal handler."""
        self.accepting = False
        self._commands.put(("abort_all", reason))

    def shutdown(self, timeout: float = 5.0):
        """Abort everything, stop the engine thread and release the engine."""
        if self._thread is None:
            return
        self.accepting = False
        self._commands.put(("stop", None))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.1fs (it is a daemon thread)", timeout)
        self._thread = None

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._thread is not None and self._thread.is_alive()

    # ---- requests (event loop) ------------------------------------------------------------
    def check_capacity(self, num_requests: int = 1):
        """Raise RequestRejected(503) when the engine cannot take num_requests more right now."""
        if self.dead is not None:
            raise RequestRejected(f"the engine is unavailable: {self.dead}", 503)
        if not self.accepting:
            raise RequestRejected("the server is shutting down", 503)
        waiting = self.stats.num_waiting + self._num_unacked
        if waiting + num_requests > self.max_waiting:
            raise RequestRejected(f"the server is overloaded: {waiting} requests are already waiting "
                                  f"(the limit is {self.max_waiting}); retry later", 503)

    def add_request(self, token_ids: list[int], params: SamplingParams, stream: bool,
                    out_queue: asyncio.Queue | None = None) -> RequestHandle:
        """Submit a prompt (token ids; validated on the engine thread). Await `handle.accepted`."""
        out_queue = out_queue if out_queue is not None else asyncio.Queue()
        handle = RequestHandle(self, uuid.uuid4().hex, out_queue, stream)
        if not self.healthy:  # nobody would answer
            handle.accepted.set_exception(RequestRejected(f"the engine is unavailable: {self.dead or 'stopped'}", 503))
            return handle
        self._num_unacked += 1
        handle.accepted.add_done_callback(self._acked)
        self._commands.put(("add", (handle, token_ids, params)))
        return handle

    def _acked(self, _future):
        self._num_unacked -= 1

    def abort(self, request_id: str):
        """Thread-safe and non-blocking; the engine thread frees the request's blocks."""
        self._commands.put(("abort", request_id))

    # ---- the engine thread ----------------------------------------------------------------
    def _thread_main(self):
        try:
            self.engine = (self._engine_factory or LLMEngine)(self.config)
        except BaseException as e:  # reported by start()
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # a bug here must not leave clients hanging
            logger.exception("the engine loop crashed")
            self.dead = f"the engine loop crashed: {type(e).__name__}: {e}"
            self._fail_all(self.dead, 500)
            self._flush()
        finally:
            self._reject_leftover_commands()
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _reject_leftover_commands(self):
        """Requests that arrived while the thread was stopping: answer them, don't leave them hanging."""
        reason = self.dead or "the server is shutting down"
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._send(arg[0], "reject", RequestRejected(reason, 503))
        self._flush()

    def _loop(self):
        engine = self.engine
        while True:
            # Block only when there is nothing to compute: new commands are the only thing to do.
            commands = [self._commands.get()] if not engine.has_unfinished() else []
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            stop = self._apply(commands)
            # Publish before delivering acceptances, so check_capacity never misses a new request.
            self._publish_stats()
            self._flush()
            if stop:
                self._fail_all("the server is shutting down", 503)
                self._flush()
                return
            if engine.has_unfinished():
                self._step()
                self._publish_stats()
                self._flush()
                if self.dead is not None:
                    return

    def _apply(self, commands) -> bool:
        stop = False
        for kind, arg in commands:
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "abort_all":
                self._fail_all(arg, 503)
            elif kind == "stop":
                stop = True
        return stop

    def _add(self, handle: RequestHandle, token_ids, params: SamplingParams):
        if handle.finished:  # aborted before it was taken in
            self._send(handle, "reject", RequestRejected("the request was cancelled", 499))
            return
        try:
            ids = self.engine.tokenize(token_ids)
            seqs = self.engine.add_request(handle.request_id, ids, params)
        except (ValueError, TypeError) as e:
            self._send(handle, "reject", RequestRejected(str(e), 400))
            return
        except Exception as e:
            logger.exception("adding request %s failed", handle.request_id)
            self._send(handle, "reject", RequestRejected(f"internal error: {type(e).__name__}: {e}", 500))
            return
        for seq in seqs:
            seq.arrival_time = handle.arrival_time  # count time in the command queue too
            if handle.stream:
                self.engine.output_processor.watch(seq)  # before its first token
        self._tracked[handle.request_id] = _Tracked(handle, seqs)
        if self.listener is not None:
            self.listener.request_added(len(ids))
        self._send(handle, "accept", len(ids))

    def _abort(self, request_id: str):
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return  # finished already, or never taken in
        self.engine.abort_request(request_id)
        self._count_finished(tracked)

    def _fail_all(self, message: str, status: int):
        for request_id in list(self._tracked):
            self._fail(request_id, message, status)

    def _fail(self, request_id: str, message: str, status: int):
        tracked = self._tracked.pop(request_id)
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)
        self._count_finished(tracked)
        self._send(tracked.handle, "put", RequestOutput(request_id, finished=True,
                                                        error=RequestRejected(message, status)))

    def _step(self):
        start = time.perf_counter()
        try:
            self.engine.step()
        except Exception as e:
            self._on_step_error(e)
            return
        stepped = time.perf_counter()
        self._consecutive_errors = 0
        self._collect()
        timing = self._timing
        timing[0] += 1
        timing[1] += stepped - start
        timing[2] += time.perf_counter() - stepped

    def _on_step_error(self, error: Exception):
        """Fail the requests the step was running (they may be in an inconsistent state), keep the
        rest. If steps keep failing, the engine itself is broken: fail everything and stop."""
        logger.error("engine step failed", exc_info=error)
        self._consecutive_errors += 1
        message = f"internal error during generation: {type(error).__name__}: {error}"
        running = {seq.request_id for seq in self.engine.scheduler.running}
        victims = [rid for rid in self._tracked if rid in running] or list(self._tracked)
        for request_id in victims:
            self._fail(request_id, message, 500)
        if self._consecutive_errors >= _MAX_CONSECUTIVE_STEP_ERRORS:
            self.dead = f"{self._consecutive_errors} engine steps failed in a row; last: {message}"
            self.accepting = False
            self._fail_all(self.dead, 500)

    def _collect(self):
        """Push each request's new tokens/text, and its final output once all its sequences are done."""
        processor = self.engine.output_processor
        listener = self.listener
        now = time.perf_counter()
        for request_id, t in list(self._tracked.items()):
            deltas = []
            for i, seq in enumerate(t.seqs):
                if t.done[i]:
                    continue
                # Tokens of a step still in flight (GPU overlap) are placeholders: not yet known.
                known = seq.num_completion_tokens - seq.num_pending_tokens
                start = seq.num_prompt_tokens
                new_ids = seq.token_ids[start + t.sent[i]:start + known]
                t.sent[i] = known
                finished = seq.is_finished
                if listener is not None and new_ids:
                    listener.tokens_generated(len(new_ids))
                if finished:
                    t.done[i] = True
                    if listener is not None:
                        listener.sequence_finished(seq, now)
                if t.handle.stream and (new_ids or finished):
                    deltas.append(self._delta(t, i, seq, new_ids, processor.take_delta(seq)))
            all_done = all(t.done)
            if all_done:
                del self._tracked[request_id]
                if not t.handle.stream:
                    deltas = [self._final(seq, processor) for seq in t.seqs]
            if deltas or all_done:
                first = t.seqs[0]
                self._send(t.handle, "put", RequestOutput(request_id, deltas, all_done, first.num_prompt_tokens,
                                                          first.num_cached_tokens))

    def _delta(self, t: _Tracked, i: int, seq: Sequence, new_ids: list[int], text: str) -> CompletionOutput:
        logprobs = None
        if seq.logprobs is not None:
            logprobs = seq.logprobs[t.sent_logprobs[i]:]
            t.sent_logprobs[i] = len(seq.logprobs)
        return CompletionOutput(seq.index, text, new_ids, logprobs, seq.finish_reason, seq.stop_reason,
                                t.sent[i])

    @staticmethod
    def _final(seq: Sequence, processor) -> CompletionOutput:
        ids = seq.completion_token_ids
        logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        return CompletionOutput(seq.index, processor.text(seq), ids, logprobs, seq.finish_reason,
                                seq.stop_reason, len(ids))

    def _count_finished(self, t: _Tracked):
        """Metrics for a request removed before it finished (aborted or failed)."""
        if self.listener is None:
            return
        now = time.perf_counter()
        for i, seq in enumerate(t.seqs):
            if not t.done[i]:
                known = max(seq.num_completion_tokens - seq.num_pending_tokens, 0)
                if known > t.sent[i]:
                    self.listener.tokens_generated(known - t.sent[i])
                self.listener.sequence_finished(seq, now)

    def _publish_stats(self):
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        running = {seq.request_id for seq in sched.running}
        waiting = {seq.request_id for seq in sched.waiting} - running
        # One attribute assignment: readers on other threads always see a consistent snapshot.
        self.stats = EngineStats(len(running), len(waiting), bm.usage, bm.prefix_queries, bm.prefix_hits,
                                 sched.num_preemptions, *self._timing)

    # ---- delivery to event loops ----------------------------------------------------------
    def _send(self, handle: RequestHandle, kind: str, value):
        self._outbox.append((handle, kind, value))

    def _flush(self):
        """Hand this pass's outputs to their event loops: one wake-up per loop, not per request."""
        if not self._outbox:
            return
        by_loop: dict = {}
        for item in self._outbox:
            by_loop.setdefault(item[0].loop, []).append(item)
        self._outbox = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass


def _deliver(items):
    """Runs on the event loop."""
    for handle, kind, value in items:
        if kind == "put":
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
