"""Mixture-of-experts models beyond greedy parity (tests/models/test_parity.py): configs we cannot
honour fail at load naming the field, checkpoints load completely or not at all, random weights, and
the record of the router's choices that bench.py's roofline reads."""
import os
import shutil

import pytest
import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from nanovllm import LLM, SamplingParams
from nanovllm.layers.fused_moe import RoutingStats, SparseMoeBlock
from nanovllm.models.loader import build_model

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _config(model_factory, arch, **changes):
    """The model's config with changes; values HF's typed fields refuse are set past its validators."""
    hf = AutoConfig.from_pretrained(model_factory(arch))
    for key, value in changes.items():
        try:
            setattr(hf, key, value)
        except StrictDataclassError:
            hf.__dict__[key] = value
    return hf


@pytest.mark.parametrize("arch,changes,match", [
    ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act='gelu': only SiLU-gated"),
    ("qwen3_moe", dict(num_experts_per_tok=9), r"num_experts_per_tok=9: must be in \[1, 8\]"),
    ("qwen3_moe", dict(num_experts_per_tok=0), "num_experts_per_tok=0: must be an integer >= 1"),
    ("qwen3_moe", dict(moe_intermediate_size=None), "moe_intermediate_size=None: must be an integer >= 1"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0: must be an integer >= 1"),
    ("qwen3_moe", dict(norm_topk_prob="yes"), "norm_topk_prob='yes': must be true or false"),
    ("qwen3_moe", dict(mlp_only_layers="1"), "mlp_only_layers='1': must be a list of layer indices"),
    ("qwen3_moe", dict(num_experts=2048, num_experts_per_tok=2), "num_experts=2048: at most 1024 experts"),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=64),
     "sliding_window=64 with use_sliding_window=true: sliding-window attention is not supported"),
    ("qwen3_moe", dict(scoring_func="sigmoid"), "scoring_func='sigmoid': this MoE routing feature is not supported"),
    ("qwen3_moe", dict(n_group=8, topk_group=4), "n_group=8: this MoE routing feature is not supported"),
    ("qwen3_moe", dict(routed_scaling_factor=2.5), "routed_scaling_factor=2.5: this MoE routing feature"),
    ("qwen3_moe", dict(n_shared_experts=1), "n_shared_experts=1: this MoE routing feature"),
    ("mixtral", dict(sliding_window=4096), "sliding_window=4096: sliding-window attention is not supported"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts=0: must be an integer >= 1"),
    ("qwen2_moe", dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size=0: must be an integer"),
])
def test_unsupported_configs_fail_at_load_naming_the_field(arch, changes, match, model_factory):
    with pytest.raises(ValueError, match=match):
        LLM(model_factory(arch), hf_config=_config(model_factory, arch, **changes), dtype="float32")


def test_bad_configs_fail_before_tensor_parallel_workers_start(model_factory):
    import multiprocessing
    with pytest.raises(ValueError, match=r"num_experts_per_tok=9: must be in \[1, 8\]"):
        LLM(model_factory("qwen3_moe"), hf_config=_config(model_factory, "qwen3_moe", num_experts_per_tok=9),
            tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_tensor_parallel_must_divide_the_expert_sizes(model_factory):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide moe_intermediate_size=33"):
        LLM(model_factory("qwen3_moe"), hf_config=_config(model_factory, "qwen3_moe", moe_intermediate_size=33),
            tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide shared_expert_intermediate_size=47"):
        LLM(model_factory("qwen2_moe"), hf_config=_config(model_factory, "qwen2_moe", shared_expert_intermediate_size=47),
            tensor_parallel_size=2)


def _edited_checkpoint(model_factory, tmp_path, arch, edit) -> str:
    path = tmp_path / arch
    shutil.copytree(model_factory(arch), path)
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")
    return str(path)


def test_a_checkpoint_missing_an_expert_is_refused(model_factory, tmp_path):
    path = _edited_checkpoint(model_factory, tmp_path, "qwen3_moe",
                              lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"lacks weights for: model\.layers\.2\.mlp\.experts\.w13 "
                                         r"\(1 of its 16 expert shards\)"):
        LLM(path, dtype="float32")


def test_a_checkpoint_with_foreign_experts_is_refused(model_factory, tmp_path):
    def extra_expert(t):
        t["model.layers.0.mlp.experts.8.down_proj.weight"] = t["model.layers.0.mlp.experts.0.down_proj.weight"].clone()
    with pytest.raises(ValueError, match="checkpoint has expert 8, but the config has num_experts=8"):
        LLM(_edited_checkpoint(model_factory, tmp_path, "qwen3_moe", extra_expert), dtype="float32")

    def wide(t):
        t["model.layers.0.block_sparse_moe.experts.1.w1.weight"] = torch.zeros(80, 64)
    with pytest.raises(ValueError, match=r"expert 1 weight has shape \(80, 64\), expected \(64, 64\)"):
        LLM(_edited_checkpoint(model_factory, tmp_path, "mixtral", wide), dtype="float32")


def test_stacked_experts_hold_the_checkpoint_tensors(model_factory):
    """Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2 land in mlp.experts.w13 (gate rows, then up) and w2."""
    path = model_factory("mixtral")
    llm = LLM(path, dtype="float32")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    experts = llm.engine.model_runner.model.model.layers[1].mlp.experts
    for e in range(4):
        prefix = f"model.layers.1.block_sparse_moe.experts.{e}"
        w13 = torch.cat([tensors[f"{prefix}.w1.weight"], tensors[f"{prefix}.w3.weight"]])
        assert torch.equal(experts.w13[e], w13) and torch.equal(experts.w2[e], tensors[f"{prefix}.w2.weight"])


def test_dense_and_sparse_layers_follow_the_config(model_factory):
    def kinds(arch):
        model = build_model(AutoConfig.from_pretrained(model_factory(arch)), torch.float32, torch.device("cpu"))
        return [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert kinds("qwen3_moe") == [True, False, True]  # mlp_only_layers=[1]
    assert kinds("qwen3_moe_sparse2") == [False, True, False, True]  # decoder_sparse_step=2
    assert kinds("mixtral") == [True, True]


def test_random_weights_for_benchmarks(model_factory, tmp_path):
    """load_format='dummy' needs only config.json (bench.py's configs)."""
    path = tmp_path / "config_only"
    path.mkdir()
    shutil.copy(os.path.join(model_factory("qwen3_moe"), "config.json"), path / "config.json")
    llm = LLM(str(path), load_format="dummy", dtype="float32")
    out = llm.generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)[0]
    assert len(out["token_ids"]) == 4


def test_routing_stats_count_distinct_experts_per_forward(model_factory, monkeypatch):
    monkeypatch.setenv("NANOVLLM_RECORD_ROUTING", "1")
    llm = LLM(model_factory("qwen3_moe"), dtype="float32")
    blocks = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 2 and all(isinstance(b.routing_stats, RoutingStats) for b in blocks)
    before = [int(b.routing_stats.step) for b in blocks]
    llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    for block, start in zip(blocks, before):
        step = int(block.routing_stats.step)
        assert step - start == 3  # one prefill, two decode steps
        distinct = block.routing_stats.distinct[start:step].tolist()
        assert distinct[0] >= 2 and all(d == 2 for d in distinct[1:])  # one token decodes: its top-2
