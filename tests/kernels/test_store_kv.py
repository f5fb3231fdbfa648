import pytest
import torch

from nanovllm.kernels import reference as ref
from nanovllm.kernels import store_kv_cache

ON_GPU = torch.cuda.is_available()  # conftest.py selects the Triton interpreter otherwise

DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_kv_heads,head_dim,block_size,slot_dtype",
    [
        (37, 2, 64, 16, torch.int32),
        (50, 8, 128, 64, torch.int64),
        (9, 3, 80, 256, torch.int64),  # non-power-of-two heads and head_dim
    ],
)
def test_store_kv_matches_reference(num_tokens, num_kv_heads, head_dim, block_size,
                                    slot_dtype, dtype, device, gen):
    if ON_GPU:
        num_tokens *= 40
    num_blocks = num_tokens // block_size + 4
    # key/value as non-contiguous views of a fused qkv projection output.
    qkv = torch.randn(num_tokens, 4 * num_kv_heads, head_dim, generator=gen).to(device, dtype)
    key = qkv[:, 2 * num_kv_heads:3 * num_kv_heads]
    value = qkv[:, 3 * num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding rows (CUDA-graph batches) must be skipped
    slots = slots.to(device, slot_dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    k_expect, v_expect = k_cache.clone(), v_cache.clone()

    store_kv_cache(key, value, k_cache, v_cache, slots)
    ref.store_kv_cache(key, value, k_expect, v_expect, slots)
    # A pure copy: bit-exact, and untouched slots keep their old contents.
    assert torch.equal(k_cache, k_expect)
    assert torch.equal(v_cache, v_expect)


def test_store_kv_all_padding(device):
    k_cache = torch.zeros(2, 16, 2, 64, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(4, 2, 64, device=device)
    slots = torch.full((4,), -1, dtype=torch.int64, device=device)
    store_kv_cache(key, key, k_cache, v_cache, slots)
    assert not k_cache.any() and not v_cache.any()
