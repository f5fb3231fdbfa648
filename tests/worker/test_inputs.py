"""Host-side batch flattening: slots, block tables and sampling rows for mixed batches."""
import numpy as np
import pytest
import torch

from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.inputs import HostToDevice, build_host_inputs, fill_decode_inputs, to_device, write_block_tables
from nanovllm.worker.sampling_inputs import build_sampling_metadata


def _seq(tokens, computed, table):
    s = Sequence(tokens, SamplingParams(), seed=0)
    s.num_computed_tokens = computed
    s.block_table = table
    return s


def test_mixed_batch_layout():
    bs = 16
    dec = _seq(list(range(40)), 39, [7, 3, 9])              # decode of position 39
    pend = _seq(list(range(20)), 20, [5, 6])               # decode of a pending sample at position 20
    pend.append_pending()
    chunk = _seq(list(range(100, 150)), 16, [1, 2, 4, 8])  # chunk of 20 tokens at 16..35, no sample
    last = _seq(list(range(200, 210)), 0, [11])            # whole prompt, samples
    batch = ScheduledBatch([dec, pend, chunk, last], [1, 1, 20, 10], num_decodes=2)
    host = build_host_inputs(batch, bs, last_row_of_seq={pend.seq_id: 5})
    assert host.input_ids[:2].tolist() == [39, 0]
    assert host.pending_dst.tolist() == [1] and host.pending_src.tolist() == [5]
    assert host.input_ids[2:22].tolist() == list(range(116, 136))
    assert host.positions.tolist() == [39, 20] + list(range(16, 36)) + list(range(10))
    assert host.slot_mapping[0] == 9 * bs + 39 % bs and host.slot_mapping[1] == 6 * bs + 4
    assert host.slot_mapping[2] == 2 * bs and host.slot_mapping[21] == 4 * bs + 3
    assert host.query_start_loc.tolist() == [0, 1, 2, 22, 32]
    assert host.seq_lens.tolist() == [40, 21, 36, 10]
    assert host.block_tables.tolist() == [[7, 3, 9, 0], [5, 6, 0, 0], [1, 2, 4, 8], [11, 0, 0, 0]]
    assert host.sample_rows == [0, 1, 3] and host.logits_indices.tolist() == [0, 1, 31]
    fb = to_device(host, HostToDevice(torch.device("cpu")))
    assert fb.attn.prefill_query_start_loc.tolist() == [0, 20, 30]
    assert torch.equal(fb.input_ids, torch.from_numpy(host.input_ids))
    assert fb.attn.num_decodes == 2 and fb.attn.max_query_len == 20 and fb.attn.max_seq_len == 40
    assert np.array_equal(fb.attn.block_tables.numpy(), host.block_tables)
    assert host.kv_copies is None  # no prefix hit ending inside a block


def test_prefix_copies_travel_with_the_inputs():
    """A step admitting requests whose prefix hits end inside blocks carries their KV copies as
    one [3, C] array (sources, destinations, tokens): what every tensor-parallel rank receives."""
    a = _seq(list(range(30)), 20, [4, 5])
    b = _seq(list(range(40)), 17, [6, 7, 8])
    batch = ScheduledBatch([a, b], [10, 23], num_decodes=0, kv_copies=[(9, 5, 4), (2, 7, 1)])
    host = build_host_inputs(batch, 16)
    assert host.kv_copies.tolist() == [[9, 2], [5, 7], [4, 1]] and host.kv_copies.flags.c_contiguous


