"""Host-side batch flattening: slots, block tables and sampling rows for mixed batches."""
import numpy as np
import torch

from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker.inputs import HostToDevice, build_host_inputs, to_device


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
