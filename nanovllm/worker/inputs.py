"""Turn a scheduled batch into the flat tensors one forward pass needs.

Two stages: `build_host_inputs` makes plain numpy arrays (cheap to send to tensor-parallel
workers), `to_device` moves them to the GPU asynchronously from pinned memory.
"""
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from nanovllm.attention.base import AttentionMetadata
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import GREEDY_BELOW


@dataclass
class HostInputs:
    input_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64
    slot_mapping: np.ndarray     # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int32
    seq_lens: np.ndarray         # [S] int32
    block_tables: np.ndarray     # [S, max_blocks] int32
    num_decodes: int
    logits_indices: np.ndarray   # rows of the hidden states to sample from
    sample_rows: list[int]       # which sequences of the batch sample this step
    # Speculative verification: the draft tokens of each sampling sequence (its rows of
    # logits_indices: its last len + 1 tokens), or None when the step verifies none.
    sample_drafts: list[list[int]] | None = None
    # Inputs sampled by the previous step and not yet seen by the host: input_ids[dst] = last[src].
    pending_dst: np.ndarray | None = None
    pending_src: np.ndarray | None = None
    decode_order: np.ndarray | None = None  # [num_decodes] int32: decode rows, longest context first
    kv_copies: np.ndarray | None = None  # [3, C] int64: source blocks, destination blocks, leading tokens


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    sample_rows: list[int]
    pending_dst: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None


def build_host_inputs(batch: ScheduledBatch, block_size: int,
                      last_row_of_seq: dict[int, int] | None = None) -> HostInputs:
    # Vectorised over sequences where it matters: a decode step of hundreds of sequences must
    # cost far less host time than the device spends on it.
    seqs, counts, spec = batch.seqs, batch.num_new_tokens, batch.spec
    num_seqs, nd = len(seqs), batch.num_decodes
    computed = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
    num_tokens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, num_seqs)
    num_drafts = None
    if spec is not None:  # a sequence's drafts follow its tokens
        num_drafts = np.fromiter(map(len, spec), np.int64, num_seqs)
        num_tokens += num_drafts
    new = np.asarray(counts, dtype=np.int64)
    seq_lens = computed + new

    tables = [s.block_table for s in seqs]
    block_tables = np.zeros((num_seqs, max(map(len, tables))), dtype=np.int32)
    write_block_tables(block_tables, tables)

    # Decodes: one token each, possibly a placeholder for the previous step's sample.
    decode_ids = np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs[:nd]), np.int64, nd)
    pending = np.flatnonzero(decode_ids < 0)
    decode_ids[pending] = 0
    parts_ids, parts_pos = [decode_ids], [computed[:nd]]
    for i, (seq, start, n) in enumerate(zip(seqs[nd:], computed[nd:].tolist(), counts[nd:]), start=nd):
        ids = seq.token_ids[start:start + n]
        if len(ids) < n:  # the drafts after the last token
            ids = ids + spec[i][:n - len(ids)]
        parts_ids.append(np.asarray(ids, dtype=np.int64))
        parts_pos.append(np.arange(start, start + n, dtype=np.int64))
    input_ids = np.concatenate(parts_ids)
    positions = np.concatenate(parts_pos)

    query_start = np.zeros(num_seqs + 1, dtype=np.int32)
    np.cumsum(new, out=query_start[1:])
    sample_rows = np.flatnonzero(seq_lens == num_tokens)
    # slot of position p of sequence i = block_tables[i, p // bs] * bs + p % bs, for all tokens at once
    seq_of_token = np.repeat(np.arange(num_seqs), new)
    slots = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    logits_indices = query_start[1:][sample_rows].astype(np.int64) - 1
    sample_drafts = None
    if spec is not None:  # a verifying sequence samples its last token's row and each draft's
        rows = num_drafts[sample_rows] + 1
        ends = np.repeat(logits_indices, rows)
        within = np.arange(int(rows.sum())) - np.repeat(np.cumsum(rows) - rows, rows)
        logits_indices = ends - np.repeat(rows - 1, rows) + within
        sample_drafts = [spec[i] for i in sample_rows.tolist()]
    return HostInputs(
        input_ids=input_ids, positions=positions, slot_mapping=slots, query_start_loc=query_start,
        seq_lens=seq_lens.astype(np.int32), block_tables=block_tables, num_decodes=nd,
        logits_indices=logits_indices, sample_rows=sample_rows.tolist(), sample_drafts=sample_drafts,
        pending_dst=pending if pending.size else None,
        pending_src=(np.fromiter((last_row_of_seq[seqs[i].seq_id] for i in pending), np.int64, pending.size)
                     if pending.size else None),
        decode_order=np.argsort(-seq_lens[:nd], kind="stable").astype(np.int32) if nd else None,
        kv_copies=kv_copies_array(batch.kv_copies),
    )