def test_graphed_decode_inputs_match_the_general_path():
    """fill_decode_inputs (the CUDA-graph fast path) writes what build_host_inputs and
    build_sampling_metadata compute for the same decode batch, plus padding rows."""
    bs, padded, width = 16, 8, 6
    seqs = [_seq(list(range(40)), 39, [7, 3, 9]), _seq(list(range(20)), 20, [5, 6]),
            _seq(list(range(70)), 69, [1, 2, 4, 8, 10]), _seq(list(range(5)), 4, [11])]
    seqs[1].append_pending()
    seqs[2].append_pending()
    seqs[2].num_computed_tokens = 70
    seqs[3].sampling_params = SamplingParams(temperature=0.0)
    seqs[0].seed = -5  # any Python int: the low 64 bits count
    last_rows = {seqs[1].seq_id: 3, seqs[2].seq_id: 0}
    views = {"input_ids": np.full(padded, 99, np.int64), "prev_rows": np.full(padded, 99, np.int64),
             "positions": np.full(padded, 99, np.int64), "slot_mapping": np.full(padded, 99, np.int64),
             "seeds": np.full(padded, 99, np.int64), "offsets": np.full(padded, 99, np.int64),
             "seq_lens": np.full(padded, 99, np.int32), "decode_order": np.full(padded, 99, np.int32),
             "temperatures": np.full(padded, 99, np.float32),
             "block_tables": np.full((padded, width), 99, np.int32)}
    fill_decode_inputs(views, seqs, padded, bs, last_rows)
    host = build_host_inputs(ScheduledBatch(seqs, [1] * 4, num_decodes=4), bs, last_rows)
    meta = build_sampling_metadata(seqs, torch.device("cpu"))
    n = len(seqs)
    assert views["input_ids"][:n].tolist() == host.input_ids.tolist() == [39, 0, 0, 4]
    assert views["prev_rows"][:n].tolist() == [-1, 3, 0, -1]
    assert host.pending_dst.tolist() == [1, 2] and host.pending_src.tolist() == [3, 0]
    for name in ("positions", "slot_mapping", "seq_lens", "decode_order"):
        assert views[name][:n].tolist() == getattr(host, name).tolist(), name
    for i, seq in enumerate(seqs):  # entries past a table's length are never read: left as they were
        assert views["block_tables"][i, :len(seq.block_table)].tolist() == seq.block_table
    assert views["temperatures"][:n].tolist() == meta.temperatures.tolist()
    assert views["seeds"][:n].tolist() == meta.seeds.tolist()
    assert views["offsets"][:n].tolist() == meta.offsets.tolist()
    # Padding rows: skipped by the kernels, last in the dispatch order, never reading the device.
    assert views["slot_mapping"][n:].tolist() == [-1] * (padded - n)
    assert views["seq_lens"][n:].tolist() == [0] * (padded - n)
    assert views["prev_rows"][n:].tolist() == [-1] * (padded - n)
    assert views["decode_order"][n:].tolist() == list(range(n, padded))
    assert views["temperatures"][n:].tolist() == [0.0] * (padded - n)


@pytest.mark.parametrize("num_seqs", [3, 40])  # row by row, and the one masked write
def test_block_tables_fill_the_leading_entries_of_their_rows(num_seqs):
    rng = np.random.default_rng(num_seqs)
    tables = [rng.integers(0, 1000, rng.integers(1, 9)).tolist() for _ in range(num_seqs)]
    out = np.full((num_seqs + 2, 10), -7, dtype=np.int32)
    write_block_tables(out, tables)
    for row, table in zip(out, tables):
        assert row[:len(table)].tolist() == table and (row[len(table):] == -7).all()
    assert (out[num_seqs:] == -7).all()


def test_plain_sampling_flag():
    assert _seq([1], 0, [0]).plain_sampling
    for params in (SamplingParams(top_p=0.9), SamplingParams(top_k=5), SamplingParams(min_p=0.1),
                   SamplingParams(presence_penalty=0.5), SamplingParams(repetition_penalty=1.1),
                   SamplingParams(logprobs=0), SamplingParams(min_tokens=3)):
        assert not Sequence([1], params, seed=0).plain_sampling, params


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned transfers and events need a GPU")
def test_transfer_slots_rotate_and_wait_for_their_last_copy():
    from nanovllm.worker.inputs import TransferSlots
    slots = TransferSlots(3)
    device_buf = torch.zeros(1 << 20, device="cuda")
    hosts = [torch.empty(1 << 20, pin_memory=True) for _ in range(3)]
    taken = []
    for step in range(7):
        i = slots.take()
        taken.append(i)
        hosts[i].fill_(step)  # take() returned: slot i's previous copy has completed
        device_buf.copy_(hosts[i], non_blocking=True)
        event = slots.copied(i)
        event.synchronize()
        assert device_buf[0].item() == step
    assert taken == [0, 1, 2, 0, 1, 2, 0]
