"""Owns the model, its paged KV cache, the sampler and the CUDA graphs on one device (one
tensor-parallel rank). `execute` launches a step and returns at once; the sampled tokens are
fetched later, so on a GPU the host prepares the next step while this one runs.

A step under grammars (structured outputs) launches in two parts: `execute(batch,
defer_sampling=True)` launches the forward pass (and prepares the sampling parameters, as of the
batch's launch), and `sample(output, fill_masks)`, called once the engine has taken in the
previous step's tokens (on a GPU: at the next step, before its forward pass), has the grammar fill
the bitmasks into pinned memory, sends them in one copy and launches the draw, while the forward
pass runs on the device."""
from operator import attrgetter
from pathlib import Path

import numpy as np
import torch

from nanovllm.attention.registry import get_attention_backend
from nanovllm.config import Config, torch_threads
from nanovllm.distributed import (broadcast_from_rank0, enable_one_shot_all_reduce, min_over_ranks, set_tensor_parallel,
                                  tp_rank, tp_size)
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.layers.cpu_int4 import attach_int4_weights
from nanovllm.layers.cpu_linear import pack_linear_weights
from nanovllm.layers.sampler import Sampler, SamplerOutput
from nanovllm.layers.sampling_metadata import SamplingMetadata
from nanovllm.models.gguf_q4 import Q4_BLOCKS_FILE
from nanovllm.models.loader import build_model, init_dummy_weights, load_weights, process_weights_after_loading
from nanovllm.spec_decode.config import draft_memory
from nanovllm.worker.grammar_masks import BitmaskBuffers, MaskFillStats, timed_fill
from nanovllm.worker.inputs import (HostInputs, HostToDevice, build_host_inputs, fill_decode_inputs,
                                    kv_copies_array, to_device)
from nanovllm.worker.sampling_inputs import build_sampling_metadata
from nanovllm.worker.step_output import DeferredDraw, PinnedTokenRing, StepOutput
from nanovllm.worker.warmup import compile_kernels, run_largest_step

