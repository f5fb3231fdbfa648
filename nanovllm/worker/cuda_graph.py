"""CUDA graphs for decode steps: the forward pass, the LM head and the sampler replayed as launches.

For each batch size of a ladder up to max_num_seqs, two graphs are captured at start-up into one
memory pool, largest first:
- `forward`: input ids -> model -> LM head, into the static `logits` buffer;
- `sample`: the default draw (temperature or greedy, per-request seeds) from `logits` into the
  static `sampled` buffer; and `masked_sample`, the same draw under grammar bitmasks (structured
  outputs), read from the runner's `BitmaskBuffers`. A batch that needs more of the sampler
  (filters, penalties, logprobs, min_tokens) replays `forward` only and runs the eager sampler on
  `logits`. A batch under grammars replays `forward` first and its draw once the host has filled
  the masks (worker/model_runner.py), so the two are separate graphs.

The graphs read their inputs from static buffers packed into ONE device allocation
(`PackedInputs`): the host fills a pinned twin and sends it in one copy, so a decode step costs a
handful of API calls whatever the model. A decode input that is the token its sequence drew in
the previous step (the host has not read it yet: steps overlap) is taken from `sampled` inside
the graph (`prev_rows`). Batches are padded up to the next captured size with rows the kernels
skip (slot -1, context length 0).
"""
import numpy as np
import torch

from nanovllm.attention.base import AttentionMetadata
from nanovllm.worker.inputs import TransferSlots


def batch_size_ladder(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs, 16))
    return sorted(set(sizes + [max_bs]))


