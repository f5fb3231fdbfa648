"""Grammar bitmasks in the sampling kernels (structured outputs): the fused draw under masks, and
the in-place mask kernel, against the torch sampler's path (the same noise, the same draws)."""
import pytest
import torch

from nanovllm.kernels.sample import apply_token_bitmask_, sample_rows
from nanovllm.layers.sampler import exponential_noise, row_keys, unpack_bitmask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _random_masks(num: int, vocab: int, density: float, gen: torch.Generator) -> torch.Tensor:
    allowed = torch.rand(num, vocab, generator=gen) < density
    allowed[:, 0] |= ~allowed.any(-1)  # never an empty row
    words = -(-vocab // 32)
    padded = torch.zeros(num, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    shifts = torch.arange(32, dtype=torch.int64)
    packed = (padded.view(num, words, 32) << shifts).sum(-1)
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # the uint32 words' bits as int32


def _reference(logits, temps, seeds, offsets, mask_rows, masks):
    """The torch path: -inf outside each row's mask, then the draw's scores' argmax."""
    x = logits.float().clone()
    rows = (mask_rows >= 0).nonzero().flatten()
    allowed = unpack_bitmask(masks[mask_rows[rows].long()], x.shape[1])
    x[rows] = x[rows].masked_fill(~allowed, float("-inf"))
    noise = exponential_noise(seeds, offsets, x.shape[-1])
    t = torch.where(temps > 0, temps, 1.0)
    scores = torch.where((temps > 0)[:, None], x / t[:, None] - noise.log(), x)
    return scores


@pytest.mark.parametrize("batch, vocab", [(1, 3000), (9, 1000), (33, 777)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("density", [0.003, 0.5])
def test_fused_draw_under_masks_matches_the_torch_path(batch, vocab, dtype, density):
    g = torch.Generator().manual_seed(batch + vocab)
    logits = (torch.randn(batch, vocab, generator=g) * 4).to(dtype)
    temps = torch.rand(batch, generator=g) + 0.2
    temps[::3] = 0.0  # greedy rows too
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    offsets = torch.randint(0, 4096, (batch,), generator=g)
    mask_rows = torch.full((batch,), -1, dtype=torch.int32)
    constrained = torch.arange(0, batch, 2)  # every other row under a mask: mixed batches
    mask_rows[constrained] = torch.arange(len(constrained), dtype=torch.int32)
    masks = _random_masks(len(constrained), vocab, density, g)
    out = sample_rows(logits.to(DEVICE), temps.to(DEVICE), row_keys(seeds, offsets).to(DEVICE),
                      mask_rows=mask_rows.to(DEVICE), masks=masks.to(DEVICE)).cpu()
    scores = _reference(logits, temps, seeds, offsets, mask_rows, masks)
    ref = scores.argmax(-1)
    allowed = unpack_bitmask(masks, vocab)
    assert allowed[torch.arange(len(constrained)), out[constrained]].all()  # only allowed tokens
    if DEVICE == "cpu":
        assert torch.equal(out, ref)
    else:  # approximate logs: a tie to 1e-5 may go either way
        for row in (out != ref).nonzero().flatten().tolist():
            a, b = scores[row, ref[row]].item(), scores[row, out[row]].item()
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (row, a, b)
    # Rows without a mask draw what they draw without any mask in the batch.
    plain = sample_rows(logits.to(DEVICE), temps.to(DEVICE), row_keys(seeds, offsets).to(DEVICE)).cpu()
    free = mask_rows < 0
    assert torch.equal(out[free], plain[free])


def test_keys_derived_in_the_kernel_under_masks():
    """The CUDA graphs' masked draw derives its keys from seeds and offsets: the same tokens."""
    g = torch.Generator().manual_seed(3)
    batch, vocab = 6, 2048
    logits = torch.randn(batch, vocab, generator=g).to(torch.float16)
    temps = torch.rand(batch, generator=g) + 0.5
    seeds = torch.randint(-2**63, 2**63 - 1, (batch,), generator=g)
    offsets = torch.randint(0, 2**33, (batch,), generator=g)
    mask_rows = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    masks = _random_masks(4, vocab, 0.1, g)
    args = dict(mask_rows=mask_rows.to(DEVICE), masks=masks.to(DEVICE))
    keyed = sample_rows(logits.to(DEVICE), temps.to(DEVICE), row_keys(seeds, offsets).to(DEVICE), **args)
    seeded = sample_rows(logits.to(DEVICE), temps.to(DEVICE), None, seeds=seeds.to(DEVICE),
                         offsets=offsets.to(DEVICE), **args)
    assert torch.equal(keyed.cpu(), seeded.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_token_bitmask_writes_minus_inf_outside_the_masks(dtype):
    g = torch.Generator().manual_seed(11)
    batch, vocab = 7, 5000  # vocab not a multiple of 32, nor of the kernel's block
    logits = torch.randn(batch, vocab, generator=g).to(dtype)
    masked_rows = torch.tensor([5, 0, 3])
    masks = _random_masks(3, vocab, 0.2, g)
    out = apply_token_bitmask_(logits.clone().to(DEVICE), masks.to(DEVICE), masked_rows.to(DEVICE)).cpu()
    expected = logits.clone()
    expected[masked_rows] = expected[masked_rows].masked_fill(~unpack_bitmask(masks, vocab), float("-inf"))
    assert torch.equal(out, expected)


def _masked(logits, density, gen):
    """logits with a grammar mask written in (every row: most tokens -inf), and the allowed set."""
    masks = _random_masks(logits.shape[0], logits.shape[1], density, gen)
    allowed = unpack_bitmask(masks, logits.shape[1])
    out = apply_token_bitmask_(logits.clone().to(DEVICE), masks.to(DEVICE), torch.arange(logits.shape[0]).to(DEVICE))
    return out, allowed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("density", [0.002, 0.05])
def test_top_k_kernels_under_masks(dtype, density):
    """Rows whose mask leaves fewer tokens than top_k (the grammar's few allowed tokens, then -inf
    ties over the rest of the row): the kernels draw what the torch path draws, always an allowed token."""
    from nanovllm.kernels.sample_top_k import sample_top_k_rows
    from nanovllm.layers.sampler import _sample_top_k
    from test_sample_top_k import _distinct_logits
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 12, 3001
    logits, allowed = _masked(_distinct_logits(rows, vocab, gen, dtype), density, gen)
    temps = torch.rand(rows, generator=gen) + 0.3
    temps[::4] = 0.0
    top_k = torch.randint(1, 100, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.5 + 0.5
    keys = row_keys(torch.randint(0, 2**62, (rows,), generator=gen), torch.randint(0, 900, (rows,), generator=gen))
    x = logits.cpu().float() / torch.where(temps > 0, temps, 1.0)[:, None]
    expected = torch.where(temps > 0, _sample_top_k(x, top_k, top_p, int(top_k.max()), keys), x.argmax(-1))
    got = sample_top_k_rows(logits, *(t.to(DEVICE) for t in (temps, top_k, top_p, keys)), max_top_k=128).cpu()
    assert allowed[torch.arange(rows), got].all()
    if DEVICE == "cpu":
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_top_p_kernel_under_masks(dtype):
    from nanovllm.kernels.sample_top_p import sample_top_p_rows
    from test_sample_top_p import _reference
    gen = torch.Generator().manual_seed(6)
    rows, vocab = 10, 3001
    logits, allowed = _masked((torch.randn(rows, vocab, generator=gen) * 3).to(dtype), 0.01, gen)
    temps = torch.rand(rows, generator=gen) + 0.5
    temps[::5] = 0.0
    top_p = torch.tensor([0.2, 0.5, 0.9, 0.99, 1.0] * 2)
    keys = row_keys(torch.randint(0, 2**62, (rows,), generator=gen), torch.randint(0, 900, (rows,), generator=gen))
    got = sample_top_p_rows(logits, *(t.to(DEVICE) for t in (temps, top_p, keys))).cpu()
    assert allowed[torch.arange(rows), got].all()
    if DEVICE == "cpu":
        assert torch.equal(got, _reference(logits.cpu(), temps, top_p, keys))
