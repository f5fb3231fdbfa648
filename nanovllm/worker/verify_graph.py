"""CUDA graphs for speculative verification steps: B sequences, each its last token and up to k
drafts, replayed as one launch like a decode step (worker/cuda_graph.py) instead of the piecewise
path's attention launches between pieces.

Captured only when speculative decoding is on (one device, CUDA graphs allowed), for a ladder of
batch sizes up to the speculation cutoff (disable_by_batch_size) and one query width Q = k + 1:
every sequence gets a window of Q query rows, read by the multi-query decode kernel
(kernels/paged_decode.py, QUERY_LEN = Q), whose row t sees the keys up to seq_len - Q + t (the
causal mask inside the window). A sequence with n <= Q new tokens (fewer drafts, or none: a plain
decode row of the same step) fills the LAST n rows of its window with seq_len its true context
length, so each real row sees exactly its own context; the rows before are padding: cache slot
-1 (nothing stored), a position inside the context, output discarded (a row before the context's
start sees no key and gives zeros). Padding sequences have context length 0.

A step fits when every sequence verifies (or decodes) its last token, no prompt or chunk rides
along, and no input is still in flight (the engine takes in the step in flight before a
verification step). Others run the general path. The graphs write the logits of all B x Q rows;
the step's real rows are gathered (in each sequence's order: its last token, then one per draft)
for the eager sampler, which draws every verified position as plain decoding would.
"""
from itertools import chain

import numpy as np
import torch

from nanovllm.attention.base import AttentionMetadata
from nanovllm.worker.cuda_graph import PackedInputs, batch_size_ladder
from nanovllm.worker.inputs import write_block_tables


def verify_step_fits(batch, query_len: int, max_bs: int) -> bool:
    """Whether a scheduled batch is a verification step the graphs take (see the module doc)."""
    spec = batch.spec
    if spec is None or len(batch.seqs) > max_bs:
        return False
    for seq, n, drafts in zip(batch.seqs, batch.num_new_tokens, spec):
        if n != len(drafts) + 1 or n > query_len or seq.num_computed_tokens + 1 != seq.num_tokens \
                or seq.num_pending_tokens:
            return False
    return True


def fill_verify_inputs(views: dict[str, np.ndarray], batch, padded: int, query_len: int, block_size: int) -> int:
    """A fitting verification step's inputs in the graphs' layout, written into views (1-D arrays of
    at least padded * query_len rows; seq_lens, decode_order and block_tables by sequence). Writes
    `logits_rows`, the real rows in order, and returns how many there are."""
    seqs, spec, q = batch.seqs, batch.spec, query_len
    n = len(seqs)
    counts = batch.num_new_tokens
    seq_lens = np.fromiter((s.num_computed_tokens + c for s, c in zip(seqs, counts)), np.int64, n)
    views["seq_lens"][:n] = seq_lens
    block_tables = views["block_tables"]
    write_block_tables(block_tables, [s.block_table for s in seqs])
    # Every window full (each sequence verifies q - 1 drafts, the usual step): no padding rows to mask.
    full = min(counts) == q

    # Window column c of sequence i holds position seq_len - Q + c; its last counts[i] columns are real.
    positions = seq_lens[:, None] + np.arange(-q, 0)                                 # [n, Q]
    if not full:
        real = positions >= (seq_lens - np.asarray(counts, dtype=np.int64))[:, None]
        np.maximum(positions, 0, out=positions)
    pos = views["positions"][:padded * q].reshape(padded, q)
    pos[:n] = positions
    slots = views["slot_mapping"][:padded * q].reshape(padded, q)
    block_of_position, offset_in_block = np.divmod(positions, block_size)
    real_slots = slots[:n]
    np.multiply(block_tables[np.arange(n)[:, None], block_of_position], block_size, out=real_slots, dtype=np.int64)
    real_slots += offset_in_block
    ids = views["input_ids"][:padded * q].reshape(padded, q)
    new_ids = np.fromiter(chain.from_iterable(s.token_ids[s.num_computed_tokens:] + d for s, d in zip(seqs, spec)),
                          np.int64, sum(counts))
    if full:
        ids[:n] = new_ids.reshape(n, q)
        num_rows = n * q
        views["logits_rows"][:num_rows] = np.arange(num_rows)
    else:
        slots[:n][~real] = -1
        ids[:n] = 0
        ids[:n][real] = new_ids
        rows = np.flatnonzero(real)
        num_rows = rows.size
        views["logits_rows"][:num_rows] = rows
    if padded > n:  # padding sequences: context length 0, nothing stored
        views["seq_lens"][n:padded] = 0
        pos[n:] = 0
        slots[n:] = -1
        ids[n:] = 0
        views["decode_order"][n:padded] = np.arange(n, padded)
    # Longest context first, ties in batch order; a Python sort of a few ints is cheaper than argsort's numpy calls.
    views["decode_order"][:n] = sorted(range(n), key=seq_lens.item, reverse=True)
    return num_rows


