"""A request in flight: its tokens, how many of them have KV in the cache, and its blocks."""
from enum import Enum, auto
from itertools import count

from nanovllm.sampling_params import SamplingParams


PENDING_TOKEN = -1  # placeholder for a token the device has sampled but the host has not read


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, seed: int,
                 request_id=None, index: int = 0):
        self.seq_id = next(Sequence._ids)
        self.request_id = self.seq_id if request_id is None else request_id
        self.index = index  # which of the request's n completions this is
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        # KV of token_ids[:num_computed_tokens] is in the cache; the scheduler advances it.
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.block_table: list[int] = []
        self.num_published_tokens = 0  # leading tokens of block_table offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.sampling_params = sampling_params
        self.seed = seed  # drives this sequence's sampling noise, independent of the batch
        self.plain_sampling = sampling_params.plain  # read per step on the decode hot path
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict] | None = [] if sampling_params.logprobs is not None else None
        self.num_preemptions = 0
        # structured_output.manager.GrammarState while a constraint applies (set by the engine).
        self.grammar = None
        # engine.detokenizer.IncrementalDetokenizer while the sequence needs text as it runs (set
        # by the output processor).
        self.detokenizer = None
        # Trailing entries of token_ids sampled on the device but not yet seen by the host.
        self.num_pending_tokens = 0
        # Timestamps for metrics (filled by the engine).
        self.arrival_time = 0.0
        self.first_scheduled_time: float | None = None  # first admitted to the running batch
        self.first_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int):
        self.token_ids.append(token_id)

    def append_pending(self):
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending_tokens += 1

    def resolve_pending(self, token_id: int):
        self.token_ids[len(self.token_ids) - self.num_pending_tokens] = token_id
        self.num_pending_tokens -= 1

    def drop_pending(self):
        if self.num_pending_tokens:
            del self.token_ids[-self.num_pending_tokens:]
            self.num_pending_tokens = 0
