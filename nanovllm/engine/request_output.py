"""What the asynchronous engine hands its callers: per-request outputs (whole or deltas), the
rejection of a request, and the engine's published statistics."""
from dataclasses import dataclass, field


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


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: RequestRejected | None = None  # the request failed (and is gone from the engine)


@dataclass
class EngineStats:
    """A snapshot published by the engine thread after each step, read by anyone."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Where the engine loop's time goes (wall seconds since start): steps taken, stepping the engine,
    # turning step results into per-request outputs. A step time far above the offline step time
    # means the loop waits for something else (e.g. the interpreter lock, on a thread).
    engine_steps: int = 0
    step_seconds: float = 0.0
    collect_seconds: float = 0.0
