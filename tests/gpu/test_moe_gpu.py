"""Mixture-of-experts models on a CUDA GPU: the fused-MoE Triton kernels (routing, alignment, grouped
GEMMs, the combine in the next RMSNorm) inside both kinds of CUDA graph, against HF (fp32), against
eager steps, and in bf16 at Qwen3-30B-A3B's layer sizes against the block's torch path."""
import json
import os

import pytest

from gpu_helpers import assert_bf16_agreement, greedy, greedy_topk, make_prompts
from helpers import assert_greedy_match
from nanovllm import LLM

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN3_30B_A3B = os.path.join(HERE, "..", "..", "benchmarks", "configs", "qwen3-30b-a3b.json")
FP32 = dict(dtype="float32", max_model_len=1024, max_num_seqs=64, kvcache_block_size=16, gpu_memory_utilization=0.3)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_moe_greedy_matches_hf_fp32(arch, enforce_eager, model_factory, hf_reference):
    with LLM(model_factory(arch), enforce_eager=enforce_eager, **FP32) as llm:
        assert (llm.engine.model_runner.graph_runner is None) == enforce_eager
        prompts = make_prompts(1)
        outs = greedy(llm, prompts)
    for p, ours in zip(prompts, outs):
        assert_greedy_match(ours, *hf_reference(arch).greedy(p, 24), f"{arch} eager={enforce_eager}")


def test_moe_cuda_graphs_identical_to_eager_fp32(model_factory):
    """Decode graphs (24 sequences padded to 32 rows) and piecewise graphs (chunks of up to 200
    tokens padded to a captured count) give the eager engine's tokens."""
    prompts = make_prompts(4) * 3
    runs = []
    for eager in (False, True):
        with LLM(model_factory("qwen3_moe"), enforce_eager=eager, max_num_batched_tokens=200, **FP32) as llm:
            runs.append(greedy(llm, prompts, 40))
    assert runs[0] == runs[1]


def test_moe_prefix_chunked_preempted_overlapped_fp32(model_factory, hf_reference):
    llm = LLM(model_factory("qwen3_moe"), dtype="float32", max_model_len=512, kvcache_block_size=16,
              num_kvcache_blocks=40, max_num_batched_tokens=200, max_num_seqs=64)
    assert llm.engine.overlap
    shared = make_prompts(2, lengths=(100,))[0]
    prompts = [shared + p for p in make_prompts(3, lengths=(5, 40, 90, 200, 300))]
    for rep in range(2):  # the second pass hits the prefix cache
        for p, ours in zip(prompts, greedy(llm, prompts)):
            assert_greedy_match(ours, *hf_reference("qwen3_moe").greedy(p, 24), f"pass {rep}")
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits > 0
    llm.shutdown()


def test_qwen3_30b_a3b_layers_bf16_kernels_agree_with_torch_path(tmp_path, monkeypatch):
    """Qwen3-30B-A3B's layers (128 experts of 768, 8 per token, hidden 2048; 4 of its 48) with random
    bf16 weights: the kernels, CUDA graphs on, against the block's torch path (eager), on prompts that
    reach decode batches of 16 rows and prefill chunks in every tile table entry."""
    from nanovllm.kernels import moe_routing
    from nanovllm.layers.fused_moe import SparseMoeBlock
    with open(QWEN3_30B_A3B) as f:
        config = json.load(f)
    config["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=16, gpu_memory_utilization=0.3)
    prompts = make_prompts(5, lengths=(10, 100, 300, 1000)) * 4
    routed = []
    route = moe_routing.route
    monkeypatch.setattr(moe_routing, "route", lambda logits, *a, **k: routed.append(logits.shape[0]) or route(logits, *a, **k))
    with LLM(str(tmp_path), **kwargs) as fast:
        a = greedy(fast, prompts, 8)
    assert routed and max(routed) > 768  # decode and prefill sizes took the kernels

    def torch_path(self, x, logits, padding_slots=None):  # forward passes the slot mapping (padding rows)
        weights, ids = self.route_torch(logits)
        return self.experts_torch(x, weights, ids)
    monkeypatch.setattr(SparseMoeBlock, "_forward_kernels", torch_path)
    with LLM(str(tmp_path), enforce_eager=True, **kwargs) as ref:
        b = greedy_topk(ref, prompts, 8)
    assert_bf16_agreement(a, b, "fused-MoE kernels vs the torch path")
