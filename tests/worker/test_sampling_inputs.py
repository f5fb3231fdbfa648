import numpy as np
import torch

from nanovllm.layers.sampler import row_keys
from nanovllm.worker.sampling_inputs import host_row_keys


def test_host_row_keys_equal_the_device_formula():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(-2**63, 2**63 - 1, 200, dtype=np.int64), [0, -1, 2**63 - 1, -2**63]])
    offsets = rng.integers(0, 1 << 20, seeds.size, dtype=np.int64)
    offsets[:3] = [1 << 32, (1 << 40) + 7, (1 << 62) + 3]  # past 32 bits: only the low 32 enter the key
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


def test_keys_of_an_all_greedy_batch_are_left_out_and_its_draw_is_the_argmax():
    """A greedy row's draw reads no noise: an all-greedy batch gets zero keys (no hashing), and its
    tokens are the argmax; a batch with a random row gets every row's key."""
    from nanovllm import SamplingParams
    from nanovllm.engine.sequence import Sequence
    from nanovllm.layers.sampler import Sampler
    from nanovllm.worker.sampling_inputs import build_sampling_metadata

    cpu = torch.device("cpu")
    greedy = [Sequence([1, 2, 3], SamplingParams(temperature=0.0), seed=s) for s in (11, 12)]
    meta = build_sampling_metadata(greedy, cpu)
    assert meta.all_greedy and not meta.row_keys.any()
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler().sample(logits, meta).token_ids, logits.argmax(dim=-1))

    mixed = greedy + [Sequence([1, 2, 3], SamplingParams(temperature=0.7), seed=13)]
    meta = build_sampling_metadata(mixed, cpu)
    seeds = np.array([11, 12, 13], dtype=np.int64)
    assert np.array_equal(meta.row_keys.numpy(), host_row_keys(seeds, np.zeros(3, dtype=np.int64)))
