"""The serving loop around the synchronous LLMEngine, as a message pump.

`EngineCore` owns the engine and talks only in messages: it takes commands from an inbox
(``("add", request_id, token_ids, params, stream, arrival_time)``, ``("abort", request_id)``,
``("abort_all", None)``: finish every request now, finish_reason "abort", ``("stop", None)``) and
hands out, once per pass of its loop, one list of events (``emit``):

    ("ready", KVCacheInfo) | ("startup_error", exception)     once, first
    ("stats", EngineStats)                                    before the deliveries of a pass
    ("accept", request_id, num_prompt_tokens) | ("reject", request_id, message, status)
    ("output", request_id, RequestOutput)                     new tokens/text, or the final output
    ("aborted", request_id)                                   an abort was carried out
    ("tokens", prompt_tokens, generated_tokens)               for metrics: prompts whose first token
                                                              came, and tokens generated, this pass
    ("first_tokens", [arrival_time, ...])                     for metrics: the sequences whose first token
                                                              this pass emits (the front end times TTFT
                                                              at their receipt, as vLLM does)
    ("token_gaps", [(seconds, n), ...])                       n tokens each came `seconds` after the
                                                              previous token of their sequence
    ("finished", FinishedSequence)                            a completion ended (metrics)
    ("dead", reason)                                          the engine broke: nothing more comes

So the same loop runs on a thread of the server process or in a process of its own
(`nanovllm.engine.async_engine` chooses), with every message picklable. The loop blocks on the
inbox while there is nothing to run and otherwise alternates: take in all pending commands (new
requests join the running batch at the next step), run one step, emit what it produced.

With a KV-events endpoint (`CoreOptions`), the core also publishes its prefix cache's changes after
each pass (engine/kv_events.py); without one nothing of that runs.
"""
import logging
import queue
import time
from dataclasses import dataclass
from typing import NamedTuple

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request_output import (CompletionOutput, EngineStats, FinishedSequence, RequestOutput,
                                            RequestRejected)
from nanovllm.engine.sequence import Sequence

logger = logging.getLogger("nanovllm.engine_core")

_MAX_CONSECUTIVE_STEP_ERRORS = 3  # after this many failed steps in a row the engine counts as broken


@dataclass(frozen=True)
class CoreOptions:
    """What a server sets per engine core beyond its Config."""
    index: int = 0                    # the core's rank among the server's data-parallel cores
    cpu_threads: int | None = None    # torch threads of its process (CPU: its share of the host's cores)
    kv_events_endpoint: str | None = None  # publish KV-cache events there (ZMQ, vLLM's format)
    kv_events_topic: str = ""
    kv_events_format: str = "array"  # how the events are encoded (engine/kv_events.py)


class KVCacheInfo(NamedTuple):
    """What the core's "ready" event says of its KV cache."""
    num_blocks: int
    block_size: int


class _Tracked:
    """The core's record of a request it is serving."""
    __slots__ = ("seqs", "stream", "sent", "sent_logprobs", "done", "last_token_time", "prefilled")

    def __init__(self, seqs: list[Sequence], stream: bool):
        self.seqs = seqs
        self.stream = stream
        self.sent = [0] * len(seqs)           # completion tokens already counted/pushed, per sequence
        self.sent_logprobs = [0] * len(seqs)  # logprob entries already pushed, per sequence
        self.done = [False] * len(seqs)
        self.last_token_time = [0.0] * len(seqs)  # when each sequence's latest token became known
        self.prefilled = False  # a first token came: the prompt counts as processed


