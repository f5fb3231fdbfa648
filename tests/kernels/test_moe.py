"""The mixture-of-experts kernels against their plain-torch references (kernels/reference.py): routing
(softmax + top-k), the alignment of the routed pairs by expert, and the two grouped GEMMs; then the
GPU path of the MoE block against its CPU (HF) path. On a GPU at Qwen3-30B-A3B's sizes in bf16/fp16;
on the CPU under the interpreter at small sizes in fp16/fp32 (bf16 tl.dot is wrong there)."""
import pytest
import torch

from nanovllm.kernels import reference as ref
from nanovllm.kernels.moe_gemm import MoeTile, moe_config, moe_down, moe_gate_up
from nanovllm.kernels.moe_routing import route

ON_GPU = torch.cuda.is_available()
# (experts, top_k, hidden, intermediate)
SHAPE = (128, 8, 2048, 768) if ON_GPU else (8, 2, 96, 48)  # 48: column tiles past I wrap
TOKENS = [1, 7, 64, 256, 1000] if ON_GPU else [1, 5, 33]
GEMM_DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16, torch.float32]


def _logits(t, e, dtype, device, gen, skew=0.0):
    """Router logits; skew > 0 favours low expert ids (uneven loads: some experts span many blocks)."""
    logits = torch.randn(t, e, generator=gen) + skew * torch.linspace(1, 0, e)
    return logits.to(device, dtype)


@pytest.mark.parametrize("renormalize,round_weights", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", TOKENS)
def test_topk_matches_the_reference(t, dtype, renormalize, round_weights, device, gen):
    e, k, _, _ = SHAPE
    # Distinct logits in every row (multiples of 1/16, exact in bf16): no ties, so one right answer.
    logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).sub(e / 2).div(16).to(device, dtype)
    routing = route(logits, k, 16, renormalize, round_weights)
    weights, ids = ref.moe_topk(logits, k, renormalize, round_weights)
    assert torch.equal(routing.ids, ids)
    # Rounded to bf16, an ulp-level difference (exp, division) may round either way: one bf16 ulp.
    rtol = 8e-3 if round_weights and dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(routing.weights, weights, atol=1e-6, rtol=rtol)
    if renormalize:
        torch.testing.assert_close(routing.weights.sum(-1), torch.ones(t, device=device), atol=2e-2, rtol=0)