# Below this many sequences a block table is written row by row: ~0.3 us a row, against ~4 us plus
# ~0.15 us a row for the one masked write of all of them (numpy 2.4 on the CPU; equal near 40 rows).
_TABLES_ROW_BY_ROW_BELOW = 32


def write_block_tables(out: np.ndarray, tables: list[list[int]]):
    """Write sequence i's block table into the leading entries of out's row i (the entries past it
    are left as they are: attention reads a row only as far as its sequence's length)."""
    if len(tables) < _TABLES_ROW_BY_ROW_BELOW:
        for row, table in zip(out, tables):
            row[:len(table)] = table
        return
    lens = np.fromiter(map(len, tables), np.int64, len(tables))
    width = int(lens.max())
    out[:len(tables), :width][np.arange(width) < lens[:, None]] = np.fromiter(
        chain.from_iterable(tables), np.int32, int(lens.sum()))


def kv_copies_array(copies: list[tuple[int, int, int]]) -> np.ndarray | None:
    """A batch's prefix KV copies as the [3, C] array the copy kernel reads (None: no copies)."""
    return np.ascontiguousarray(np.array(copies, dtype=np.int64).T) if copies else None


SEED_MASK = (1 << 64) - 1  # a seed is any Python int; the noise hash sees its low 64 bits


