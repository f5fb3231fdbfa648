import numpy as np
import torch

from nanovllm.layers.sampler import row_keys
from nanovllm.worker.sampling_inputs import host_row_keys


def test_host_row_keys_equal_the_device_formula():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(-2**63, 2**63 - 1, 200, dtype=np.int64), [0, -1, 2**63 - 1, -2**63]])
    offsets = rng.integers(0, 1 << 20, seeds.size, dtype=np.int64)
    expected = row_keys(torch.from_numpy(seeds), torch.from_numpy(offsets)).numpy()
    assert np.array_equal(host_row_keys(seeds, offsets), expected)


def test_settled_tokens_follow_the_sequence_without_its_pending_token():
    """The numpy mirror the penalties read grows with the output, never holds a placeholder, and
    picks up a placeholder's value once the host has read it."""
    from nanovllm import SamplingParams
    from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
    from nanovllm.worker.sampling_inputs import settled_tokens

    seq = Sequence([5, 6, 7], SamplingParams(), seed=0)
    assert settled_tokens(seq).tolist() == [5, 6, 7]
    for t in range(100):  # past the first buffer's capacity
        seq.append_token(t)
    assert settled_tokens(seq).tolist() == [5, 6, 7] + list(range(100))
    seq.token_ids.append(PENDING_TOKEN)
    seq.num_pending_tokens = 1
    assert settled_tokens(seq).tolist() == [5, 6, 7] + list(range(100))
    seq.token_ids[-1], seq.num_pending_tokens = 42, 0
    assert settled_tokens(seq)[-2:].tolist() == [99, 42]
