"""The engine on a CUDA GPU: Triton backend, CUDA graphs and overlapped steps against HF and
against the torch reference backend. Collected only where CUDA is available (see conftest)."""
import os

import pytest
import torch

from gpu_helpers import assert_bf16_agreement, greedy, greedy_topk, make_prompts
from helpers import assert_greedy_match
from nanovllm import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN3_06B = os.path.join(HERE, "..", "..", "benchmarks", "configs", "qwen3-0.6b.json")


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_matches_hf_fp32(arch, enforce_eager, model_factory, hf_reference):
    with LLM(model_factory(arch), dtype="float32", enforce_eager=enforce_eager, max_model_len=1024,
             max_num_seqs=64, kvcache_block_size=16, gpu_memory_utilization=0.3) as llm:
        assert llm.engine.model_runner.backend.name == "triton"
        assert llm.engine.model_runner.backend.fuses_kv_store  # k/v reach the cache via the rope kernel
        assert (llm.engine.model_runner.graph_runner is None) == enforce_eager
        assert (llm.engine.model_runner.piecewise is None) == enforce_eager
        prompts = make_prompts(1)
        outs = greedy(llm, prompts)
    for p, ours in zip(prompts, outs):
        assert_greedy_match(ours, *hf_reference(arch).greedy(p, 24), f"{arch} eager={enforce_eager}")


def test_prefix_chunked_preempted_overlapped_fp32(model_factory, hf_reference):
    llm = LLM(model_factory("qwen3"), dtype="float32", max_model_len=512, kvcache_block_size=16,
              num_kvcache_blocks=40, max_num_batched_tokens=200, max_num_seqs=64)
    assert llm.engine.overlap
    shared = make_prompts(2, lengths=(100,))[0]
    prompts = [shared + p for p in make_prompts(3, lengths=(5, 40, 90, 200, 300))]
    for rep in range(2):  # the second pass hits the prefix cache
        for p, ours in zip(prompts, greedy(llm, prompts)):
            assert_greedy_match(ours, *hf_reference("qwen3").greedy(p, 24), f"pass {rep}")
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.block_manager.prefix_hits > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()


def test_partial_block_hits_through_the_graphs_fp32(model_factory, hf_reference):
    """256-token pages: a next turn's hit ends inside a block, whose leading tokens the Triton
    kernel copies before the step, ahead of the piecewise graphs (the rest of the prompt) and of the
    decode graphs (a prompt one token past a cached one is a one-token step: a 'decode')."""
    llm = LLM(model_factory("qwen3"), dtype="float32", max_model_len=1024, max_num_seqs=64,
              gpu_memory_utilization=0.3)
    runner = llm.engine.model_runner
    assert runner.graph_runner is not None and runner.piecewise is not None
    copies = []
    kernel = runner._copy_kernel
    runner._copy_kernel = lambda kv, c, n: (copies.append(c.shape[1]), kernel(kv, c, n))
    prompts = make_prompts(8, lengths=(30, 129, 250, 400))
    answers = greedy(llm, prompts)
    histories = [p + a for p, a in zip(prompts, answers)]
    # Longer than the first prompts: the copy's source is the first turn's partial block, which
    # holds more tokens than are shared (not the block itself: that is taken when it holds exactly them).
    turn2 = [histories[0][:20] + [7] * 40, histories[1][:100] + [9] * 5, histories[2] + [11, 12, 13]]
    outs = llm.generate(turn2, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o["num_cached_tokens"] for o in outs] == [20, 100, len(histories[2]) - 1]
    one_more = histories[3][:300] + [5]  # 300 tokens cached: a step of one token, alone
    alone = llm.generate([one_more], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    assert alone["num_cached_tokens"] == 300
    assert len(copies) == 2 and sum(copies) == 3  # one launch per step: 2 copies, then 1
    for p, out in zip(turn2 + [one_more], outs + [alone]):
        assert_greedy_match(out["token_ids"], *hf_reference("qwen3").greedy(p, 24), f"prompt of {len(p)}")
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    llm.shutdown()


def test_cuda_graphs_identical_to_eager_fp32(model_factory):
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3)
    prompts = make_prompts(4) * 3  # 24 sequences: padded up to a captured batch size
    with LLM(model_factory("llama"), **kwargs) as llm:
        graphs = greedy(llm, prompts, 40)
    with LLM(model_factory("llama"), enforce_eager=True, **kwargs) as llm:
        eager = greedy(llm, prompts, 40)
    assert graphs == eager


