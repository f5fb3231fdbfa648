import pytest
import torch

from nanovllm.kernels import reference as ref
from nanovllm.kernels.copy_kv import copy_kv_prefixes

ON_GPU = torch.cuda.is_available()  # conftest.py selects the Triton interpreter otherwise

DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_layers,num_kv_heads,head_dim,block_size,counts",
    [
        (2, 2, 32, 16, [1, 15, 16, 7]),   # one token, a block less one, a whole block
        (3, 3, 40, 32, [31, 5]),           # a token's elements padded to a power of two (120 -> 128)
        (1, 8, 128, 256, [255, 129, 1]),   # the default page; tiles of 8 tokens, ragged ends
    ],
)
def test_copy_kv_prefixes_matches_reference(num_layers, num_kv_heads, head_dim, block_size, counts,
                                            dtype, device, gen):
    num_copies = len(counts)
    num_blocks = 2 * num_copies + 3
    shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
    kv = torch.randn(shape, generator=gen).to(device, dtype)
    expect = kv.clone()
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    copies = torch.tensor([perm[:num_copies], perm[num_copies:2 * num_copies], counts], dtype=torch.int64)
    copy_kv_prefixes(kv, copies.to(device), max(counts))
    ref.copy_kv_prefixes(expect, copies)
    # A pure copy: bit-exact, and everything else (the tails of destinations, other blocks) untouched.
    assert torch.equal(kv, expect)
    for src, dst, n in copies.t().tolist():
        assert torch.equal(kv[:, :, dst, :n], kv[:, :, src, :n])
        assert not torch.equal(kv[:, :, dst, n:], kv[:, :, src, n:]) or n == block_size


def test_copy_kv_prefixes_without_copies_is_a_no_op(device):
    kv = torch.randn(2, 1, 3, 16, 1, 32, device=device)
    before = kv.clone()
    copy_kv_prefixes(kv, torch.zeros(3, 0, dtype=torch.int64, device=device), 0)
    assert torch.equal(kv, before)