def fill_decode_inputs(views: dict[str, np.ndarray], seqs: list[Sequence], padded: int, block_size: int,
                       last_row_of_seq: dict[int, int]):
    """A pure decode step's inputs, written straight into the CUDA graphs' packed host buffer
    (`cuda_graph.PackedInputs`): model inputs and the default sampler's per-row parameters, with
    rows n..padded as padding the kernels skip. The step's hot host path: a few passes over the
    sequences and vectorised numpy, no per-step allocations on the device."""
    n = len(seqs)
    pos = views["positions"]
    pos[:n] = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
    ids = views["input_ids"]
    ids[:n] = np.fromiter((s.token_ids[s.num_computed_tokens] for s in seqs), np.int64, n)
    prev = views["prev_rows"]
    prev[:padded] = -1
    pending = np.flatnonzero(ids[:n] < 0)  # drawn by the previous step: read on the device
    if pending.size:
        prev[pending] = np.fromiter((last_row_of_seq[seqs[i].seq_id] for i in pending.tolist()), np.int64,
                                    pending.size)
        ids[pending] = 0
    seq_lens = views["seq_lens"]
    seq_lens[:n] = pos[:n] + 1
    seq_lens[n:padded] = 0

    block_tables = views["block_tables"]
    write_block_tables(block_tables, [s.block_table for s in seqs])
    slots = views["slot_mapping"]
    slots[:n] = block_tables[np.arange(n), pos[:n] // block_size].astype(np.int64) * block_size + pos[:n] % block_size
    slots[n:padded] = -1
    pos[n:padded] = 0
    ids[n:padded] = 0

    order = views["decode_order"]
    order[:n] = np.argsort(-seq_lens[:n], kind="stable")  # longest context first
    order[n:padded] = np.arange(n, padded)

    temps = views["temperatures"]
    temps[:n] = np.fromiter((s.sampling_params.temperature for s in seqs), np.float32, n)
    temps[:n][temps[:n] < GREEDY_BELOW] = 0.0  # greedy rows, as SamplingParams.greedy
    temps[n:padded] = 0.0
    views["seeds"][:n] = np.fromiter((s.seed & SEED_MASK for s in seqs), np.uint64, n).view(np.int64)
    views["offsets"][:n] = np.fromiter((len(s.token_ids) - s.num_prompt_tokens for s in seqs), np.int64, n)
    views["seeds"][n:padded] = 0
    views["offsets"][n:padded] = 0


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


class TransferSlots:
    """Pinned host buffers reused in rotation for asynchronous copies, each guarded by the event
    recorded behind its last copy: `take()` hands out the next slot once that copy is done (long
    done in practice: a slot comes round only every `count` steps), `copied(i)` records the event
    right after slot i's copy has been queued and returns it (to wait for a device-to-host copy)."""

    def __init__(self, count: int):
        self._events = [torch.cuda.Event() for _ in range(count)]
        self._next = 0

    def take(self) -> int:
        i, self._next = self._next, (self._next + 1) % len(self._events)
        self._events[i].synchronize()  # returns at once for a never-recorded event
        return i

    def copied(self, i: int):
        self._events[i].record()
        return self._events[i]


class HostToDevice:
    """Moves a step's host arrays to the device in ONE asynchronous copy: the arrays are packed
    into a reused pinned buffer (`TransferSlots`) and come back as views of one device buffer."""

    def __init__(self, device: torch.device, num_buffers: int = 4):
        self.device = device
        if device.type == "cuda":
            self._slots = TransferSlots(num_buffers)
            self._buffers: list[torch.Tensor | None] = [None] * num_buffers

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // 16) * 16  # 16-byte alignment for every view
        i = self._slots.take()
        buf = self._buffers[i]
        if buf is None or buf.numel() < total:
            buf = self._buffers[i] = torch.empty(max(2 * total, 1 << 16), dtype=torch.uint8, pin_memory=True)
        host = buf.numpy()
        for a, off in zip(arrays, offsets):
            host[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        dev = buf[:total].to(self.device, non_blocking=True)
        self._slots.copied(i)
        return [dev[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for a, off in zip(arrays, offsets)]


def to_device(host: HostInputs, stage: HostToDevice, max_seq_len_bound: int | None = None) -> ForwardBatch:
    num_seqs = len(host.seq_lens)
    nd = host.num_decodes
    counts = np.diff(host.query_start_loc)
    has_prefill = nd < num_seqs
    has_pending = host.pending_dst is not None
    has_order = host.decode_order is not None
    arrays = [host.input_ids, host.positions, host.slot_mapping, host.query_start_loc, host.seq_lens,
              host.block_tables, host.logits_indices]
    if has_prefill:
        arrays.append(host.query_start_loc[nd:] - nd)
    if has_order:
        arrays.append(host.decode_order)
    if has_pending:
        arrays += [host.pending_dst, host.pending_src]
    moved = stage(*arrays)
    input_ids, positions, slots, qsl, seq_lens, tables, logits_indices = moved[:7]
    rest = moved[7:]
    prefill_qsl = rest.pop(0) if has_prefill else None
    decode_order = rest.pop(0) if has_order else None
    attn = AttentionMetadata(
        num_seqs=num_seqs,
        num_decodes=nd,
        slot_mapping=slots,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=int(counts.max()),
        max_seq_len=int(host.seq_lens.max()),
        query_start_loc_host=host.query_start_loc.tolist(),
        seq_lens_host=host.seq_lens.tolist(),
        prefill_query_start_loc=prefill_qsl,
        max_seq_len_bound=max_seq_len_bound,
        decode_order=decode_order,
    )
    return ForwardBatch(
        input_ids=input_ids, positions=positions, attn=attn, logits_indices=logits_indices,
        sample_rows=host.sample_rows,
        pending_dst=rest[0] if has_pending else None,
        pending_src=rest[1] if has_pending else None,
    )


def build_forward_batch(batch: ScheduledBatch, block_size: int, device: torch.device,
                        last_row_of_seq: dict[int, int] | None = None) -> ForwardBatch:
    return to_device(build_host_inputs(batch, block_size, last_row_of_seq), HostToDevice(device))
