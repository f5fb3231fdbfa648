"""CUDA graphs for decode steps: the whole model forward replayed as one launch.

One graph per batch size of a ladder up to max_num_seqs, captured largest first into one shared
memory pool. Inputs live in static buffers; a batch is padded up to the next captured size with
rows the kernels skip (slot -1, context length 0).
"""
import torch

from nanovllm.attention.base import AttentionMetadata


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class CUDAGraphRunner:
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, hidden_size: int, dtype, device,
                 max_model_len: int):
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_seqs=bs, num_decodes=bs, slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], max_query_len=1, max_seq_len=self.max_model_len,
            max_seq_len_bound=self.max_model_len, decode_order=self.decode_order[:bs])

    @torch.inference_mode()
    def capture(self):
        for bs in reversed(self.batch_sizes):
            meta = self._meta(bs)
            # Warm-up outside the graph: compiles kernels and settles allocator state.
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and num_seqs <= self.max_bs and bool(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.seq_lens[:n] = meta.seq_lens
        if meta.decode_order is not None:
            self.decode_order[:n] = meta.decode_order
        else:
            self.decode_order[:n] = self.row_ids[:n]
        if bs > n:
            self.slot_mapping[n:bs] = -1
            self.seq_lens[n:bs] = 0
            self.decode_order[n:bs] = self.row_ids[n:bs]  # padding rows (empty) go last
        nb = meta.block_tables.shape[1]
        self.block_tables[:n, :nb] = meta.block_tables
        self.graphs[bs].replay()
        return self.hidden[:n]
