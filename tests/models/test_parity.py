"""Greedy output and logits of our engine against HF transformers (fp32, CPU), per architecture,
including the engine paths that must not change results: prefix-cache hits, chunked prefill,
preemption and different block sizes."""
import random

import pytest
import torch

from helpers import assert_greedy_match
from nanovllm import LLM, SamplingParams

DENSE = ["qwen3", "qwen2", "llama", "llama_mha"]
# Mixtures of experts: renormalised top-k with a dense layer, unnormalised every second layer, Mixtral's
# fp32 routing weights, Qwen2-MoE's shared expert.
MOE = ["qwen3_moe", "qwen3_moe_sparse2", "mixtral", "qwen2_moe"]
ARCHS = DENSE + MOE
MAX_NEW = 20


def _prompts(seed: int = 1, n: int = 8, shared_prefix: int = 0) -> list[list[int]]:
    """Prompts of 1-230 tokens. The engine paths below (chunked prefill, preemption, block sizes,
    overlap) take the same default set: HF's continuations of it are computed once per architecture
    (hf_reference caches them), which is most of these tests' time."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(shared_prefix)]
    lengths = [1, 5, 17, 33, 64, 100, 150, 230][:n]
    return [prefix + [rng.randrange(3, 500) for _ in range(L)] for L in lengths]


def _check(llm: LLM, ref, prompts, what: str):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, out in zip(prompts, outs):
        hf_tokens, hf_scores = ref.greedy(p, MAX_NEW)
        assert_greedy_match(out["token_ids"], hf_tokens, hf_scores, f"{what} prompt len {len(p)}")
        assert out["finish_reason"] == "length"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, model_factory, hf_reference):
    llm = LLM(model_factory(arch), dtype="float32")
    _check(llm, hf_reference(arch), _prompts(), arch)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_text_prompts_match_hf(arch, model_factory, hf_reference):
    llm = LLM(model_factory(arch), dtype="float32")
    tok = llm.get_tokenizer()
    texts = ["Hello, world!", "list all prime numbers within 100", "The quick brown fox",
             "What is the capital of France?", "Über café 東京", "a", "def main():", "2 3 5 7 11 13"]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(texts, params, use_tqdm=False)
    for text, out in zip(texts, outs):
        ids = tok.encode(text)
        assert_greedy_match(out["token_ids"], *hf_reference(arch).greedy(ids, MAX_NEW), f"{arch} {text!r}")
        assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)


@pytest.mark.parametrize("arch,block_size", [(arch, 16) for arch in DENSE + ["qwen3_moe", "mixtral"]] + [("qwen3", 256)])
def test_prefix_cache_hits_keep_output(arch, block_size, model_factory, hf_reference):
    llm = LLM(model_factory(arch), dtype="float32", kvcache_block_size=block_size)
    prompts = _prompts(2, shared_prefix=40)  # 16-token blocks: 2 full shared blocks + part of a third
    _check(llm, hf_reference(arch), prompts, f"{arch} first pass")
    bm = llm.engine.block_manager
    hits_before = bm.prefix_hits
    outs = _check(llm, hf_reference(arch), prompts, f"{arch} second pass")
    # Second pass: every prompt but its last token comes from the cache (the first pass's finished
    # sequences offered all they computed): full blocks shared, the rest copied from a partial one.
    assert bm.prefix_hits - hits_before == sum(len(p) - 1 for p in prompts)
    assert [o["num_cached_tokens"] for o in outs] == [len(p) - 1 for p in prompts]


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe", "mixtral"])
def test_chunked_prefill(arch, model_factory, hf_reference):
    llm = LLM(model_factory(arch), dtype="float32", kvcache_block_size=16, max_num_batched_tokens=37)
    _check(llm, hf_reference(arch), _prompts(), f"{arch} chunked")


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_preemption(arch, model_factory, hf_reference):
    # 24 blocks of 16 tokens: the 8 prompts (+ outputs) need ~50, so sequences must be preempted.
    llm = LLM(model_factory(arch), dtype="float32", kvcache_block_size=16, num_kvcache_blocks=24,
              max_model_len=300)
    _check(llm, hf_reference(arch), _prompts(), f"{arch} preempted")
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


@pytest.mark.parametrize("block_size", [16, 256])
def test_block_sizes(block_size, model_factory, hf_reference):
    llm = LLM(model_factory("qwen2"), dtype="float32", kvcache_block_size=block_size)
    _check(llm, hf_reference("qwen2"), _prompts(), f"block size {block_size}")


@pytest.mark.parametrize("arch", ARCHS)
def test_one_forward_logits(arch, model_factory, hf_reference):
    """Logits of one prefill step against HF's forward, max abs diff bounded."""
    llm = LLM(model_factory(arch), dtype="float32")
    engine = llm.engine
    prompt = _prompts(6)[6]
    seq = engine.add_request("logits", prompt, SamplingParams(temperature=0.0, max_tokens=1))[0]
    batch = engine.scheduler.schedule()
    runner = engine.model_runner
    from nanovllm.worker.inputs import build_forward_batch
    with torch.inference_mode():
        fb = build_forward_batch(batch, runner.block_size, runner.device)
        logits = runner.model.compute_logits(runner.model(fb.input_ids, fb.positions, fb.attn))
    ref = hf_reference(arch).logits(prompt)
    diff = (logits.float() - ref).abs().max().item()
    print(f"{arch}: max |logits - HF| = {diff:.3g}")
    assert diff < 1e-4 * max(1.0, ref.abs().max().item())
    engine.abort_request("logits")
    assert seq.is_finished


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_overlapped_steps_match(arch, model_factory, hf_reference):
    """The GPU's overlap (launch step N+1 before reading step N's tokens) exercised on the CPU,
    under preemption and chunked prefill."""
    llm = LLM(model_factory(arch), dtype="float32", kvcache_block_size=16, num_kvcache_blocks=24,
              max_model_len=300, max_num_batched_tokens=64)
    llm.engine.overlap = True
    _check(llm, hf_reference(arch), _prompts(), f"{arch} overlapped")
    assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished()
