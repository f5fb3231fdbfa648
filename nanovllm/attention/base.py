"""The seam between the engine and attention kernels.

The model runner builds one `AttentionMetadata` per step and passes it down the model explicitly;
each attention layer hands its q/k/v, its slice of the paged KV cache and the metadata to the
backend. Backends differ only in kernels, so the engine reads the same on CPU and GPU.
"""
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # Sequences are ordered with the decodes first: decode_query_len query tokens each (1, or a
    # speculative verification step's last token and drafts in a CUDA graph of that width).
    num_seqs: int
    num_decodes: int
    slot_mapping: torch.Tensor      # [num_tokens] int64: cache slot of each new token (-1: skip)
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor          # [num_seqs] int32: context length after this step
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32
    max_query_len: int
    max_seq_len: int
    # Host copies of the ragged layout, for backends that loop over sequences on the host.
    query_start_loc_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # query_start_loc of the sequences after the decodes, rebased to start at 0.
    prefill_query_start_loc: torch.Tensor | None = None
    # Longest context any sequence may reach: a fixed bound for kernels captured in CUDA graphs.
    max_seq_len_bound: int | None = None
    # [num_decodes] int32: the decode rows by descending context length, so that kernels can
    # start the longest first (a permutation; any order gives the same result).
    decode_order: torch.Tensor | None = None
    # [num_tokens, Hq, D]: where the model's rotary kernels write q, so that attention between two
    # piecewise CUDA graphs (worker/piecewise_graph.py) finds it at a fixed address. None: fresh memory.
    q_out: torch.Tensor | None = None
    # The torch backend's decode layout for this step (cache rows to gather, key mask), built by the
    # first layer that needs it and reused by the others: the same for every layer of a step.
    decode_gather: tuple[torch.Tensor, torch.Tensor] | None = None
    # Query tokens of each decode row, the newest last (causal among them).
    decode_query_len: int = 1
    # The Triton backend's kernel launches for this step, recorded by the first layer and replayed
    # by the others with their own tensors (kernels/replay.py): kind -> (layout key, launches).
    launches: dict | None = None

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.decode_query_len


# An FP8 KV cache's per-KV-head scales (k_scale, v_scale), fp32 [Hkv]: the cache holds k / k_scale.
KVScales = tuple[torch.Tensor, torch.Tensor]


class AttentionBackend(ABC):
    name: str = "base"
    supports_cuda_graphs: bool = False
    # True: the backend reads the new tokens' K/V only from the cache, and the model should write
    # them there itself, in its Triton rotary kernel (a launch less per layer), then call forward
    # with kv_stored=True.
    fuses_kv_store: bool = False

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_stored: bool = False,
                out: torch.Tensor | None = None, kv_scales: KVScales | None = None) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] for the new tokens; caches: [num_blocks, block_size,
        Hkv, D]. Stores k/v at meta.slot_mapping (unless kv_stored: they are there already, and
        k/v may be None), then attends each new token to its sequence's context: the decode rows
        (first in the batch) with `decode`, the rest with `prefill`. Returns [T, Hq, D], written
        into `out` when given (q's shape and dtype). kv_scales: for FP8 caches (float8_e4m3fn),
        the (k_scale, v_scale) [Hkv] the cache holds k and v divided by; None for a cache in q's dtype."""
        if not kv_stored:
            self.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        if out is None:
            out = torch.empty_like(q)
        else:
            assert out.shape == q.shape and out.dtype == q.dtype, (out.shape, q.shape)
        nt = meta.num_decode_tokens
        if nt:
            self.decode(q[:nt], k_cache, v_cache, meta, scale, out[:nt], kv_scales)
        if meta.num_decodes < meta.num_seqs:
            self.prefill(q[nt:], k_cache, v_cache, meta, scale, out[nt:], kv_scales)
        return out

    @abstractmethod
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, kv_scales: KVScales | None = None):
        """Write k/v [T, Hkv, D] into the caches at slot_mapping (slots < 0: padding, skipped)."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, out: torch.Tensor, kv_scales: KVScales | None = None):
        """q/out: [num_decode_tokens, Hq, D], decode_query_len tokens per sequence (the batch's first
        sequences), each attending to its context up to its own position."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, out: torch.Tensor, kv_scales: KVScales | None = None):
        """q/out: the tokens of the sequences after the decodes (chunks, prefix hits, prompts)."""

    def setup(self, max_num_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
              max_model_len: int, device: torch.device, max_decode_query_len: int = 1):
        """Called once at start-up with the largest shapes, to preallocate work buffers."""