@pytest.mark.parametrize("skew", [0.0, 4.0])
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("t", TOKENS + [1100 if ON_GPU else 700, 2100 if not ON_GPU else 4096])
def test_align_matches_the_reference(t, block_m, skew, device, gen):
    """Sorted pairs, padding and block experts exactly; large steps cover the top-k kernel's larger
    blocks (T > 1024) and the align kernel's scan in several chunks (T * k > 4096)."""
    e, k, _, _ = SHAPE
    routing = route(_logits(t, e, torch.float32, device, gen, skew), k, block_m, True, False)
    sorted_ids, block_expert, num_padded = ref.moe_align(routing.ids.cpu(), e, block_m)
    assert int(routing.num_padded) == num_padded and num_padded % block_m == 0
    assert routing.sorted_ids.numel() >= num_padded
    assert torch.equal(routing.sorted_ids[:num_padded].cpu(), sorted_ids)
    assert torch.equal(routing.block_expert[:num_padded // block_m].cpu(), block_expert)


@pytest.mark.parametrize("e,k", [(6, 1), (60, 4), (6, 3)])  # expert counts that are no power of two (Qwen1.5-MoE: 60)
def test_routing_with_other_expert_counts(e, k, device, gen):
    t = 37
    logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).sub(e / 2).div(16).to(device)
    routing = route(logits, k, 16, False, False)
    weights, ids = ref.moe_topk(logits, k, False, False)
    assert torch.equal(routing.ids, ids)
    torch.testing.assert_close(routing.weights, weights, atol=1e-6, rtol=1e-5)
    sorted_ids, block_expert, num_padded = ref.moe_align(routing.ids.cpu(), e, 16)
    assert int(routing.num_padded) == num_padded
    assert torch.equal(routing.sorted_ids[:num_padded].cpu(), sorted_ids)
    assert torch.equal(routing.block_expert[:num_padded // 16].cpu(), block_expert)


def test_padding_rows_take_a_real_rows_experts_with_weight_zero(device, gen):
    """A CUDA graph's padding rows (cache slot -1): the experts of their top-k block's first row (expert 0
    for a block of padding only), weight 0; the real rows' routing and the alignment are unchanged."""
    e, k, h, inter = SHAPE
    t, real = 40, 30  # top-k blocks of 16 rows: [0, 16) real, [16, 32) from row 16 on, [32, 40) padding only
    logits = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]).sub(e / 2).div(16).to(device)
    slots = torch.where(torch.arange(t) < real, torch.arange(t) * 3, -1).to(device)
    routing = route(logits, k, 16, True, True, None, slots)
    weights, ids = ref.moe_topk(logits, k, True, True)
    assert torch.equal(routing.ids[:real], ids[:real])
    torch.testing.assert_close(routing.weights[:real], weights[:real], atol=1e-6, rtol=1e-5)
    assert (routing.ids[real:32] == ids[16]).all() and (routing.ids[32:] == 0).all()
    assert (routing.weights[real:] == 0).all()
    sorted_ids, block_expert, num_padded = ref.moe_align(routing.ids.cpu(), e, 16)
    assert int(routing.num_padded) == num_padded
    assert torch.equal(routing.sorted_ids[:num_padded].cpu(), sorted_ids)
    assert torch.equal(routing.block_expert[:num_padded // 16].cpu(), block_expert)
    dtype = GEMM_DTYPES[0]
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13, w2 = _experts(e, h, inter, dtype, device, gen)
    config = moe_config(t, h, inter, dtype)
    routing = route(logits.to(dtype), k, config.block_m, True, True, None, slots)
    parts = moe_down(moe_gate_up(x, w13, routing, config.gate_up), w2, routing, config.down,
                     torch.full((k, t, h), float("nan"), device=device))
    assert (parts[:, real:] == 0).all() and not parts[:, :real].isnan().any()


def test_align_records_distinct_experts(device, gen):
    e, k, _, _ = SHAPE
    distinct, step = torch.zeros(4, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device)
    seen = []
    for t in (1, 3, 40, 2, 9):  # five steps in a ring of four: the fifth overwrites the first
        routing = route(_logits(t, e, torch.float32, device, gen), k, 16, True, True, (distinct, step))
        seen.append(routing.ids.unique().numel())
    assert int(step) == 5 and distinct.tolist() == [seen[4], *seen[1:4]]


def _experts(e, h, inter, dtype, device, gen):
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * h ** -0.5).to(device, dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * inter ** -0.5).to(device, dtype)
    return w13, w2


def _tiles(t, h, inter, dtype):
    """The table's tiles (on the CPU: BK past K, so K is masked) and the same with the weights through TMA
    descriptors; on the CPU also tiles whose BK divides K, by pointers and by TMA."""
    config = moe_config(t, h, inter, dtype)
    cases = [(config.block_m, config.gate_up, config.down),
             (config.block_m, config.gate_up._replace(tma=True), config.down._replace(tma=True))]
    if not ON_GPU:
        cases += [(32, MoeTile(16, 32, 4, 2, tma), MoeTile(32, 16, 4, 2, tma)) for tma in (False, True)]
    return cases


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
@pytest.mark.parametrize("t", TOKENS)
def test_grouped_gemms_match_the_reference(t, dtype, device, gen):
    e, k, h, inter = SHAPE
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    w13, w2 = _experts(e, h, inter, dtype, device, gen)
    logits = _logits(t, e, dtype, device, gen, skew=2.0)
    for block_m, gate_up_tile, down_tile in _tiles(t, h, inter, dtype):
        routing = route(logits, k, block_m, True, True)
        act = moe_gate_up(x, w13, routing, gate_up_tile)
        expect = ref.moe_gate_up(x, w13, routing.ids)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(act, expect, **tol)
        parts = torch.full((k + 1, t, h), float("nan"), device=device)  # the slice past k is the caller's
        moe_down(act, w2, routing, down_tile, parts)
        assert parts[k].isnan().all()
        torch.testing.assert_close(parts[:k], ref.moe_down(act, w2, routing.weights, routing.ids), **tol)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("t", [1, 40] if not ON_GPU else [1, 40, 300])
def test_moe_block_kernel_path_matches_the_torch_path(t, shared, device, gen):
    """SparseMoeBlock's GPU path (routing, grouped GEMMs, partial slices incl. the shared expert)
    against its CPU path (HF's arithmetic): fp32, so the two differ by summation order only."""
    from nanovllm.layers.fused_moe import SparseMoeBlock
    e, k, h, inter = SHAPE
    with torch.device(device):
        block = SparseMoeBlock(h, e, k, inter, renormalize=False, round_weights=True,
                               shared_intermediate_size=48 if shared else 0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    x = torch.randn(t, h, generator=gen).to(device)
    out = block._forward_kernels(x, block.gate(x))
    assert out.parts.shape == (k + shared, t, h)
    weights, ids = block.route_torch(block.gate(x))
    expect = block.experts_torch(x, weights, ids) + (block._shared(x) if shared else 0)
    torch.testing.assert_close(out.parts.sum(0), expect, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("parts_dtype", [torch.float32, torch.float16])
def test_the_next_rmsnorm_sums_the_expert_slices(parts_dtype, device, gen):
    """The combine: the residual-add RMSNorm after the layer sums its k weighted slices, fp32 or (long
    steps) in the activation dtype, as it would sum split-K partials."""
    from nanovllm.kernels.fused_ops import fused_add_rms_norm
    from nanovllm.kernels.gemm import SplitKOutput
    k, t, h = 9, 5, SHAPE[2]
    parts = torch.randn(k, t, h, generator=gen).to(device, parts_dtype)
    residual = torch.randn(t, h, generator=gen).to(device, torch.float16)
    weight = torch.rand(h, generator=gen).to(device, torch.float16)
    y, new_residual = fused_add_rms_norm(SplitKOutput(parts, torch.float16), residual, weight, 1e-6)
    total = SplitKOutput(parts, torch.float16).sum()
    expect_y, expect_residual = fused_add_rms_norm(total, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, expect_residual, atol=0, rtol=0)
    torch.testing.assert_close(y, expect_y, atol=0, rtol=0)


# Block-FP8 experts: (experts, top_k, hidden, intermediate); hidden 200 on the CPU: a partial K block.
FP8_SHAPE = (128, 8, 2048, 768) if ON_GPU else (8, 2, 200, 128)


def _fp8_experts(e, h, inter, device, gen):
    from nanovllm.layers.quantization.fp8 import quantize_experts
    return [tuple(t.to(device) for t in quantize_experts(torch.randn(e, n, k, generator=gen) * k ** -0.5))
            for n, k in ((2 * inter, h), (h, inter))]


def _dequantized(w, scale):
    return torch.stack([ref.dequantize_blocks(w[i], scale[i]) for i in range(w.shape[0])])


@pytest.mark.parametrize("dtype", GEMM_DTYPES[:1])
@pytest.mark.parametrize("t", TOKENS)
def test_fp8_grouped_gemms_match_the_reference(t, dtype, device, gen):
    """W8A8: float8 experts with 128x128 block scales, activations quantized in 1 x 128 groups, against
    the torch loop over the dequantized operands (fp32); the table's FP8 tiles and narrower ones."""
    from nanovllm.kernels.fp8_quant import per_token_group_quant
    e, k, h, inter = FP8_SHAPE
    x = torch.randn(t, h, generator=gen).to(device, dtype)
    (w13, s13), (w2, s2) = _fp8_experts(e, h, inter, device, gen)
    logits = _logits(t, e, dtype, device, gen, skew=2.0)
    xq = per_token_group_quant(x)
    x_dq = ref.dequantize_groups(xq.data[:t], xq.scale[:, :t].t())
    config = moe_config(t, h, inter, dtype, fp8=True)
    assert config.gate_up.bk == config.down.bk == 128 and 128 % config.gate_up.bn == 0 == 128 % config.down.bn
    tiles = [(config.block_m, config.gate_up, config.down), (16, MoeTile(32, 128, 4, 2), MoeTile(64, 128, 4, 2))]
    for block_m, gate_up_tile, down_tile in tiles:
        routing = route(logits, k, block_m, True, True)
        act = moe_gate_up(xq, w13, routing, gate_up_tile, s13)
        assert act.dtype == dtype and act.shape == (t * k, inter)
        expect = ref.moe_gate_up(x_dq, _dequantized(w13, s13), routing.ids, dtype)
        torch.testing.assert_close(act, expect, atol=2e-2, rtol=2e-2)
        actq = per_token_group_quant(act)
        parts = torch.full((k + 1, t, h), float("nan"), device=device)
        moe_down(actq, w2, routing, down_tile, parts, s2)
        assert parts[k].isnan().all()
        act_dq = ref.dequantize_groups(actq.data[:t * k], actq.scale[:, :t * k].t())
        expect = ref.moe_down(act_dq, _dequantized(w2, s2), routing.weights, routing.ids)
        torch.testing.assert_close(parts[:k], expect, atol=1e-2, rtol=1e-2)


def test_fp8_tiles_hold_one_scale_each():
    """The FP8 table: one 128-deep K block and at most one 128-row block per tile, at every step size."""
    for t in (1, 32, 100, 256, 700, 5000):
        config = moe_config(t, 2048, 768, torch.bfloat16, fp8=True)
        for tile in (config.gate_up, config.down):
            assert tile.bk == 128 and 128 % tile.bn == 0 and not tile.tma


def test_moe_block_with_fp8_experts_on_the_kernel_path(device, gen):
    """SparseMoeBlock's GPU path over block-FP8 experts (its input and the SwiGLU output quantized in
    1 x 128 groups on the way) against HF's arithmetic over the dequantized experts: within the
    activations' quantization error."""
    from nanovllm.layers.fused_moe import SparseMoeBlock
    e, k, h, inter = FP8_SHAPE
    t = 40 if not ON_GPU else 300
    with torch.device(device):
        block = SparseMoeBlock(h, e, k, inter, renormalize=True, round_weights=True)
    (w13, s13), (w2, s2) = _fp8_experts(e, h, inter, device, gen)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(e, h, generator=gen) * h ** -0.5)
        dense = SparseMoeBlock(h, e, k, inter, renormalize=True, round_weights=True).to(device)
        dense.gate.weight.copy_(block.gate.weight)
        dense.experts.w13.copy_(_dequantized(w13, s13))
        dense.experts.w2.copy_(_dequantized(w2, s2))
    experts = block.experts
    experts.w13, experts.w2 = torch.nn.Parameter(w13, False), torch.nn.Parameter(w2, False)
    experts.w13_scale_inv, experts.w2_scale_inv = torch.nn.Parameter(s13, False), torch.nn.Parameter(s2, False)
    experts.quant_method = object()  # FP8 experts kept for the kernels (as Fp8ExpertsMethod leaves them on a GPU)
    x = torch.randn(t, h, generator=gen).to(device, GEMM_DTYPES[0])
    dense = dense.to(x.dtype)
    out = block._forward_kernels(x, block.gate.to(x.dtype)(x)).parts.float().sum(0)
    weights, ids = dense.route_torch(dense.gate(x))
    expect = dense.experts_torch(x, weights, ids).float()
    # Two e4m3 roundings of the activations (input and SwiGLU output): 0.043 measured (CPU, fp16).
    assert ((out - expect).norm() / expect.norm()).item() < 0.08
