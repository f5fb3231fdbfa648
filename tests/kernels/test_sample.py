"""The fused sampling kernel against the torch sampler's formula (same noise, same draws)."""
import pytest
import torch

from nanovllm.kernels.sample import DEFAULT_SAMPLE_CONFIG, resolve_input_ids, sample_rows
from nanovllm.layers.sampler import exponential_noise, row_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _scores(logits, temps, seeds, offsets):
    """The torch sampler's scores: logits / T - log(E) for random rows, the logits for greedy ones."""
    noise = exponential_noise(seeds, offsets, logits.shape[-1])
    t = torch.where(temps > 0, temps, 1.0)
    x = logits.float()
    return torch.where((temps > 0)[:, None], x / t[:, None] - noise.log(), x)


def _reference(logits, temps, seeds, offsets):
    return _scores(logits, temps, seeds, offsets).argmax(-1)


def _assert_draws(out, logits, temps, seeds, offsets):
    """Equal to the reference; on the GPU (approximate logs) a random row may instead take a token
    whose reference score ties the best one to 1e-5."""
    scores = _scores(logits, temps, seeds, offsets)
    ref = scores.argmax(-1)
    if DEVICE != "cuda":
        assert torch.equal(out, ref)
        return
    for row in (out != ref).nonzero().flatten().tolist():
        a, b = scores[row, ref[row]].item(), scores[row, out[row]].item()
        assert temps[row] > 0 and abs(a - b) <= 1e-5 * max(1.0, abs(a)), (row, a, b)


@pytest.mark.parametrize("batch, vocab", [(1, 5000), (7, 3001), (40, 777)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(batch, vocab, dtype):
    g = torch.Generator().manual_seed(batch * vocab)
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(dtype)
    temps = torch.rand(batch, generator=g) * 1.5
    temps[::3] = 0.0  # greedy rows mixed in
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 4096, (batch,), generator=g)
    out = sample_rows(logits.to(DEVICE), temps.to(DEVICE), row_keys(seeds, offsets).to(DEVICE)).cpu()
    assert out.dtype == torch.int64
    _assert_draws(out, logits, temps, seeds, offsets)


def test_ties_take_the_lowest_index_and_masked_tokens_never_win():
    logits = torch.full((2, 3000), float("-inf"))
    logits[0, [5, 2500]] = 1.0  # greedy tie: lowest index, as torch.argmax
    logits[1, 2999] = 0.0       # the only finite token must be drawn
    temps = torch.tensor([0.0, 1.0])
    keys = row_keys(torch.tensor([1, 2]), torch.tensor([0, 0]))
    out = sample_rows(logits.to(DEVICE), temps.to(DEVICE), keys.to(DEVICE)).cpu()
    assert out.tolist() == [5, 2999]


def test_keys_derived_in_the_kernel_equal_row_keys():
    """The CUDA-graph path passes seeds and offsets; the kernel must derive the same keys,
    including seeds that are the int64 view of a uint64 >= 2^63 and offsets past 2^32."""
    g = torch.Generator().manual_seed(7)
    batch, vocab = 24, 2048
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(torch.float16)
    temps = torch.rand(batch, generator=g) + 0.3
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=g)
    offsets = torch.randint(0, 2**40, (batch,), generator=g)
    offsets[:4] = torch.tensor([0, 1, 2**32 - 1, 2**32])
    keyed = sample_rows(logits.to(DEVICE), temps.to(DEVICE), row_keys(seeds, offsets).to(DEVICE)).cpu()
    seeded = sample_rows(logits.to(DEVICE), temps.to(DEVICE), None, seeds=seeds.to(DEVICE),
                         offsets=offsets.to(DEVICE)).cpu()
    assert torch.equal(keyed, seeded)
    _assert_draws(seeded, logits, temps, seeds, offsets)


def test_resolve_input_ids_takes_pending_tokens_from_the_device():
    ids = torch.tensor([11, 0, 13, 0, 15], dtype=torch.int64)
    prev = torch.tensor([-1, 2, -1, 0, -1], dtype=torch.int64)
    sampled = torch.tensor([100, 101, 102, 103], dtype=torch.int64)
    out = resolve_input_ids(ids.to(DEVICE), prev.to(DEVICE), sampled.to(DEVICE)).cpu()
    assert out.tolist() == [11, 102, 13, 100, 15]


@pytest.mark.parametrize("fast_log", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
def test_config_variants_draw_like_the_reference(prefetch, fast_log):
    """Several tiles per program (a long chunk), a ragged last tile, greedy rows mixed in; precise
    logs draw exactly the reference's tokens (approximate ones exist on the GPU only)."""
    g = torch.Generator().manual_seed(5)
    batch, vocab = 6, 9000
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(torch.float16)
    temps = torch.tensor([0.7, 0.0, 1.3, 0.2, 1.0, 0.0])
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 4096, (batch,), generator=g)
    config = DEFAULT_SAMPLE_CONFIG._replace(prefetch=prefetch, fast_log=fast_log, block=512)
    out = sample_rows(logits.to(DEVICE), temps.to(DEVICE), None, seeds=seeds.to(DEVICE),
                      offsets=offsets.to(DEVICE), _config=config).cpu()
    if fast_log:
        _assert_draws(out, logits, temps, seeds, offsets)
    else:
        assert torch.equal(out, _reference(logits, temps, seeds, offsets))


def test_approximate_logs_draw_like_the_reference_at_scale():
    """64 rows over a 32k vocabulary in bf16 with the default configuration (approximate logs on
    the GPU): any row unlike the reference must be a near-tie."""
    g = torch.Generator().manual_seed(11)
    batch, vocab = 64, 32000
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(torch.bfloat16)
    temps = torch.rand(batch, generator=g) + 0.2
    temps[::5] = 0.0
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 4096, (batch,), generator=g)
    out = sample_rows(logits.to(DEVICE), temps.to(DEVICE), None, seeds=seeds.to(DEVICE),
                      offsets=offsets.to(DEVICE)).cpu()
    _assert_draws(out, logits, temps, seeds, offsets)