def test_piecewise_graphs_chunks_and_mixed_steps_fp32(model_factory, hf_reference, monkeypatch):
    """Prefill chunks and mixed steps (decode rows riding along) through the piecewise graphs,
    padded up to a captured token count, generate HF's tokens; the same run with the piecewise
    graphs off gives the same tokens."""
    from nanovllm.worker import piecewise_graph
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_batched_tokens=300, max_num_seqs=64,
                  gpu_memory_utilization=0.3)
    prompts = make_prompts(7)  # 1 .. 700 tokens: chunks of up to 300
    with LLM(model_factory("llama"), **kwargs) as llm:
        graphs = llm.engine.model_runner.piecewise
        assert graphs.buckets == [16, 32, 64, 128, 256, 300]
        sizes = []
        forward = graphs.forward
        graphs.forward = lambda ids, pos, meta: (sizes.append(ids.shape[0]), forward(ids, pos, meta))[1]
        outs = greedy(llm, prompts)
    for p, ours in zip(prompts, outs):
        assert_greedy_match(ours, *hf_reference("llama").greedy(p, 24), "piecewise")
    assert max(sizes) == 300 and any(n not in graphs.buckets for n in sizes)  # full and padded steps ran
    monkeypatch.setattr(piecewise_graph, "ENABLED", False)
    with LLM(model_factory("llama"), **kwargs) as llm:
        assert llm.engine.model_runner.piecewise is None
        assert greedy(llm, prompts) == outs


