"""The token counts the piecewise CUDA graphs are captured at (the capture and replay themselves
need a GPU: tests/gpu/test_engine_gpu.py; the layer's side of the contract under the interpreter:
tests/kernels/test_decoder_attention_kv_store.py)."""
import pytest

from nanovllm.worker.piecewise_graph import bucket_for, token_buckets


def test_buckets_cover_every_step_size_with_bounded_padding():
    buckets = token_buckets(16384)
    assert buckets == sorted(set(buckets)) and buckets[0] == 16 and buckets[-1] == 16384
    assert buckets[:8] == [16, 32, 64, 128, 256, 512, 1024, 2048]
    for t in range(1, 16385):
        b = bucket_for(buckets, t)
        assert b >= t and (b <= 16 or b < 2 * t) and (t <= 2048 or b - t < 1024), (t, b)
    assert bucket_for(buckets, 16385) is None


@pytest.mark.parametrize("max_tokens,expect", [(8, [8]), (100, [16, 32, 64, 100]), (2048, [16, 32, 64, 128, 256, 512,
                                                                                            1024, 2048]),
                                               (4000, [16, 32, 64, 128, 256, 512, 1024, 2048, 3072, 4000])])
def test_small_budgets(max_tokens, expect):
    assert token_buckets(max_tokens) == expect


def test_large_budgets_take_coarser_steps():
    buckets = token_buckets(65536)
    large = [b for b in buckets if b > 2048]
    assert buckets[-1] == 65536 and all(b - a == 4096 for a, b in zip(large, large[1:-1]))
    assert len(buckets) < 30  # capture time and memory stay bounded
