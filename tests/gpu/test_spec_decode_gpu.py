"""Speculative decoding on a CUDA GPU: the Triton backend's verification steps, CUDA graphs (the
verification steps replay worker/verify_graph.py's, the draft model's one-token steps the decode
graphs) and overlapped steps give the tokens of plain decoding,
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
        assert llm.engine.model_runner.verify_graphs is None  # no speculation: nothing more captured
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
        verify_graphs = llm.engine.model_runner.verify_graphs
        assert (verify_graphs is None) == enforce_eager
        if verify_graphs is not None:  # the verification steps (all pure here) replayed a captured graph
            assert verify_graphs.replays > 0
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert got == plain
    assert metrics["spec_decode_num_draft_tokens"] > 0
    if method != "draft":
        assert metrics["spec_decode_num_accepted_tokens"] > 0


def test_verification_graph_gives_the_general_paths_logits_fp32(model_factory):
    """One verification step replayed from the captured graph (windows of k + 1 rows, the
    multi-query decode kernel) against the same step on the general path (piecewise graphs, the
    decode and prefill kernels): a block boundary inside a window, a plain decode row, a context
    shorter than the window, and a padding sequence (3 sequences in the 4-sequence graph)."""
    import torch

    from helpers import prefilled_sequences
    from nanovllm.engine.scheduler import ScheduledBatch
    k = 3
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
            "disable_by_batch_size": 6}
    with LLM(model_factory("qwen3"), kvcache_block_size=16, speculative_config=spec, **KW) as llm:
        runner = llm.engine.model_runner
        graphs = runner.verify_graphs
        assert graphs.batch_sizes == [1, 2, 4, 6] and graphs.query_len == k + 1
        seqs = prefilled_sequences(runner, [list(range(40, 71)), list(range(5, 25)), [7, 8]], k)
        drafts = [[1, 2, 3], [], [9, 10, 11]]
        order = [1, 0, 2]  # decodes first, as the scheduler orders a batch
        batch = ScheduledBatch([seqs[i] for i in order], [len(drafts[i]) + 1 for i in order], num_decodes=1,
                               spec=[drafts[i] for i in order])
        assert graphs.fits(batch)
        expect = runner.forward(runner.host_inputs(batch)).float()
        before = graphs.replays
        got = graphs.run(batch, runner.block_size).float()
        torch.cuda.synchronize()
        assert graphs.replays == before + 1
    assert got.shape == expect.shape == (9, expect.shape[1])
    torch.testing.assert_close(got, expect, rtol=2e-3, atol=2e-3)
    assert torch.equal(got.argmax(-1), expect.argmax(-1))
