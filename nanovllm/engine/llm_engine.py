"""The engine loop: requests in, scheduled steps on the model runner, finished sequences out."""
import random
import time

from nanovllm.config import Config
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.tokenizer import eos_token_ids, load_tokenizer
from nanovllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = load_tokenizer(config.model)
        if config.eos == -1 and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            config.eos = self.tokenizer.eos_token_id
        self.eos_token_ids = eos_token_ids(config, self.tokenizer)
        self.model_runner = self._make_runner(config)
        num_blocks = self.model_runner.num_blocks
        config.num_kvcache_blocks = num_blocks
        if num_blocks * config.kvcache_block_size < config.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {config.kvcache_block_size} tokens, fewer than "
                f"max_model_len={config.max_model_len}: lower max_model_len or give the cache more memory "
                "(num_kvcache_blocks, kv_cache_memory_bytes or gpu_memory_utilization)")
        self.block_manager = BlockManager(num_blocks, config.kvcache_block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager)
        self.output_processor = OutputProcessor(self.eos_token_ids, config.max_model_len, self.tokenizer)
        self.vocab_size = config.hf_config.vocab_size
        self._seed_rng = random.Random(config.seed)
        self.requests: dict = {}  # request_id -> list of its sequences

    @staticmethod
    def _make_runner(config: Config):
        if config.tensor_parallel_size > 1:
            from nanovllm.worker.tp_executor import TensorParallelExecutor
            return TensorParallelExecutor(config)
        from nanovllm.worker.model_runner import ModelRunner
        return ModelRunner(config)

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

    def add_request(self, request_id, token_ids: list[int], sampling_params: SamplingParams) -> list[Sequence]:
        """Queue a validated request; with n > 1 it becomes n sequences sharing the prompt's blocks."""
        base_seed = sampling_params.seed if sampling_params.seed is not None else self._seed_rng.getrandbits(63)
        seqs = []
        now = time.perf_counter()
        for i in range(sampling_params.n):
            seq = Sequence(token_ids, sampling_params, seed=_derive_seed(base_seed, i), request_id=request_id, index=i)
            seq.arrival_time = now
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return seqs

    def abort_request(self, request_id):
        for seq in self.requests.pop(request_id, []):
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int, int]:
        """One forward pass. Returns (sequences finished by it, prefill tokens, decode tokens)."""
        batch = self.scheduler.schedule()
        if batch is None:
            return [], 0, 0
        rows, tokens = self.model_runner.execute(batch)
        self.scheduler.finish_computation(batch)
        finished = []
        now = time.perf_counter()
        for row, token in zip(rows, tokens):
            seq = batch.seqs[row]
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self.output_processor.append(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                finished.append(seq)
        num_decode = batch.num_decodes
        return finished, batch.num_tokens - num_decode, num_decode

    def shutdown(self):
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            runner.shutdown()


def _derive_seed(seed: int, index: int) -> int:
    """Distinct, reproducible seeds for the n completions of one request."""
    if index == 0:
        return seed
    return (seed * 6364136223846793005 + index * 1442695040888963407) & ((1 << 63) - 1)
