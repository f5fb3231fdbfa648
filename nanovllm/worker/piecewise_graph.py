"""CUDA graphs for the steps the decode graphs cannot take (prefills, chunks, mixed batches): the
forward pass cut at each attention call into pieces that are replayed as graphs, with attention
run eagerly between them.

An eager prefill step launches ~300 kernels through Python; on the H200's host that takes 17-40 ms
whatever the token count, more than the device needs for a step of fewer than ~16k tokens (a
128-token prompt: ~20 ms of launches for well under 1 ms of work). Attention cannot be captured:
its grid follows the step's sequences. Everything else depends only on the number of tokens, so
for a ladder of token counts (`token_buckets`) the model is captured once per count with a
stand-in attention backend (`_GraphSplitter`) that ends the current graph at each layer's
attention and starts the next one. A step pads its tokens up to the next captured count (padding
rows have cache slot -1: their keys and values are never stored, and rows never mix outside
attention) and runs: piece 0, attention of layer 0, piece 1, ..., the last piece.

The pieces read the step's ids, positions and slots from static buffers, the rotary kernels
write q into a static buffer (`AttentionMetadata.q_out`), and attention writes its output into
another, so the eager attention between two pieces finds its inputs and leaves its output where
the graphs look. All counts share one memory pool, captured largest first.
"""
import os

import torch

from nanovllm.attention.base import AttentionMetadata

# NANOVLLM_PIECEWISE_GRAPHS=0 keeps these steps eager (A/B runs).
ENABLED = os.environ.get("NANOVLLM_PIECEWISE_GRAPHS", "1") != "0"


def token_buckets(max_tokens: int) -> list[int]:
    """The captured token counts: powers of two from 16 to 2048, then every 1024 tokens (padding a
    large step costs compute: under 1024 rows, ~6% at 16k; every 2048 past 32k, ...), and
    max_tokens itself."""
    small = [b for b in (16, 32, 64, 128, 256, 512, 1024, 2048) if b < max_tokens]
    step = 1024 * max(1, max_tokens // 16384)
    large = list(range(2048 + step, max_tokens, step))
    return small + large + [max_tokens]


def bucket_for(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest captured count that holds num_tokens, or None past the largest."""
    return next((b for b in buckets if b >= num_tokens), None)


class _GraphSplitter:
    """Stands in for the attention backend while the model runs a capture: at each attention call
    it ends the graph being captured and begins the next, and returns the static output buffer
    that the real attention will fill at replay. Outside a capture (the warm-up run that compiles
    the kernels and sets up cuBLAS for this count) it only returns the buffer."""

    fuses_kv_store = True

    def __init__(self, attn_out: torch.Tensor, pool):
        self.attn_out = attn_out
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.capturing = False

    def begin(self):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)
        self.capturing = True

    def end(self):
        self.graphs[-1].capture_end()
        self.capturing = False

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, kv_stored=False, out=None, kv_scales=None):
        assert kv_stored and q.data_ptr() == meta.q_out.data_ptr(), "q must be in the static q buffer"
        if self.capturing:
            self.end()
            self.begin()
        return self.attn_out[:q.shape[0]]


class PiecewiseGraphs:
    """The pieces of every captured token count, their static buffers and one memory pool; `forward`
    stands in for the model's forward on the eager steps of one GPU."""

    def __init__(self, model, max_tokens: int, num_q_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.model = model
        self.attention_layers = model.attention_layers
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = max_tokens
        i64 = torch.int64
        self.input_ids = torch.zeros(max_tokens, dtype=i64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=i64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=i64, device=device)
        self.q = torch.zeros(max_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros(max_tokens, num_q_heads, head_dim, dtype=dtype, device=device)
        hidden_size = model.config.hidden_size
        self.hidden = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self._placeholder = torch.zeros(2, dtype=torch.int32, device=device)
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = None

    def _capture_meta(self, n: int) -> AttentionMetadata:
        # Only slot_mapping and q_out reach the pieces; attention is the splitter's.
        p = self._placeholder
        return AttentionMetadata(num_seqs=1, num_decodes=0, slot_mapping=self.slot_mapping[:n],
                                 query_start_loc=p, seq_lens=p[:1], block_tables=p[:1].view(1, 1),
                                 max_query_len=n, max_seq_len=n, q_out=self.q[:n])

    @torch.inference_mode()
    def capture(self):
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()  # one capture stream for all: its cuBLAS workspace is set up once
        saved = [attn.backend for attn in self.attention_layers]
        try:
            for n in reversed(self.buckets):
                self.pieces[n] = self._capture(n, stream)
        finally:
            for attn, backend in zip(self.attention_layers, saved):
                attn.backend = backend
        torch.cuda.synchronize()

    def _capture(self, n: int, stream: torch.cuda.Stream) -> list[torch.cuda.CUDAGraph]:
        splitter = _GraphSplitter(self.attn_out, self.pool)
        for attn in self.attention_layers:
            attn.backend = splitter
        meta = self._capture_meta(n)
        self.model(self.input_ids[:n], self.positions[:n], meta)  # warm-up, outside any graph
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            splitter.begin()
            hidden = self.model(self.input_ids[:n], self.positions[:n], meta)
            self.hidden[:n].copy_(hidden)
            splitter.end()
        torch.cuda.current_stream().wait_stream(stream)
        assert len(splitter.graphs) == len(self.attention_layers) + 1
        return splitter.graphs

    def reset(self):
        """Free every captured piece (see ModelRunner.release_graphs)."""
        for pieces in self.pieces.values():
            for graph in pieces:
                graph.reset()
        self.pieces.clear()

    def can_run(self, num_tokens: int) -> bool:
        return bool(self.pieces) and 0 < num_tokens <= self.max_tokens

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward over the step's tokens; returns hidden states [T, hidden] (a view of
        a static buffer, valid until the next call)."""
        t = input_ids.shape[0]
        n = bucket_for(self.buckets, t)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        if n > t:
            self.slot_mapping[t:n].fill_(-1)  # padding rows: keys and values never stored
        pieces = self.pieces[n]
        q, out = self.q[:t], self.attn_out[:t]
        for piece, attn in zip(pieces, self.attention_layers):
            piece.replay()
            attn.backend.forward(q, None, None, attn.k_cache, attn.v_cache, meta, attn.scale, kv_stored=True, out=out,
                                 kv_scales=attn.kv_scales)
        pieces[-1].replay()
        return self.hidden[:t]