class EngineCore:
    def __init__(self, config: Config, inbox, emit, engine_factory=None, options: CoreOptions | None = None):
        """inbox: `get()` (blocking) and `get_nowait()` (raises queue.Empty) returning commands;
        emit(events): called once per pass with that pass's events."""
        self.config = config
        self.inbox = inbox
        self._emit = emit
        self._engine_factory = engine_factory
        self.options = options or CoreOptions()
        self.kv_events = None  # a KVEventPublisher, with an endpoint
        self.engine = None
        self.dead: str | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._events: list = []
        self._consecutive_errors = 0
        self._num_received = 0  # "add" commands taken in
        # steps, seconds in engine.step(), in _collect(), in emit; steps that launched prompt tokens, their seconds
        self._timing = [0, 0.0, 0.0, 0.0, 0, 0.0]

    def run(self):
        """Build the engine, then serve until told to stop (or the engine breaks)."""
        try:
            self.engine = (self._engine_factory or LLMEngine)(self.config)
            if self.options.kv_events_endpoint is not None:
                self._start_kv_events()
        except BaseException as e:
            if self.engine is not None:
                self.engine.shutdown()
            self._emit([("startup_error", e)])
            return
        bm = self.engine.block_manager
        self._emit([("ready", KVCacheInfo(bm.num_blocks, bm.block_size))])
        try:
            self._loop()
        except BaseException as e:  # a bug here must not leave clients hanging
            logger.exception("the engine loop crashed")
            self._die(f"the engine loop crashed: {type(e).__name__}: {e}")
            self._flush()
        finally:
            self._reject_leftover_commands()
            try:
                self.engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")
            if self.kv_events is not None:
                self.kv_events.close()

    def _start_kv_events(self):
        from nanovllm.engine.kv_events import KVEventPublisher  # pyzmq and msgspec: only when asked for
        o = self.options
        bm = self.engine.block_manager
        self.kv_events = KVEventPublisher(o.kv_events_endpoint, o.kv_events_topic, o.index, bm.block_size,
                                          "GPU" if self.config.device.type == "cuda" else "CPU", o.kv_events_format)
        bm.observer = self.kv_events

    def _die(self, reason: str):
        self.dead = reason
        self._fail_all(reason, 500)
        self._events.append(("dead", reason))

    def _reject_leftover_commands(self):
        """Requests that arrived while the loop was stopping: answer them, don't leave them hanging."""
        reason = self.dead or "the server is shutting down"
        while True:
            try:
                command = self.inbox.get_nowait()
            except (queue.Empty, EOFError, OSError):
                break
            if command[0] == "add":
                self._events.append(("reject", command[1], reason, 503))
        self._flush()

    def _loop(self):
        engine = self.engine
        while True:
            # Block only when there is nothing to compute: new commands are the only thing to do.
            commands = [self.inbox.get()] if not engine.has_unfinished() else []
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            stop = self._apply(commands)
            # Stats go first, so a reader never sees an acceptance before the request is counted.
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
        for command in commands:
            kind = command[0]
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "abort_all":
                for request_id in list(self._tracked):
                    self._finish_aborted(request_id)
            elif kind == "stop":
                stop = True
        return stop

    def _add(self, request_id: str, token_ids, params, stream: bool, arrival_time: float):
        self._num_received += 1
        try:
            ids = self.engine.tokenize(token_ids)
            seqs = self.engine.add_request(request_id, ids, params)
        except (ValueError, TypeError) as e:
            self._events.append(("reject", request_id, str(e), 400))
            return
        except Exception as e:
            logger.exception("adding request %s failed", request_id)
            self._events.append(("reject", request_id, f"internal error: {type(e).__name__}: {e}", 500))
            return
        for seq in seqs:
            seq.arrival_time = arrival_time  # count time in the command queue too
            if stream:
                self.engine.output_processor.watch(seq)  # before its first token
        self._tracked[request_id] = _Tracked(seqs, stream)
        self._events.append(("accept", request_id, len(ids)))

    def _abort(self, request_id: str):
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self.engine.abort_request(request_id)
            self._count_finished(tracked)
        self._events.append(("aborted", request_id))

    def _finish_aborted(self, request_id: str):
        """End a request now, as if it had finished: what it generated so far is its output, with
        finish_reason "abort" for the sequences that had not finished (a drain that ran out of time)."""
        tracked = self._tracked[request_id]
        self.engine.abort_request(request_id)
        for i, seq in enumerate(tracked.seqs):
            detok = seq.detokenizer
            if not tracked.done[i] and detok is not None:
                detok.unread += detok.flush()  # text held back for a stop string is final now
        self._collect([(request_id, tracked)])

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
        self._events.append(("output", request_id, RequestOutput(request_id, finished=True,
                                                                 error=RequestRejected(message, status))))

    def _step(self):
        start = time.perf_counter()
        try:
            _, prompt_tokens, _ = self.engine.step()
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
        if prompt_tokens:
            timing[4] += 1
            timing[5] += stepped - start

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
            self._die(f"{self._consecutive_errors} engine steps failed in a row; last: {message}")

    def _collect(self, requests: list | None = None):
        """Emit each request's new tokens/text, and its final output once all its sequences are done
        (requests: (request_id, _Tracked) pairs; default: all). For metrics, a sequence's new token
        is counted by the time of its previous one: the sequences decoding in step share that key,
        so the gaps of a pass are a few (seconds, count) pairs however many streams decode.
        Outputs that carry a request's first tokens go ahead of the pass's other outputs: the front
        end serves them in this order, and a new stream's first chunk should not wait behind a
        chunk for every other stream (its TTFT), while those lose the time of a chunk or two."""
        processor = self.engine.output_processor
        events = self._events
        ahead = len(events)  # where the outputs with a request's first tokens go
        opening = []
        now = time.perf_counter()
        gaps: dict[float, int] = {}   # time of a sequence's previous token -> sequences with one new
        spread = []                   # (seconds, n): n tokens that came together, an equal share each
        first_arrivals = []           # arrival times of the sequences whose first token this is
        prefilled = generated = 0
        for request_id, t in (list(self._tracked.items()) if requests is None else requests):
            opens = not t.prefilled
            deltas = []
            sent, last_token_time = t.sent, t.last_token_time
            for i, seq in enumerate(t.seqs):
                if t.done[i]:
                    continue
                # Tokens of a step still in flight (GPU overlap) are placeholders: not yet known.
                known = seq.num_completion_tokens - seq.num_pending_tokens
                start = seq.num_prompt_tokens
                new_ids = seq.token_ids[start + sent[i]:start + known]
                if new_ids:
                    n = len(new_ids)
                    generated += n
                    if not sent[i]:
                        if seq.first_token_time is not None:
                            first_arrivals.append(seq.arrival_time)
                        if not t.prefilled:
                            t.prefilled = True
                            prefilled += start
                    elif n == 1:
                        last = last_token_time[i]
                        gaps[last] = gaps.get(last, 0) + 1
                    else:
                        spread.append(((now - last_token_time[i]) / n, n))
                    last_token_time[i] = now
                sent[i] = known
                finished = seq.is_finished
                if finished:
                    t.done[i] = True
                    events.append(("finished", FinishedSequence.of(seq, now)))
                if t.stream and (new_ids or finished):
                    deltas.append(self._delta(t, i, seq, new_ids, processor.take_delta(seq)))
            all_done = all(t.done)
            if all_done:
                del self._tracked[request_id]
                if not t.stream:
                    deltas = [self._final(seq, processor) for seq in t.seqs]
            if deltas or all_done:
                first = t.seqs[0]
                output = ("output", request_id, RequestOutput(request_id, deltas, all_done, first.num_prompt_tokens,
                                                              first.num_cached_tokens))
                (opening if opens and t.prefilled else events).append(output)
        events[ahead:ahead] = opening
        if prefilled or generated:
            events.append(("tokens", prefilled, generated))
        if first_arrivals:
            events.append(("first_tokens", first_arrivals))
        if gaps or spread:
            events.append(("token_gaps", [(now - last, n) for last, n in gaps.items()] + spread))

    @staticmethod
    def _delta(t: _Tracked, i: int, seq: Sequence, new_ids: list[int], text: str) -> CompletionOutput:
        logprobs = None
        if seq.logprobs is not None:
            logprobs = seq.logprobs[t.sent_logprobs[i]:]
            t.sent_logprobs[i] = len(seq.logprobs)
        return CompletionOutput(seq.index, text, new_ids, logprobs, seq.finish_reason, seq.stop_reason, t.sent[i])

    @staticmethod
    def _final(seq: Sequence, processor) -> CompletionOutput:
        ids = seq.completion_token_ids
        logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        return CompletionOutput(seq.index, processor.text(seq), ids, logprobs, seq.finish_reason,
                                seq.stop_reason, len(ids))

    def _count_finished(self, t: _Tracked):
        """Metrics for a request removed before it finished (aborted or failed)."""
        now = time.perf_counter()
        for i, seq in enumerate(t.seqs):
            if not t.done[i]:
                known = max(seq.num_completion_tokens - seq.num_pending_tokens, 0)
                if known > t.sent[i]:
                    self._events.append(("tokens", 0, known - t.sent[i]))
                self._events.append(("finished", FinishedSequence.of(seq, now, aborted=True)))

    def _publish_stats(self):
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        running = {seq.request_id for seq in sched.running}
        waiting = {seq.request_id for seq in sched.waiting} - running
        self._events.append(("stats", EngineStats(len(running), len(waiting), bm.usage, self._num_received,
                                                  bm.prefix_queries, bm.prefix_hits, sched.num_preemptions,
                                                  *self._timing, spec_decode=self._spec_decode_stats())))

    def _spec_decode_stats(self) -> dict | None:
        speculator = self.engine.speculator
        return speculator.stats.as_dict() if speculator.enabled else None

    def _flush(self):
        if self.kv_events is not None:
            self.kv_events.flush()  # what this pass stored in and evicted from the prefix cache
        events, self._events = self._events, []
        # A pass with nothing but fresh stats says nothing new: skip it (an idle loop stays silent).
        if any(event[0] != "stats" for event in events):
            start = time.perf_counter()
            self._emit(events)
            self._timing[3] += time.perf_counter() - start

