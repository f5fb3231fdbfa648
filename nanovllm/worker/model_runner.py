"""Owns the model, its paged KV cache and the sampler on one device (one tensor-parallel rank)."""
import torch

from nanovllm.attention.base import get_attention_backend
from nanovllm.config import Config
from nanovllm.distributed import set_tensor_parallel
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.layers.sampler import Sampler
from nanovllm.models.loader import build_model, init_dummy_weights, load_weights
from nanovllm.worker.inputs import build_forward_batch
from nanovllm.worker.sampling_inputs import build_sampling_metadata

_CPU_DEFAULT_KV_BYTES = 1 << 30


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0):
        self.config = config
        self.device = config.device
        self.block_size = config.kvcache_block_size
        set_tensor_parallel(rank, config.tensor_parallel_size)
        torch.manual_seed(config.seed)
        self.model = build_model(config.hf_config, config.torch_dtype, self.device)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model)
        self.sampler = Sampler()
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.num_kv_heads, self.head_dim = self.model.kv_cache_shape()
        self.num_layers = len(self.model.attention_layers)
        self.num_blocks = self._num_kv_blocks()
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)

    # ---- KV cache -----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V."""
        elem = torch.tensor([], dtype=self.config.torch_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks > 0:
            return cfg.num_kvcache_blocks
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        else:
            # Enough for every sequence at full length, within a modest default for a laptop.
            want = cfg.max_num_seqs * (cfg.max_model_len + self.block_size)
            budget = min(_CPU_DEFAULT_KV_BYTES, want // self.block_size * self.block_bytes)
            budget = max(budget, -(-cfg.max_model_len // self.block_size) * self.block_bytes)
        return max(1, budget // self.block_bytes)

    def _profile_free_gpu_memory(self) -> int:
        from nanovllm.worker.gpu_memory import profile_kv_budget
        return profile_kv_budget(self)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        # Zeroed: masked-out context slots are multiplied by zero weights, which NaN would poison.
        kv = torch.zeros(2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                         dtype=self.config.torch_dtype, device=self.device)
        self._bind_kv_cache(kv)
        return kv

    def _bind_kv_cache(self, kv: torch.Tensor):
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache, attn.v_cache = kv[0, i], kv[1, i]
            attn.backend = self.backend

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[int], list[int]]:
        """Run one step. Returns (rows of the batch that sampled, their new token ids)."""
        fb = build_forward_batch(batch, self.block_size, self.device)
        self.backend.prepare(fb.attn)
        hidden = self.model(fb.input_ids, fb.positions, fb.attn)
        if not fb.sample_rows:
            return [], []
        logits = self.model.compute_logits(hidden[fb.logits_indices])
        sampling = build_sampling_metadata([batch.seqs[i] for i in fb.sample_rows], self.device)
        tokens = self.sampler(logits, sampling)
        return fb.sample_rows, tokens.tolist()

    def shutdown(self):
        pass
