"""Turn a scheduled batch into the flat tensors one forward pass needs."""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.attention.base import AttentionMetadata
from nanovllm.engine.scheduler import ScheduledBatch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] rows of the hidden states to sample from
    sample_rows: list[int]        # which sequences of the batch sample this step
    # Inputs sampled by the previous step and not yet seen by the host: input_ids[dst] = last[src].
    pending_dst: torch.Tensor | None = None
    pending_src: torch.Tensor | None = None


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def build_forward_batch(batch: ScheduledBatch, block_size: int, device: torch.device,
                        last_row_of_seq: dict[int, int] | None = None) -> ForwardBatch:
    seqs, counts = batch.seqs, batch.num_new_tokens
    num_seqs = len(seqs)
    total = sum(counts)
    input_ids = np.empty(total, dtype=np.int64)
    positions = np.empty(total, dtype=np.int64)
    query_start = np.zeros(num_seqs + 1, dtype=np.int32)
    seq_lens = np.empty(num_seqs, dtype=np.int32)
    max_blocks = max(len(s.block_table) for s in seqs)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    logits_indices, sample_rows = [], []
    pending_dst, pending_src = [], []
    pos = 0
    for i, (seq, n) in enumerate(zip(seqs, counts)):
        start = seq.num_computed_tokens
        end = start + n
        if seq.num_pending_tokens:
            # Only a decode can be pending: its one input is the previous step's sample.
            input_ids[pos] = 0
            pending_dst.append(pos)
            pending_src.append(last_row_of_seq[seq.seq_id])
        else:
            input_ids[pos:pos + n] = seq.token_ids[start:end]
        positions[pos:pos + n] = np.arange(start, end)
        pos += n
        query_start[i + 1] = pos
        seq_lens[i] = end
        block_tables[i, :len(seq.block_table)] = seq.block_table
        if end == seq.num_tokens:
            logits_indices.append(pos - 1)
            sample_rows.append(i)
    # slot of position p of sequence i = block_tables[i, p // bs] * bs + p % bs, for all tokens at once
    seq_of_token = np.repeat(np.arange(num_seqs), counts)
    slots = block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    attn = AttentionMetadata(
        num_seqs=num_seqs,
        num_decodes=batch.num_decodes,
        slot_mapping=_to_device(slots, device),
        query_start_loc=_to_device(query_start, device),
        seq_lens=_to_device(seq_lens, device),
        block_tables=_to_device(block_tables, device),
        max_query_len=max(counts),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_host=query_start.tolist(),
        seq_lens_host=seq_lens.tolist(),
        prefill_query_start_loc=(_to_device(query_start[batch.num_decodes:] - batch.num_decodes, device)
                                 if batch.num_decodes < num_seqs else None),
    )
    return ForwardBatch(
        input_ids=_to_device(input_ids, device),
        positions=_to_device(positions, device),
        attn=attn,
        logits_indices=_to_device(np.asarray(logits_indices, dtype=np.int64), device),
        sample_rows=sample_rows,
        pending_dst=_to_device(np.asarray(pending_dst, dtype=np.int64), device) if pending_dst else None,
        pending_src=_to_device(np.asarray(pending_src, dtype=np.int64), device) if pending_src else None,
    )
