"""Block-FP8 mixture-of-experts checkpoints (the Qwen3-30B-A3B-FP8 format) on the CPU: a tiny
Qwen3-MoE written with float8 experts and attention projections (128x128 block scales, partial
blocks at the hidden size's edges, the router left in the model dtype) runs greedy-equal to HF
transformers on the dequantized weights, alone and over two ranks; quantization="fp8" on a plain
MoE checkpoint; expert sizes that would cut a block, and Qwen2-MoE's shared expert, are refused."""
import os

import pytest
import torch

from helpers import HFReference, assert_greedy_match, make_fp8_model
from nanovllm import LLM, SamplingParams

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((1, 5, 23, 70))]


@pytest.fixture(scope="module")
def fp8_moe(tmp_path_factory):
    """(FP8 checkpoint, its dequantized twin, HF reference on the twin); experts of 256 rows, so
    that two ranks hold 128 each."""
    root = tmp_path_factory.mktemp("fp8_moe")
    path, ref = str(root / "fp8"), str(root / "ref")
    os.makedirs(path)
    make_fp8_model(path, ref, moe=True, moe_intermediate_size=256)
    return path, ref, HFReference(ref)


def _check_hf(llm, hf, what):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for p, out in zip(PROMPTS, outs):
        assert_greedy_match(out["token_ids"], *hf.greedy(p, MAX_NEW), f"{what} prompt len {len(p)}")


def test_fp8_moe_checkpoint_matches_hf_on_the_dequantized_weights(fp8_moe):
    path, _, hf = fp8_moe
    with LLM(path, dtype="float32", kvcache_block_size=16) as llm:
        assert llm.config.quant_config.name == "fp8" and llm.config.quant_config.from_checkpoint
        layers = llm.engine.model_runner.model.model.layers
        experts, dense = layers[0].mlp.experts, layers[1].mlp
        # On the CPU the experts are dequantized once at load into the model dtype; their scales are gone.
        assert experts.w13.dtype == experts.w2.dtype == torch.float32 and experts.quant_method is None
        assert not hasattr(experts, "w13_scale_inv") and not hasattr(experts, "w2_scale_inv")
        assert experts.w13.shape == (8, 512, 200) and experts.w2.shape == (8, 200, 256)
        assert layers[0].mlp.gate.weight.dtype == torch.float32  # the router, as the checkpoint holds it
        assert dense.gate_up_proj.weight.dtype == torch.float32  # the dense layer (mlp_only_layers)
        _check_hf(llm, hf, "fp8 moe")


def test_fp8_moe_checkpoint_over_two_ranks(fp8_moe):
    """Each rank takes its 128 rows of every expert's gate and up and its 128 columns of down, with
    their block scales."""
    path, _, hf = fp8_moe
    with LLM(path, dtype="float32", tensor_parallel_size=2, kvcache_block_size=16, max_model_len=256) as llm:
        _check_hf(llm, hf, "fp8 moe tp=2")


def test_a_plain_moe_checkpoint_quantized_at_load(fp8_moe):
    """quantization="fp8" on the dequantized twin: every projection and expert rounded through block
    FP8 gives back its own blocks, so the outputs are HF's on the twin."""
    _, ref, hf = fp8_moe
    with LLM(ref, dtype="float32", quantization="fp8", kvcache_block_size=16) as llm:
        assert not llm.config.quant_config.from_checkpoint
        _check_hf(llm, hf, "moe quantized at load")


def test_expert_sizes_that_cut_a_block_are_refused(fp8_moe, tmp_path):
    path, ref = str(tmp_path / "fp8"), str(tmp_path / "ref")
    os.makedirs(path)
    make_fp8_model(path, ref, moe=True, moe_intermediate_size=128)
    with pytest.raises(ValueError, match="moe_intermediate_size=128 / tensor_parallel_size=2 = 64 is not a multiple "
                                         "of 128"):
        LLM(path, dtype="float32", tensor_parallel_size=2)


def test_an_expert_scale_of_the_wrong_shape_is_refused(fp8_moe, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    path = str(tmp_path / "bad")
    shutil.copytree(fp8_moe[0], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"expert 3 weight_scale_inv has shape \(2, 1\), expected \(2, 2\)"):
        LLM(path, dtype="float32")


def test_fp8_quantization_of_qwen2_moe_is_refused(model_factory):
    with pytest.raises(ValueError, match=r"quantization='fp8': Qwen2MoeForCausalLM has no quantized layers yet "
                                         r"\(Qwen2-MoE's shared expert has no FP8 form\)"):
        LLM(model_factory("qwen2_moe"), quantization="fp8")


def test_an_expert_left_unquantized_is_refused(fp8_moe, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    path = str(tmp_path / "bf16_expert")
    shutil.copytree(fp8_moe[0], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.mlp.experts.5.up_proj.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    del tensors[name + "_scale_inv"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="expert 5 weight is torch.bfloat16, expected float8_e4m3fn"):
        LLM(path, dtype="float32")