def test_cuda_graph_sampling_identical_to_eager_fp32(model_factory):
    """Seeded random draws: the sampling graph (keys derived in the kernel), decode rows whose
    input comes from the previous step's samples on the device, and batches mixing plain rows
    with rows that need the eager sampler (top-k, logprobs, min_tokens, penalties) all give the
    tokens of the eager engine."""
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3)
    prompts = make_prompts(6) * 2
    plain = [SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True) for i in range(len(prompts))]
    mixed = list(plain)
    mixed[1] = SamplingParams(temperature=0.8, seed=1, top_k=20, max_tokens=30, ignore_eos=True)
    mixed[4] = SamplingParams(temperature=0.8, seed=4, logprobs=2, max_tokens=30, ignore_eos=True)
    mixed[6] = SamplingParams(temperature=0.8, seed=6, min_tokens=10, max_tokens=30)
    mixed[9] = SamplingParams(temperature=0.0, presence_penalty=0.5, max_tokens=30, ignore_eos=True)
    runs = {}
    for eager in (False, True):
        with LLM(model_factory("llama"), enforce_eager=eager, **kwargs) as llm:
            runs[eager] = [[o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
                           for params in (plain, mixed)]
    assert runs[False] == runs[True]
    assert len(set(map(tuple, runs[False][0]))) > len(prompts) // 2  # seeds differ: so do the draws


@pytest.mark.parametrize("filters", ["top_k", "top_p", "mixed"])
def test_qwen3_06b_bf16_filter_kernels_draw_the_torch_paths_tokens(filters, tmp_path, monkeypatch):
    """Seeded top-k (+ top-p, + min-p) requests, or top-p requests beside plain random ones, with greedy ones,
    on bf16 logits: the sampler's kernels (kernels/sample_top_k.py, sample_top_p.py) give the
    tokens of its torch path."""
    import shutil

    import nanovllm.layers.sampler as sampler
    shutil.copy(QWEN3_06B, tmp_path / "config.json")
    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=16,
                  gpu_memory_utilization=0.3)
    prompts = make_prompts(8, lengths=(10, 100, 300, 40, 200, 70, 150, 500))
    if filters == "top_k":
        params = [SamplingParams(temperature=0.0 if i % 4 == 3 else 0.9, top_k=(20, 50, 128)[i % 3],
                                 top_p=0.9 if i % 2 else 1.0, min_p=0.1 if i % 4 == 1 else 0.0, seed=i,
                                 max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    elif filters == "mixed":  # rows with a top_k beside random rows without one: the batch is split
        params = [SamplingParams(temperature=0.9, top_k=40 if i % 2 else -1, top_p=0.9 if i % 3 else 1.0, seed=i,
                                 max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
    else:
        params = [SamplingParams(temperature=0.0 if i % 4 == 3 else 0.9, top_p=(0.5, 0.9, 1.0)[i % 3], seed=i,
                                 max_tokens=24, ignore_eos=True) for i in range(len(prompts))]
        # Penalties and min_tokens bans: the kernel then draws from the float32 logits they leave.
        params[1] = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                                   seed=1, max_tokens=24, ignore_eos=True)
        params[4] = SamplingParams(temperature=0.9, top_p=0.8, min_tokens=10, stop_token_ids=[0, 1, 2], seed=4,
                                   max_tokens=24)
    runs = []
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(sampler, "filter_kernel_draw", lambda *args: None)
        with LLM(str(tmp_path), **kwargs) as llm:
            runs.append([o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert len(set(map(tuple, runs[0]))) == len(prompts)


def test_qwen3_06b_bf16_triton_agrees_with_torch_backend(tmp_path):
    import shutil
    shutil.copy(QWEN3_06B, tmp_path / "config.json")
    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=16,
                  gpu_memory_utilization=0.3)
    prompts = make_prompts(5, lengths=(10, 100, 300, 1000))
    with LLM(str(tmp_path), **kwargs) as fast:
        a = greedy(fast, prompts, 8)
    with LLM(str(tmp_path), attention_backend="torch", enforce_eager=True, **kwargs) as ref:
        b = greedy_topk(ref, prompts, 8)
    assert_bf16_agreement(a, b, "triton vs torch backend")


def test_qwen3_06b_bf16_decode_at_every_batch_size_agrees_with_torch_backend(tmp_path):
    """Decode attention through the split kernel at every batch size of a ragged batch as it drains, CUDA
    graphs on, against the torch backend."""
    import shutil

    shutil.copy(QWEN3_06B, tmp_path / "config.json")
    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=16,
                  gpu_memory_utilization=0.3)
    prompts = make_prompts(5, lengths=(10, 100, 300, 1000))
    with LLM(str(tmp_path), **kwargs) as fast:
        a = greedy(fast, prompts, 8)
    with LLM(str(tmp_path), attention_backend="torch", enforce_eager=True, **kwargs) as ref:
        b = greedy_topk(ref, prompts, 8)
    assert_bf16_agreement(a, b, "split decode vs torch backend")


def test_kv_cache_sized_from_gpu_memory_utilization(tmp_path):
    import shutil
    shutil.copy(QWEN3_06B, tmp_path / "config.json")
    with LLM(str(tmp_path), load_format="dummy", gpu_memory_utilization=0.2, enforce_eager=True) as small:
        n_small = small.config.num_kvcache_blocks
    with LLM(str(tmp_path), load_format="dummy", gpu_memory_utilization=0.4, enforce_eager=True) as big:
        n_big = big.config.num_kvcache_blocks
        block_bytes = big.engine.model_runner.block_bytes
    total = torch.cuda.get_device_properties(0).total_memory
    # 20% more of the GPU becomes 20% more KV cache, give or take a block.
    assert abs((n_big - n_small) * block_bytes - 0.2 * total) < 0.02 * total


def test_qwen3_06b_bf16_triton_projections_agree_with_cublas(tmp_path, monkeypatch):
    """Decode projections on our GEMM kernel (split-K partials summed in the RMSNorm, dense qkv,
    SwiGLU-fused gate_up, qkv with the rotary kernel's work in its epilogue) vs plain cuBLAS GEMMs,
    on decode batches of 24 sequences (a CUDA graph of 32 rows)."""
    import shutil

    import nanovllm.kernels.gemm as gemm
    import nanovllm.kernels.qkv_rope as qkv_rope
    shutil.copy(QWEN3_06B, tmp_path / "config.json")
    kwargs = dict(load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
                  gpu_memory_utilization=0.3)
    prompts = [p for seed in range(6, 12) for p in make_prompts(seed, lengths=(10, 100, 300, 1000))]
    used = {"splitk": [], "dense": [], "qkv_rope": []}
    splitk_config, dense_config, rope_config = gemm.splitk_config, gemm.dense_config, qkv_rope.qkv_rope_config
    monkeypatch.setattr(gemm, "splitk_config", lambda m, n, k: used["splitk"].append(m) or splitk_config(m, n, k))
    monkeypatch.setattr(gemm, "dense_config",
                        lambda m, n, k, gated=False: used["dense"].append(m) or dense_config(m, n, k, gated))
    monkeypatch.setattr(qkv_rope, "qkv_rope_config",
                        lambda m, k, d: (used["qkv_rope"].append(m) if rope_config(m, k, d) else None) or rope_config(m, k, d))
    with LLM(str(tmp_path), **kwargs) as fast:
        a = greedy(fast, prompts, 8)
    assert used["splitk"] and used["qkv_rope"]  # decode steps took our kernels (up to 16 rows: the test above)
    monkeypatch.setattr(gemm, "splitk_config", lambda m, n, k: None)
    monkeypatch.setattr(gemm, "dense_config", lambda m, n, k, gated=False: None)
    monkeypatch.setattr(qkv_rope, "qkv_rope_config", lambda m, k, d: None)
    with LLM(str(tmp_path), **kwargs) as ref:
        b = greedy_topk(ref, prompts, 8)
    assert_bf16_agreement(a, b, "our projections vs cuBLAS")


def test_structured_outputs_graphs_and_overlap_identical_to_eager_fp32(model_factory):
    """Constrained rows (masked CUDA graph draw, eager masked paths with top-k and logprobs) beside free
    ones: the tokens of the eager engine, and of the engine without overlap (the deferred draw
    waits for the previous step's tokens either way); every constrained output follows its grammar."""
    import json
    import re

    from nanovllm import StructuredOutputsParams as C
    kwargs = dict(dtype="float32", max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.3)
    prompts = make_prompts(6) * 2
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"]}
    kinds = [C(json=schema, disable_any_whitespace=True), C(choice=["alpha", "beta", "gamma"]), C(regex=r"[a-z]{3}\d")]
    params = []
    for i in range(len(prompts)):
        extra = {"top_k": 20} if i == 7 else {"logprobs": 2} if i == 9 else {}
        constraint = kinds[i % 3] if i % 4 != 3 else None  # every fourth row free
        params.append(SamplingParams(temperature=0.0 if i % 5 == 0 else 0.8, seed=i, max_tokens=40,
                                     structured_outputs=constraint, **extra))
    runs = []
    for eager, overlap in ((False, True), (True, True), (False, False)):
        with LLM(model_factory("llama"), enforce_eager=eager, **kwargs) as llm:
            llm.engine.overlap = overlap
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([o["token_ids"] for o in outs])
            assert llm.engine.model_runner.mask_fill.steps > 0
    assert runs[0] == runs[1] == runs[2]
    for out, sp in zip(outs, params):
        c = sp.structured_outputs
        if c is None:
            continue
        assert out["finish_reason"] == "stop", out
        if c.kind == "json":
            assert set(json.loads(out["text"])) == {"n", "ok"}
        elif c.kind == "choice":
            assert out["text"] in ("alpha", "beta", "gamma")
        else:
            assert re.fullmatch(r"[a-z]{3}\d", out["text"])
