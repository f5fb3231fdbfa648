"""CUDA graphs for decode steps: the whole model forward replayed as one launch.

One graph per batch size of a ladder up to max_num_seqs, captured largest first into one shared
memory pool. Inputs live in static buffers; a batch is padded up to the next captured size with
rows the kernels skip (slot -1, context length 0).

Large batches are captured as two half-batch forwards on two streams (two branches of one graph).
A decode step alternates between memory-bound attention and latency-bound work (small GEMMs,
norms, rope: each kernel too short to keep the memory system busy); with two independent halves
the GPU runs one half's attention while the other half is in its latency-bound stretch. The price
is reading the weights twice per step, small next to the KV cache at these batch sizes.
"""
import torch

from nanovllm.attention.base import AttentionMetadata

TWO_STREAM_MIN_BATCH = 128  # captured sizes from here on run as two halves (single-GPU only)


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class CUDAGraphRunner:
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, hidden_size: int, dtype, device,
                 max_model_len: int, two_streams: bool = True):
        self.model = model
        self.max_bs = max_bs
        self.max_model_len = max_model_len
        self.batch_sizes = batch_size_ladder(max_bs)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.row_ids = torch.arange(max_bs, dtype=torch.int32, device=device)
        self.decode_order = self.row_ids.clone()
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.side_stream = torch.cuda.Stream(device) if two_streams else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def padded_size(self, num_seqs: int) -> int:
        return next(b for b in self.batch_sizes if b >= num_seqs)

    def split_point(self, num_decodes: int) -> int | None:
        """For a decode batch this runner will run: the first row of its second half, or None
        when its graph is a single forward. Host inputs order the halves' rows separately."""
        if self.side_stream is None or not 0 < num_decodes <= self.max_bs:
            return None
        bs = self.padded_size(num_decodes)
        return bs // 2 if bs >= TWO_STREAM_MIN_BATCH else None

    def _meta(self, lo: int, hi: int, slot: int = 0) -> AttentionMetadata:
        n = hi - lo
        return AttentionMetadata(
            num_seqs=n, num_decodes=n, slot_mapping=self.slot_mapping[lo:hi],
            query_start_loc=self.query_start_loc[:n + 1], seq_lens=self.seq_lens[lo:hi],
            block_tables=self.block_tables[lo:hi], max_query_len=1, max_seq_len=self.max_model_len,
            max_seq_len_bound=self.max_model_len, decode_order=self.decode_order[lo:hi], workspace_slot=slot)

    def _forward(self, bs: int):
        h = self.split_point(bs)
        if h is None:
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(0, bs))
            return
        main = torch.cuda.current_stream()
        self.side_stream.wait_stream(main)
        self.hidden[:h] = self.model(self.input_ids[:h], self.positions[:h], self._meta(0, h, 0))
        with torch.cuda.stream(self.side_stream):
            self.hidden[h:bs] = self.model(self.input_ids[h:bs], self.positions[h:bs], self._meta(h, bs, 1))
        main.wait_stream(self.side_stream)

    @torch.inference_mode()
    def capture(self):
        for bs in reversed(self.batch_sizes):
            # Warm-up outside the graph: compiles kernels and settles allocator state.
            self._forward(bs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and num_seqs <= self.max_bs and bool(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        bs = self.padded_size(n)
        h = self.split_point(n)
        assert meta.decode_order is not None and meta.decode_order_split == h, (meta.decode_order_split, h)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.seq_lens[:n] = meta.seq_lens
        self.decode_order[:n] = meta.decode_order
        if bs > n:
            self.slot_mapping[n:bs] = -1
            self.seq_lens[n:bs] = 0
            # Padding rows (empty) go last in their half's order.
            if h is None:
                self.decode_order[n:bs] = self.row_ids[n:bs]
            elif n >= h:
                self.decode_order[n:bs] = self.row_ids[n - h:bs - h]
            else:
                self.decode_order[n:h] = self.row_ids[n:h]
                self.decode_order[h:bs] = self.row_ids[:bs - h]
        nb = meta.block_tables.shape[1]
        self.block_tables[:n, :nb] = meta.block_tables
        self.graphs[bs].replay()
        return self.hidden[:n]