def verify_metadata(static: dict[str, torch.Tensor], query_start_loc: torch.Tensor, bs: int, query_len: int,
                    max_model_len: int, seq_lens_host: list[int] | None = None) -> AttentionMetadata:
    """The attention metadata of a bs-sequence verification step read from static buffers (those
    fill_verify_inputs writes): every sequence a decode of query_len rows. seq_lens_host: for a
    backend that loops over the sequences on the host (the torch backend; never in a graph)."""
    return AttentionMetadata(
        num_seqs=bs, num_decodes=bs, slot_mapping=static["slot_mapping"][:bs * query_len],
        query_start_loc=query_start_loc[:bs + 1], seq_lens=static["seq_lens"][:bs],
        block_tables=static["block_tables"][:bs], max_query_len=query_len, max_seq_len=max_model_len,
        max_seq_len_bound=max_model_len, decode_order=static["decode_order"][:bs], decode_query_len=query_len,
        seq_lens_host=seq_lens_host)


class VerifyGraphRunner:
    def __init__(self, model, max_bs: int, query_len: int, max_blocks_per_seq: int, vocab_size: int, dtype, device,
                 max_model_len: int, pool=None):
        """pool: a graph memory pool to share (the decode graphs': steps replay one at a time)."""
        self.model = model
        self.max_bs, self.query_len, self.max_model_len = max_bs, query_len, max_model_len
        self.batch_sizes = batch_size_ladder(max_bs)
        rows = max_bs * query_len
        i64, i32 = torch.int64, torch.int32
        # Block tables last: a step sends only the rows it uses.
        self.inputs = PackedInputs({
            "input_ids": (i64, (rows,)), "positions": (i64, (rows,)), "slot_mapping": (i64, (rows,)),
            "logits_rows": (i64, (rows,)), "seq_lens": (i32, (max_bs,)), "decode_order": (i32, (max_bs,)),
            "block_tables": (i32, (max_bs, max_blocks_per_seq)),
        }, device)
        self.block_table_row_bytes = max_blocks_per_seq * 4
        self.static = self.inputs.device
        self.static["slot_mapping"].fill_(-1)
        self.static["decode_order"].copy_(torch.arange(max_bs, dtype=i32, device=device))
        self.query_start_loc = torch.arange(0, rows + 1, query_len, dtype=i32, device=device)
        self.logits = torch.zeros(rows, vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self.replays = 0  # verification steps run from a graph (tests read it)

    def _forward(self, bs: int):
        t, s = bs * self.query_len, self.static
        meta = verify_metadata(s, self.query_start_loc, bs, self.query_len, self.max_model_len)
        hidden = self.model(s["input_ids"][:t], s["positions"][:t], meta)
        self.model.compute_logits(hidden, out=self.logits[:t])

    @torch.inference_mode()
    def capture(self):
        for bs in reversed(self.batch_sizes):
            self._forward(bs)  # warm-up outside the graph: compiles the QUERY_LEN kernels, settles the allocator
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def reset(self):
        """Free every captured graph (see ModelRunner.release_graphs)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def fits(self, batch) -> bool:
        return bool(self.graphs) and verify_step_fits(batch, self.query_len, self.max_bs)

    def run(self, batch, block_size: int) -> torch.Tensor:
        """Replay the graph of a fitting batch (`fits`); returns the logits of its real rows [R, V]
        in a fresh tensor (the static buffer is the next step's)."""
        bs = next(b for b in self.batch_sizes if b >= len(batch.seqs))
        num_rows = fill_verify_inputs(self.inputs.host(), batch, bs, self.query_len, block_size)
        self.inputs.send(self.inputs.offsets["block_tables"] + bs * self.block_table_row_bytes)
        self.graphs[bs].replay()
        self.replays += 1
        return self.logits.index_select(0, self.static["logits_rows"][:num_rows])