_CPU_DEFAULT_KV_BYTES = 512 << 20
_seq_id = attrgetter("seq_id")
_plain_sampling = attrgetter("plain_sampling")


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, eos_token_ids: frozenset[int] = frozenset()):
        self.config = config
        self.rank = rank
        self.eos_token_ids = eos_token_ids  # banned while a sequence is under its min_tokens
        self.device = config.device
        self.block_size = config.kvcache_block_size
        set_tensor_parallel(rank, config.tensor_parallel_size)
        torch.manual_seed(config.seed)
        if (threads := torch_threads(config)) is not None:
            torch.set_num_threads(threads)
        self.model = build_model(config.hf_config, config.torch_dtype, self.device, config.quant_config)
        if config.load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model)
        process_weights_after_loading(self.model)  # quantized layers: FP8 weights, or dequantized on the CPU
        if self.device.type == "cpu":
            pack_linear_weights(self.model)  # bf16: oneDNN's layout once, not at every product
            if (not config.enforce_eager and config.tensor_parallel_size == 1 and config.quant_config is None
                    and config.load_format != "dummy"):
                # A converted GGUF's 4-bit blocks, for decode-sized batches (enforce_eager: the bf16 reference)
                attach_int4_weights(self.model, Path(config.model) / Q4_BLOCKS_FILE, config.torch_dtype)
        self.sampler = Sampler()
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.num_kv_heads, self.head_dim = self.model.kv_cache_shape()
        self.num_q_heads = self.model.attention_layers[0].num_heads
        self.num_layers = len(self.model.attention_layers)
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        # Speculative decoding: a verification step computes and samples up to 1 + k tokens per sequence.
        spec = config.speculative_config
        self.max_query_len = 1 + spec.num_speculative_tokens if spec is not None else 1
        self.backend.setup(config.max_num_seqs, self.num_q_heads, self.num_kv_heads, self.head_dim,
                           config.max_model_len, self.device, self.max_query_len)
        for attn in self.model.attention_layers:
            attn.backend = self.backend
        # The last step's sampled tokens stay on the device: the next step reads its inputs there.
        self._last_sampled: torch.Tensor | None = None
        self._last_row_of_seq: dict[int, int] = {}
        self._tp_sampled: torch.Tensor | None = None  # the ranks' copy of the last tokens (_pending_tokens)
        if config.tensor_parallel_size > 1:  # every rank, here: a collective set-up
            enable_one_shot_all_reduce(self.device, config.torch_dtype)
        self.graph_runner = None
        self.piecewise = None
        self.verify_graphs = None  # speculative verification steps (worker/verify_graph.py)
        self.stage = HostToDevice(self.device)
        # Every step's token read-back (a verification step's: 1 + k rows a sequence) on a GPU (the memory
        # profile's step below draws too).
        self._token_ring = PinnedTokenRing(config.max_num_seqs * self.max_query_len) if self.device.type == "cuda" else None
        self.bitmasks = BitmaskBuffers(config.max_num_seqs, config.hf_config.vocab_size, self.device,
                                       config.max_num_seqs * self.max_query_len)
        self.mask_fill = MaskFillStats()
        # Block ids are shared by all tensor-parallel ranks: every rank holds as many as the smallest.
        self.num_blocks = min_over_ranks(self._num_kv_blocks())
        self.kv_cache = self.allocate_kv_cache(self.num_blocks)
        self._copy_kernel = None  # the torch path copies on the CPU
        if self.device.type == "cuda":
            from nanovllm.kernels.copy_kv import copy_kv_prefixes
            self._copy_kernel = copy_kv_prefixes
            compile_kernels(self)
        if self.device.type == "cuda" and not config.enforce_eager and self.backend.supports_cuda_graphs:
            from nanovllm.worker.cuda_graph import CUDAGraphRunner
            # Rank 0 of a tensor-parallel group samples outside the graphs (its workers never sample).
            self.graph_runner = CUDAGraphRunner(self.model, config.max_num_seqs, self.max_blocks_per_seq,
                                                config.hf_config.vocab_size, config.torch_dtype, self.device,
                                                config.max_model_len, capture_sampler=config.tensor_parallel_size == 1,
                                                bitmasks=self.bitmasks)
            self.graph_runner.capture()
            if spec is not None and config.tensor_parallel_size == 1:
                from nanovllm.worker.verify_graph import VerifyGraphRunner
                self.verify_graphs = VerifyGraphRunner(
                    self.model, min(config.max_num_seqs, spec.disable_by_batch_size), self.max_query_len,
                    self.max_blocks_per_seq, config.hf_config.vocab_size, config.torch_dtype, self.device,
                    config.max_model_len, pool=self.graph_runner.pool)
                self.verify_graphs.capture()
            from nanovllm.worker import piecewise_graph
            # With tensor parallelism the pieces hold the all-reduces, captured in the same order on every rank.
            if piecewise_graph.ENABLED:
                self.piecewise = piecewise_graph.PiecewiseGraphs(self.model, config.max_num_batched_tokens,
                                                                 self.num_q_heads, self.head_dim, config.torch_dtype,
                                                                 self.device)
                self.piecewise.capture()
        if self.device.type == "cuda":
            # The KV sizing and the graph capture empty the allocator's cache; the largest step takes
            # its activations back now, so the first long prefill of a run does not cudaMalloc them.
            run_largest_step(self, config.max_num_batched_tokens,
                             min(config.max_num_seqs, config.max_num_batched_tokens), self.num_blocks)

    # ---- KV cache -----------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (one byte per value in an FP8 cache)."""
        elem = torch.tensor([], dtype=self.config.kv_cache_torch_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks > 0:
            return cfg.num_kvcache_blocks
        # A draft model (speculative decoding, rank 0 only) holds as many blocks as the target, and
        # its weights load after this budget is made: both come out of it.
        draft_block, draft_weights = (0, 0) if self.rank else draft_memory(
            cfg.speculative_config, cfg.torch_dtype, cfg.kv_cache_torch_dtype, self.block_size)
        per_block = self.block_bytes + draft_block
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            from nanovllm.worker.gpu_memory import profile_kv_budget
            budget = profile_kv_budget(self) - draft_weights
        else:
            # Enough for every sequence at full length, within a modest default for a laptop.
            want = cfg.max_num_seqs * (cfg.max_model_len + self.block_size)
            budget = min(_CPU_DEFAULT_KV_BYTES, want // self.block_size * per_block)
            budget = max(budget, self.max_blocks_per_seq * per_block)
        return max(1, budget // per_block)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        # Zeroed: masked-out context slots are multiplied by zero weights, which NaN would poison.
        dtype = self.config.kv_cache_torch_dtype
        kv = torch.zeros(2, self.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                         dtype=dtype, device=self.device)
        fp8 = dtype == torch.float8_e4m3fn  # the kernels then quantize with, and dequantize by, the layer's scales
        for i, attn in enumerate(self.model.attention_layers):
            attn.k_cache, attn.v_cache = kv[0, i], kv[1, i]
            attn.kv_scales = (attn.k_scale, attn.v_scale) if fp8 else None
        return kv

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, defer_sampling: bool = False) -> StepOutput:
        """Launch the step. defer_sampling: launch the forward pass only; the draw waits for
        `sample` (the batch has rows under a grammar)."""
        g = self.graph_runner
        if g is not None and g.capture_sampler and g.can_run(len(batch.seqs), batch.num_decodes):
            if batch.kv_copies:  # a prefix hit one token short of the prompt admits a "decode"
                self.copy_kv_prefixes(kv_copies_array(batch.kv_copies))
            return self._execute_graphed_decode(batch.seqs, defer_sampling)
        v = self.verify_graphs
        if v is not None and v.fits(batch):
            if batch.kv_copies:
                self.copy_kv_prefixes(kv_copies_array(batch.kv_copies))
            return self._sampled_step(batch.seqs, v.run(batch, self.block_size), batch.spec, defer_sampling)
        host = self.host_inputs(batch)
        seqs = [batch.seqs[i] for i in host.sample_rows]
        return self.run(host, seqs, defer_sampling)

    @torch.inference_mode()
    def sample(self, output: StepOutput, fill_masks) -> None:
        """Draw a deferred step's tokens: fill_masks(seqs, mask_rows, masks) -> number of masks
        writes the bitmasks of the rows that need one into this step's pinned buffer
        (structured_output.manager.StructuredOutputs.fill_masks); then one copy, and the draw."""
        deferred, output.deferred = output.deferred, None
        seqs, n = output.seqs, len(output.seqs)
        rows, masks = self.bitmasks.host()
        num_masks = timed_fill(fill_masks, seqs, rows, masks, self.mask_fill, deferred.forward_done)
        g, bs = self.graph_runner, deferred.graph_bs
        if bs is not None and deferred.meta is None:  # the graphs' default draw
            rows[n:bs] = -1  # padding rows
            if num_masks:
                self.bitmasks.send(bs, num_masks)
            g.replay_sample(bs, masked=num_masks > 0)
            self._remember_sampled(seqs, g.sampled)
            output._complete(None, *self._token_ring.copy(g.sampled[:n]))
            return
        meta = deferred.meta
        num_rows = n
        if output.drafts is not None:  # a verification step: a constrained sequence (no drafts) has one row
            seq_of_row = np.repeat(np.arange(n), [len(d) + 1 for d in output.drafts])
            num_rows = len(seq_of_row)
            rows[:num_rows] = rows[:n][seq_of_row]
        if num_masks:
            meta.mask_rows, meta.masks, meta.masked_rows = self.bitmasks.send(num_rows, num_masks)
        output._complete(self._draw(seqs, deferred.logits, meta, output.drafts is not None), ring=self._token_ring)

    def _forward_done(self) -> torch.cuda.Event | None:
        """An event behind the forward pass just launched (for MaskFillStats), on a GPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        """The step's inputs as host arrays; decode inputs still pending on the host index the
        rows of the last step's samples, which stay on the device (see `run`)."""
        return build_host_inputs(batch, self.block_size, self._last_row_of_seq)

    @torch.inference_mode()
    def run(self, host: HostInputs, sample_seqs: list[Sequence] | None, defer_sampling: bool = False) -> StepOutput:
        """Forward pass over prepared inputs; sample when sample_seqs is given (tensor-parallel
        workers other than rank 0 pass None: they only contribute to the forward), or leave the
        draw to `sample` when defer_sampling."""
        logits = self.forward(host)
        if sample_seqs is None or logits is None:
            return StepOutput([], None)
        return self._sampled_step(sample_seqs, logits, host.sample_drafts, defer_sampling)

    def _sampled_step(self, seqs: list[Sequence], logits: torch.Tensor, drafts: list[list[int]] | None,
                      defer_sampling: bool) -> StepOutput:
        """The eager sampler's draw of seqs' rows of logits (with drafts: each verified position's),
        or (defer_sampling) the step whose draw `sample` launches."""
        meta = self._sampling_metadata(seqs, drafts)
        if defer_sampling:
            return StepOutput(seqs, None, deferred=DeferredDraw(logits, meta, None, self._forward_done()),
                              drafts=drafts)
        return StepOutput(seqs, self._draw(seqs, logits, meta, drafts is not None), drafts=drafts,
                          ring=self._token_ring)

    @torch.inference_mode()
    def forward(self, host: HostInputs, last_sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """The forward pass over prepared inputs: the logits of the rows host.logits_indices names
        (None when none). Inputs still pending on the host (host.pending_src) are read from
        last_sampled, by default the previous step's samples."""
        if host.kv_copies is not None:
            self.copy_kv_prefixes(host.kv_copies)
        fb = to_device(host, self.stage, self.config.max_model_len)
        if fb.pending_dst is not None:
            source = self._pending_tokens() if last_sampled is None else last_sampled
            fb.input_ids[fb.pending_dst] = source[fb.pending_src]
        if self.graph_runner is not None and self.graph_runner.can_run(fb.attn.num_seqs, fb.attn.num_decodes):
            return self.graph_runner.run(fb.input_ids, fb.positions, fb.attn)  # every decode row samples
        if self.piecewise is not None and self.piecewise.can_run(fb.input_ids.shape[0]):
            hidden = self.piecewise.forward(fb.input_ids, fb.positions, fb.attn)
        else:
            hidden = self.model(fb.input_ids, fb.positions, fb.attn)
        if not fb.sample_rows:
            return None
        return self.model.compute_logits(hidden[fb.logits_indices])

    def copy_kv_prefixes(self, copies: np.ndarray):
        """Start blocks of requests whose prefix hit ends inside a cached block: the leading tokens'
        KV of each source block ([3, C]: sources, destinations, tokens), every layer, before the
        step's forward on the same stream (the sources' KV was written by steps launched before;
        the block manager keeps the sources from reuse until this step is launched)."""
        if self._copy_kernel is not None:
            self._copy_kernel(self.kv_cache, self.stage(copies)[0], int(copies[2].max()))
            return
        kv = self.kv_cache
        for src, dst, n in copies.T.tolist():
            kv[:, :, dst, :n] = kv[:, :, src, :n]

    def _pending_tokens(self) -> torch.Tensor:
        """The previous step's sampled tokens, which this step's pending inputs index. Only rank 0
        samples: with tensor parallelism it sends them to the other ranks through the device, so
        that no rank waits for the host to learn them."""
        if tp_size() == 1:
            return self._last_sampled
        if self._tp_sampled is None:
            self._tp_sampled = torch.zeros(self.config.max_num_seqs, dtype=torch.int64, device=self.device)
        if tp_rank() == 0:
            self._tp_sampled[:self._last_sampled.shape[0]].copy_(self._last_sampled)
        return broadcast_from_rank0(self._tp_sampled)

    def _sampling_metadata(self, seqs: list[Sequence], drafts: list[list[int]] | None = None) -> SamplingMetadata:
        """The eager sampler's parameters for seqs, as of now (before this step's tokens are pending);
        with drafts, for each of seqs' verified positions (build_sampling_metadata)."""
        return build_sampling_metadata(seqs, self.device, self.eos_token_ids, self.config.hf_config.vocab_size,
                                       self._last_sampled, self._last_row_of_seq, stage=self.stage, drafts=drafts)

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor, meta: SamplingMetadata,
              verifies: bool = False) -> SamplerOutput:
        """The eager sampler (any parameters) on this step's logits. A verification step's
        tokens are read by the host before the next step: no later step takes its inputs from them."""
        sampled = self.sampler.sample(logits, meta)
        if verifies:
            self.forget_sampled()
            return sampled
        if self.graph_runner is not None:
            # Where the graphs look for the previous step's tokens (prev_rows index this buffer).
            sampled.token_ids = self.graph_runner.sampled[:len(seqs)].copy_(sampled.token_ids)
        self._remember_sampled(seqs, sampled.token_ids)
        return sampled

    def _remember_sampled(self, seqs: list[Sequence], tokens: torch.Tensor):
        """The next step reads its pending inputs from `tokens` on the device: row i is seqs[i]'s."""
        self._last_sampled = tokens
        self._last_row_of_seq = dict(zip(map(_seq_id, seqs), range(len(seqs))))

    def forget_sampled(self):
        """No step's inputs are pending on the last samples (after a verification step or a start-up run)."""
        self._last_sampled, self._last_row_of_seq = None, {}

    def _execute_graphed_decode(self, seqs: list[Sequence], defer_sampling: bool) -> StepOutput:
        """A pure decode step on one device: inputs filled into the graphs' pinned buffer and sent
        in one copy, then the forward graph and (for plain sampling) the sampling graph."""
        g = self.graph_runner
        n = len(seqs)
        bs = g.padded_size(n)
        fill_decode_inputs(g.inputs.host(), seqs, bs, self.block_size, self._last_row_of_seq)
        g.send_inputs(bs)
        plain = all(map(_plain_sampling, seqs))
        g.replay(bs, sample=plain and not defer_sampling)
        logits = g.logits[:n]
        meta = None if plain else self._sampling_metadata(seqs)
        if defer_sampling:
            return StepOutput(seqs, None, deferred=DeferredDraw(logits, meta, bs, self._forward_done()))
        if not plain:
            return StepOutput(seqs, self._draw(seqs, logits, meta), ring=self._token_ring)
        self._remember_sampled(seqs, g.sampled)
        return StepOutput(seqs, None, *self._token_ring.copy(g.sampled[:n]))

    def release_graphs(self):
        """Free the captured CUDA graphs; eager steps remain possible. A tensor-parallel rank must
        do this before it leaves the process group: NCCL cannot destroy a communicator whose
        collectives a live graph still holds, and the call hangs (pytorch/pytorch#115388)."""
        if self.graph_runner is None and self.piecewise is None:
            return
        torch.cuda.synchronize(self.device)
        for graphs in (self.graph_runner, self.piecewise, self.verify_graphs):
            if graphs is not None:
                graphs.reset()
        self.graph_runner = self.piecewise = self.verify_graphs = None

    def shutdown(self):
        """Release the device memory this runner holds (the model, the cache, the graphs)."""
        self.release_graphs()
        for attn in self.model.attention_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
        self.kv_cache = self._last_sampled = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