class PackedInputs:
    """Named device buffers in one allocation, with pinned host twins used in rotation: `host()`
    gives numpy views of a twin to fill, `send(nbytes)` copies its first nbytes to the device
    asynchronously. A twin is refilled only after its previous copy has completed."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device,
                 num_host_buffers: int = 3):
        self.offsets, self._sizes, total = {}, {}, 0
        for name, (dtype, shape) in fields.items():
            self.offsets[name] = total
            self._sizes[name] = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
            total += -(-self._sizes[name] // 16) * 16  # 16-byte alignment for every view
        self.nbytes = total
        self.device_buffer = torch.zeros(total, dtype=torch.uint8, device=device)
        self.device = {name: self._view(self.device_buffer, name, dtype, shape)
                       for name, (dtype, shape) in fields.items()}
        self._host_buffers = [torch.zeros(total, dtype=torch.uint8, pin_memory=True) for _ in range(num_host_buffers)]
        self._host_views = [{name: self._view(buf, name, dtype, shape).numpy()
                             for name, (dtype, shape) in fields.items()} for buf in self._host_buffers]
        self._slots = TransferSlots(num_host_buffers)
        self._current = 0

    def _view(self, buffer, name, dtype, shape):
        start = self.offsets[name]
        return buffer[start:start + self._sizes[name]].view(dtype).view(shape)

    def host(self) -> dict[str, np.ndarray]:
        self._current = self._slots.take()
        return self._host_views[self._current]

    def send(self, nbytes: int):
        i = self._current
        self.device_buffer[:nbytes].copy_(self._host_buffers[i][:nbytes], non_blocking=True)
        self._slots.copied(i)


class CUDAGraphRunner:
    def __init__(self, model, max_bs: int, max_blocks_per_seq: int, vocab_size: int, dtype, device,
                 max_model_len: int, capture_sampler: bool, bitmasks=None):
        self.model = model
        self.max_bs = max_bs
        self.max_model_len = max_model_len
        self.batch_sizes = batch_size_ladder(max_bs)
        i64, i32 = torch.int64, torch.int32
        # Block tables last: a step sends only the rows it uses.
        self.inputs = PackedInputs({
            "input_ids": (i64, (max_bs,)), "prev_rows": (i64, (max_bs,)), "positions": (i64, (max_bs,)),
            "slot_mapping": (i64, (max_bs,)), "seeds": (i64, (max_bs,)), "offsets": (i64, (max_bs,)),
            "seq_lens": (i32, (max_bs,)), "decode_order": (i32, (max_bs,)),
            "temperatures": (torch.float32, (max_bs,)), "block_tables": (i32, (max_bs, max_blocks_per_seq)),
        }, device)
        self.block_table_row_bytes = max_blocks_per_seq * 4
        self.static = self.inputs.device
        self.static["slot_mapping"].fill_(-1)
        self.static["prev_rows"].fill_(-1)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=i32, device=device)
        self.row_ids = torch.arange(max_bs, dtype=i32, device=device)
        self.logits = torch.zeros(max_bs, vocab_size, dtype=dtype, device=device)
        self.sampled = torch.zeros(max_bs, dtype=i64, device=device)
        self.capture_sampler = capture_sampler
        self.bitmasks = bitmasks  # worker/grammar_masks.BitmaskBuffers: masked_sample's masks
        self.forward_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.masked_sample_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(
            num_seqs=bs, num_decodes=bs, slot_mapping=s["slot_mapping"][:bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=s["seq_lens"][:bs],
            block_tables=s["block_tables"][:bs], max_query_len=1, max_seq_len=self.max_model_len,
            max_seq_len_bound=self.max_model_len, decode_order=s["decode_order"][:bs])

    def _forward(self, bs: int):
        from nanovllm.kernels.sample import resolve_input_ids
        s = self.static
        ids = resolve_input_ids(s["input_ids"][:bs], s["prev_rows"][:bs], self.sampled)
        hidden = self.model(ids, s["positions"][:bs], self._meta(bs))
        self.model.compute_logits(hidden, out=self.logits[:bs])

    def _sample(self, bs: int):
        from nanovllm.kernels.sample import sample_rows
        s = self.static
        sample_rows(self.logits[:bs], s["temperatures"][:bs], None, out=self.sampled[:bs],
                    seeds=s["seeds"][:bs], offsets=s["offsets"][:bs])

    def _masked_sample(self, bs: int):
        from nanovllm.kernels.sample import sample_rows
        s, m = self.static, self.bitmasks.static
        sample_rows(self.logits[:bs], s["temperatures"][:bs], None, out=self.sampled[:bs],
                    seeds=s["seeds"][:bs], offsets=s["offsets"][:bs], mask_rows=m["mask_rows"][:bs], masks=m["masks"])

    def _capture(self, fn, bs: int) -> torch.cuda.CUDAGraph:
        fn(bs)  # warm-up outside the graph: compiles kernels and settles allocator state
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, self.pool):
            fn(bs)
        if self.pool is None:
            self.pool = graph.pool()
        return graph

    @torch.inference_mode()
    def capture(self):
        for bs in reversed(self.batch_sizes):
            self.forward_graphs[bs] = self._capture(self._forward, bs)
            if self.capture_sampler:
                self.sample_graphs[bs] = self._capture(self._sample, bs)
                if self.bitmasks is not None:
                    self.masked_sample_graphs[bs] = self._capture(self._masked_sample, bs)
        torch.cuda.synchronize()

    def reset(self):
        """Free every captured graph (see ModelRunner.release_graphs)."""
        graphs = (self.forward_graphs, self.sample_graphs, self.masked_sample_graphs)
        for graph in [g for family in graphs for g in family.values()]:
            graph.reset()
        for family in graphs:
            family.clear()

    def can_run(self, num_seqs: int, num_decodes: int) -> bool:
        return num_seqs == num_decodes and num_seqs <= self.max_bs and bool(self.forward_graphs)

    def padded_size(self, n: int) -> int:
        return next(b for b in self.batch_sizes if b >= n)

    # ---- the fast path: inputs filled on the host by fill_decode_inputs -----------------
    def send_inputs(self, bs: int):
        self.inputs.send(self.inputs.offsets["block_tables"] + bs * self.block_table_row_bytes)

    def replay(self, bs: int, sample: bool):
        """Forward (and the default draw) over the inputs sent; logits[:bs] / sampled[:bs] hold the results."""
        self.forward_graphs[bs].replay()
        if sample:
            self.sample_graphs[bs].replay()

    def replay_sample(self, bs: int, masked: bool):
        """The default draw alone (after `replay(bs, sample=False)`), under the masks sent if masked."""
        (self.masked_sample_graphs if masked else self.sample_graphs)[bs].replay()

    # ---- the general path: inputs already on the device (tensor-parallel ranks) ---------
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copies the inputs into the static buffers, replays `forward`; returns logits [n, V]."""
        n = meta.num_seqs
        bs = self.padded_size(n)
        s = self.static
        s["input_ids"][:n] = input_ids
        s["positions"][:n] = positions
        s["slot_mapping"][:n] = meta.slot_mapping
        s["seq_lens"][:n] = meta.seq_lens
        s["prev_rows"][:bs] = -1
        if meta.decode_order is not None:
            s["decode_order"][:n] = meta.decode_order
        else:
            s["decode_order"][:n] = self.row_ids[:n]
        if bs > n:
            s["slot_mapping"][n:bs] = -1
            s["seq_lens"][n:bs] = 0
            s["decode_order"][n:bs] = self.row_ids[n:bs]  # padding rows (empty) go last
        nb = meta.block_tables.shape[1]
        s["block_tables"][:n, :nb] = meta.block_tables
        self.forward_graphs[bs].replay()
        return self.logits[:n]
