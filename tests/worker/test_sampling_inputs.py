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
