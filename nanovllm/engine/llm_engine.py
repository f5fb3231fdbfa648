"""The engine loop: requests in, scheduled steps on the model runner, finished sequences out."""
import gc
import random
import time

import torch

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tokenizer import eos_token_ids, load_tokenizer
from nanovllm.logger import init_logger
from nanovllm.sampling_params import SamplingParams
from nanovllm.spec_decode.speculator import build_speculator
from nanovllm.structured_output.manager import StructuredOutputs

logger = init_logger(__name__)


def _kv_cache_note(config: Config) -> str:
    """The start-up log's word on a KV cache that is not in the model dtype."""
    kv = config.kv_cache_torch_dtype
    if kv == config.torch_dtype:
        return ""
    ratio = torch.tensor([], dtype=config.torch_dtype).element_size() / torch.tensor([], dtype=kv).element_size()
    return f", kv_cache_dtype={config.kv_cache_dtype} ({kv}: {ratio:g}x the tokens of a {config.torch_dtype} cache)"


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        if config.eos == -1 and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            config.eos = self.tokenizer.eos_token_id
        self.eos_token_ids = eos_token_ids(config, self.tokenizer)
        self.model_runner = self._make_runner(config, frozenset(self.eos_token_ids))
        num_blocks = self.model_runner.num_blocks
        config.num_kvcache_blocks = num_blocks
        if num_blocks * config.kvcache_block_size < config.max_model_len:
            self.shutdown()  # tensor-parallel workers are already running
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {config.kvcache_block_size} tokens, fewer than "
                f"max_model_len={config.max_model_len}: lower max_model_len or give the cache more memory "
                "(num_kvcache_blocks, kv_cache_memory_bytes or gpu_memory_utilization)")
        logger.info("num_kvcache_blocks=%d (%d tokens of %d per block, %.2f GiB), max_model_len=%d, device=%s, dtype=%s%s",
                    num_blocks, num_blocks * config.kvcache_block_size, config.kvcache_block_size,
                    num_blocks * self.model_runner.block_bytes / 2**30, config.max_model_len, config.device,
                    config.torch_dtype, _kv_cache_note(config))
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager,
                                   config.max_model_len)
        # On a GPU, step N+1 is launched before step N's tokens are read back.
        self.overlap = config.device.type == "cuda"
        self._in_flight = None
        self.output_processor = OutputProcessor(self.eos_token_ids, config.max_model_len, self.tokenizer)
        self.vocab_size = config.hf_config.vocab_size
        # Grammars of constrained requests (a no-op for the others); built before any request.
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                            config.reasoning_parser)
        # Speculative decoding (a no-op object when not configured).
        try:
            self.speculator = build_speculator(config, self.model_runner)
        except BaseException:
            self.shutdown()
            raise
        self._seed_rng = random.Random(config.seed)
        self.requests: dict = {}  # request_id -> list of its sequences
        # What exists now (the libraries' objects, the model) lives as long as the engine: frozen,
        # out of the cyclic collector's reach, so that a full collection during a run need not walk
        # it (bench.py prints the collector's pauses in the timed run).
        gc.collect()
        gc.freeze()

    @staticmethod
    def _make_runner(config: Config, eos_token_ids: frozenset[int]):
        if config.tensor_parallel_size > 1:
            from nanovllm.worker.tp_executor import TensorParallelExecutor
            return TensorParallelExecutor(config, eos_token_ids)
        from nanovllm.worker.model_runner import ModelRunner
        return ModelRunner(config, eos_token_ids=eos_token_ids)

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        """Validate one prompt (text or token ids) and return its token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.config.model!r} has no tokenizer files: pass prompts as token-id lists")
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            token_ids = list(prompt)
            if set(map(type, token_ids)) == {int}:  # the usual case, checked in C: a range test suffices
                bad = None if min(token_ids) >= 0 and max(token_ids) < self.vocab_size else next(
                    t for t in token_ids if not 0 <= t < self.vocab_size)
            else:  # bools, floats, numpy scalars...: name the first offender
                bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)
                            or not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        else:
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is {self.config.max_model_len}; "
                             "the prompt must leave room for at least one generated token")
        return token_ids

    def check_params(self, sampling_params: SamplingParams):
        """What SamplingParams cannot check alone: the parts that depend on the model."""
        if sampling_params.stop_list and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer and model {self.config.model!r} has none; "
                             "use stop_token_ids instead")
        bad = [t for t in sampling_params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in sampling_params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        self.structured.check(sampling_params)  # compiles a constraint now (cached): errors before queueing

    def add_request(self, request_id, token_ids: list[int], sampling_params: SamplingParams) -> list[Sequence]:
        """Queue a validated request; with n > 1 it becomes n sequences sharing the prompt's blocks."""
        self.check_params(sampling_params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use by a running request")
        base_seed = sampling_params.seed if sampling_params.seed is not None else self._seed_rng.getrandbits(63)
        seqs = []
        now = time.perf_counter()
        for i in range(sampling_params.n):
            seq = Sequence(token_ids, sampling_params, seed=_derive_seed(base_seed, i), request_id=request_id, index=i)
            seq.arrival_time = now
            seqs.append(seq)
        self.structured.attach(seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return seqs

    def abort_request(self, request_id):
        for seq in self.requests.pop(request_id, []):
            self._finish(seq, "abort")

    def _finish(self, seq: Sequence, reason: str):
        self.scheduler.finish(seq, reason)
        self.structured.release(seq)
        self.speculator.release(seq)

    def get_metrics(self) -> dict:
        """Counters since the engine started (vLLM's names, without the "vllm:" prefix): preemptions,
        prefix-cache tokens queried and hit, and with speculative decoding the drafts verified, their
        tokens, of them accepted, and accepted by position in the draft."""
        bm = self.block_manager
        metrics = {"num_preemptions": self.scheduler.num_preemptions, "prefix_cache_queries": bm.prefix_queries,
                   "prefix_cache_hits": bm.prefix_hits}
        if self.speculator.enabled:
            metrics.update(self.speculator.stats.as_dict())
        return metrics

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int, int]:
        """Schedule and launch one forward pass, then take in the results of the previous one
        (on a GPU, so the host's work overlaps the device's) or of this one (on the CPU).
        Returns (sequences that finished, prefill tokens launched, decode tokens launched).

        A batch with rows under a grammar launches its forward pass alone: the masks of its draw
        depend on the previous step's tokens, so they are filled once those are taken in, while
        the forward pass runs (overlap stays on). With overlap, the draw is launched at the next
        step, once that step is scheduled: the scheduling, and the host's work up to the masks,
        then overlap the forward pass, and the next forward pass follows the draw on the device
        at once (launched last, the draw would leave the device idle while the host schedules).

        Speculative decoding: drafts continue a sequence's newest tokens, and how many tokens a
        verification step adds to each sequence is known only from its results. So a step that
        verifies drafts takes in the step in flight first, and its own results are taken in
        before the next step is scheduled: the host's work of such a step does not overlap the
        device's (n-gram drafts cost microseconds; a draft model runs its steps on the device).
        Steps without drafts (above disable_by_batch_size, or nothing to propose) overlap as usual.
        If it raises, no step is left in flight: a failed launch or read-back leaves results that
        cannot be trusted or fetched, and the callers fail every running request."""
        try:
            finished, drafts = [], None
            running = self.scheduler.running
            if self.speculator.wants_drafts(running, self._in_flight is not None):
                finished = self.drain()
                drafts = self.speculator.propose(running, self.block_manager)
            batch = self.scheduler.schedule(drafts)
            if self._in_flight is not None:
                self._launch_draw(self._in_flight[1])  # before this step's forward pass: it reads the tokens
            launched = None
            if batch is not None:
                output = self.model_runner.execute(batch, defer_sampling=self.structured.needs_masks(batch.seqs))
                self.scheduler.advance(batch)
                if batch.spec is None:
                    for seq in output.seqs:
                        seq.append_pending()
                launched = (batch, output)
            # A verification step is taken in before the next one is scheduled.
            stays_in_flight = self.overlap and (batch is None or batch.spec is None)
            earlier = None
            if self.overlap:
                earlier, self._in_flight = self._in_flight, (launched if stays_in_flight else None)
            if earlier is not None:
                finished += self._process(*earlier)
            if launched is not None and not stays_in_flight:
                self._launch_draw(launched[1])
                finished += self._process(*launched)
        except BaseException:
            self._in_flight = None
            raise
        if batch is None:
            return finished, 0, 0
        decode = batch.num_decodes
        if batch.spec is not None:  # a verifying sequence's tokens are decode tokens too
            decode += sum(len(d) + 1 for d in batch.spec if d)
        return finished, batch.num_tokens - decode, decode

    def _launch_draw(self, output):
        """Fill the masks of a step whose draw awaits them and launch it (nothing for other steps)."""
        if output.awaits_masks:
            self.model_runner.sample(output, self.structured.fill_masks)

    def _process(self, batch, output) -> list[Sequence]:
        if output.drafts is not None:
            return self._process_verified(batch, output)
        finished = []
        tokens = output.token_ids()  # waits for the device: the tokens are known from then on
        now = time.perf_counter()
        logprobs = output.logprobs()
        rejected = self.structured.advance(output.seqs, tokens)  # grammars take their tokens
        for row, (seq, token) in enumerate(zip(output.seqs, tokens)):
            if seq.is_finished:  # stopped or aborted while this step was in flight
                continue
            seq.resolve_pending(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self.output_processor.check(seq, token, None if logprobs is None else logprobs.row(row))
            if rejected and seq in rejected:
                reason = "abort"
            if reason is not None:
                self._end(seq, reason, finished)
        self.scheduler.publish(batch)
        return finished

    def _process_verified(self, batch, output) -> list[Sequence]:
        """A verification step's results: each sequence's rows (its last token's and one per
        draft) become the tokens it gains (Speculator.verify), each checked in turn as if decoded
        one by one, so a stop (eos, stop token or string, max_tokens) inside an accepted run ends
        the sequence there; the KV of its rejected drafts is rolled back first."""
        finished = []
        tokens = output.token_ids()
        now = time.perf_counter()
        logprobs = output.logprobs()
        starts, row = [], 0
        for draft in output.drafts:
            starts.append(row)
            row += len(draft) + 1
        # Grammars take their tokens (a constrained sequence has no drafts: its one row).
        rejected = self.structured.advance(output.seqs, [tokens[r] for r in starts])
        for seq, draft, start in zip(output.seqs, output.drafts, starts):
            if seq.is_finished:  # aborted while the step ran
                continue
            gained = self.speculator.verify(tokens[start:start + len(draft) + 1], draft)
            self.scheduler.rollback(seq, len(draft) + 1 - len(gained))
            if seq.first_token_time is None:
                seq.first_token_time = now
            aborted = rejected and seq in rejected
            if aborted:
                gained = gained[:1]  # its grammar ended it at the first
            rows = None if logprobs is None else [logprobs.row(start + j) for j in range(len(gained))]
            reason = self.output_processor.append_run(seq, gained, rows)
            if aborted:
                reason = "abort"
            if reason is not None:
                self._end(seq, reason, finished)
        self.scheduler.publish(batch)
        return finished

    def _end(self, seq: Sequence, reason: str, finished: list):
        self._finish(seq, reason)
        finished.append(seq)
        siblings = self.requests.get(seq.request_id)
        if siblings is not None and all(s.is_finished for s in siblings):
            del self.requests[seq.request_id]

    def drain(self) -> list[Sequence]:
        """Take in the results of the step still in flight, if any."""
        done, self._in_flight = self._in_flight, None
        if done is None:
            return []
        self._launch_draw(done[1])
        return self._process(*done)

    def shutdown(self):
        speculator = getattr(self, "speculator", None)
        if speculator is not None:
            speculator.shutdown()
        runner, self.model_runner = getattr(self, "model_runner", None), None
        if runner is not None:
            runner.shutdown()
            gc.unfreeze()  # back in the collector's reach, so that what the engine held can be freed


def _derive_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the n completions of one request."""
    if index == 0:
        return seed
    return (seed * 6364136223846793005 + index * 1442695040888963407) & ((1 << 63) - 1)
