"""Speculative decoding on a CUDA GPU: the Triton backend's verification steps, CUDA graphs (the
draft model's one-token steps replay them) and overlapped steps give the tokens of plain decoding,
greedy and seeded, n-gram and draft model, with the speculation switch flipping per step."""
import pytest

from nanovllm import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 5, [100, 101, 102] * 8 + [7], list(range(30, 70)), [3, 4] * 10] * 3
# The first request runs 48 tokens past the others: a long tail below disable_by_batch_size, where the
# overlapped engine proposes (a short tail, a few tokens, can pass without a draft).
PARAMS = ([SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)]
          + [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)] * 5
          + [SamplingParams(temperature=0.8, seed=i, max_tokens=32 + 4 * i, ignore_eos=True, top_k=50)
             for i in range(6)])
KW = dict(dtype="float32", max_model_len=512, max_num_seqs=32, gpu_memory_utilization=0.2)


def _tokens(llm):
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("enforce_eager", [False, True])
@pytest.mark.parametrize("method", ["ngram", "self_draft", "draft"])
def test_speculation_gives_plain_decodings_tokens_fp32(model_factory, tmp_path, method, enforce_eager):
    from helpers import make_model
    target = model_factory("qwen3")
    with LLM(target, **KW) as llm:
        plain = _tokens(llm)
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
            "self_draft": {"method": "draft_model", "model": target, "num_speculative_tokens": 3},
            "draft": {"method": "draft_model", "model": make_model(str(tmp_path / "d"), "qwen3", seed=1),
                      "num_speculative_tokens": 3}}[method]
    # The cutoff below the batch: the first steps decode plainly (overlapped), the last ones verify.
    spec["disable_by_batch_size"] = 6
    with LLM(target, enforce_eager=enforce_eager, speculative_config=spec, **KW) as llm:
        assert llm.engine.overlap
        got = _tokens(llm)
        metrics = llm.get_metrics()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert got == plain
    assert metrics["spec_decode_num_draft_tokens"] > 0
    if method != "draft":
        assert metrics["spec_decode_num_accepted_tokens"] > 0
