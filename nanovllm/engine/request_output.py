"""What the asynchronous engine hands its callers: per-request outputs (whole or deltas), the
rejection of a request, the engine's published statistics, and the record of a completion that ended
(for metrics)."""
from dataclasses import dataclass, field
from typing import NamedTuple


class RequestRejected(Exception):
    """A request that was not queued. status: the HTTP status a server should answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self):  # keep the status across a process boundary
        return type(self), (str(self), self.status)


@dataclass
class CompletionOutput:
    """One sequence's output: what is new since the last output when streaming, else all of it."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0  # completion tokens generated so far (for usage)

    def followed_by(self, later: "CompletionOutput") -> "CompletionOutput":
        """This delta and the next one of the same sequence, as one delta."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return CompletionOutput(self.index, self.text + later.text, self.token_ids + later.token_ids, logprobs,
                                later.finish_reason, later.stop_reason, later.num_tokens)


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: RequestRejected | None = None  # the request failed (and is gone from the engine)

    def followed_by(self, later: "RequestOutput") -> "RequestOutput":
        """This streamed output and the next one of the same request, as one (a failure ends it:
        the later output then stands alone)."""
        if later.error is not None:
            return later
        outputs = {o.index: o for o in self.outputs}
        for o in later.outputs:
            outputs[o.index] = outputs[o.index].followed_by(o) if o.index in outputs else o
        return RequestOutput(self.request_id, list(outputs.values()), later.finished, later.num_prompt_tokens,
                             later.num_cached_tokens)


def coalesce_outputs(passes: list[list]) -> list:
    """Several passes' event lists as one, each request's outputs merged into one at the place of
    its last: what a server that fell behind by several passes needs to send (a chunk per stream,
    not one per pass). Other events keep their order."""
    if len(passes) == 1:
        return passes[0]
    events = [event for events in passes for event in events]
    last = {event[1]: i for i, event in enumerate(events) if event[0] == "output"}
    merged, out = {}, []
    for i, event in enumerate(events):
        if event[0] != "output":
            out.append(event)
            continue
        request_id = event[1]
        sofar = merged.pop(request_id, None)
        output = event[2] if sofar is None else sofar.followed_by(event[2])
        if last[request_id] == i:
            out.append(("output", request_id, output))
        else:
            merged[request_id] = output
    return out


@dataclass
class EngineStats:
    """A snapshot published by the engine after each pass of its loop, read by anyone. Counters
    count from the engine's start."""
    num_running: int = 0          # requests with a sequence in the running batch
    num_waiting: int = 0          # requests taken in and not yet running
    kv_cache_usage: float = 0.0   # fraction of KV-cache blocks in use, 0..1
    num_requests_received: int = 0  # "add" commands taken in (accepted or rejected): the front end
    #                                 subtracts it from what it sent to know what is still on the way
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0      # of them, tokens whose KV was found there
    num_preemptions: int = 0
    # Where the engine loop's time goes (wall seconds since start): steps taken, stepping the engine,
    # turning step results into per-request outputs, handing each pass's events to the front end
    # (in process mode: to the sender thread, so it stays near 0; were it to grow, the engine would
    # be waiting for the server). A step time far above the offline step time means the loop waits
    # for something else (e.g. the interpreter lock, on a thread).
    engine_steps: int = 0
    step_seconds: float = 0.0
    collect_seconds: float = 0.0
    emit_seconds: float = 0.0
    # Of the steps, those that launched prompt tokens (prefill or mixed) and their share of
    # step_seconds: decode-only steps are the rest.
    prefill_steps: int = 0
    prefill_step_seconds: float = 0.0
    # Speculative decoding (nanovllm.spec_decode.SpecDecodeStats's counters), None when it is off.
    spec_decode: dict | None = None


class FinishedSequence(NamedTuple):
    """What metrics need of a completion that ended (finished, stopped or aborted)."""
    finish_reason: str          # "stop", "length" or "abort" (cancelled, failed or cut short)
    arrival_time: float         # time.perf_counter() values (CLOCK_MONOTONIC: one clock per host)
    first_scheduled_time: float | None
    first_token_time: float | None
    num_prompt_tokens: int
    num_tokens: int             # completion tokens
    time: float

    @classmethod
    def of(cls, seq, now: float, aborted: bool = False) -> "FinishedSequence":
        """The record of engine Sequence `seq`, ended at `now`: its tokens known so far (those of a step
        still in flight are not)."""
        known = max(seq.num_completion_tokens - seq.num_pending_tokens, 0)
        return cls("abort" if aborted else seq.finish_reason or "abort", seq.arrival_time, seq.first_scheduled_time,
                   seq.first_token_time, seq.num_prompt_tokens, known, now)
