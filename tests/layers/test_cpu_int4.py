"""The CPU's int4 products of GGUF 4-bit blocks (layers/cpu_int4.py)."""
import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.layers.cpu_int4 import INT4_MAX_ROWS, int4_available, int4_linear, pack_int4

pytestmark = pytest.mark.skipif(not int4_available(), reason="torch lacks the CPU int4 product")


def test_int4_product_is_the_blocks_weight_times_x():
    g = torch.Generator().manual_seed(0)
    n, k = 96, 128
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    offset = -8 * scale + torch.randn(n, k // 32, generator=g) * 0.005
    packed, scales_zeros = pack_int4(codes, scale, offset, torch.bfloat16)
    s, z = scales_zeros[..., 0].float().T, scales_zeros[..., 1].float().T  # [N, K / 32], as the kernel sees them
    weight = (codes.float() - 8) * s.repeat_interleave(32, 1) + z.repeat_interleave(32, 1)
    exact = scale.repeat_interleave(32, 1) * codes.float() + offset.repeat_interleave(32, 1)
    assert (weight - exact).abs().max() <= 2 ** -8 * exact.abs().max()  # only the bf16 scales and zeros differ
    x = torch.randn(INT4_MAX_ROWS, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    y = int4_linear(x, packed, scales_zeros, bias)
    ref = x.float() @ weight.T + bias.float()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=1e-2)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="bf16 CPU products need oneDNN")
def test_embedded_model_decodes_with_int4_unless_eager(smollm_dir):
    def int4_layers(llm):
        return sum(m.int4_weight is not None for m in llm.engine.model_runner.model.modules()
                   if hasattr(m, "int4_weight"))

    with LLM(dtype="bfloat16", max_model_len=256) as llm:
        assert int4_layers(llm) == 30 * 4  # qkv, o, gate_up, down of every layer
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        assert "Paris" in out["text"], out["text"]
    with LLM(dtype="bfloat16", max_model_len=256, enforce_eager=True) as llm:
        assert int4_layers(llm) == 0  # the bf16 reference
