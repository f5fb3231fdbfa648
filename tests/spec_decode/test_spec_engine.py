"""Speculative decoding end to end on tiny random models (CPU): the tokens are those of plain
decoding, greedy and seeded, under prefix caching, chunked prefill, preemption, overlapped steps
and grammars, with stops inside accepted runs; the metrics count what was verified."""
import pytest

from helpers import check_block_manager, make_model
from nanovllm import LLM, SamplingParams

KW = dict(dtype="float32", max_model_len=256, kvcache_block_size=16)
# Repeats, so that prompt lookup finds n-grams; and a random one.
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12] * 5, [100, 101, 102] * 8 + [7], list(range(30, 70)), [3, 4] * 10]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Every optional stage of the sampler, seeded: the draws of plain decoding, position by position.
SAMPLED = [SamplingParams(temperature=0.9, seed=1, max_tokens=24, ignore_eos=True, top_k=20, logprobs=2),
           SamplingParams(temperature=0.7, seed=2, max_tokens=20, ignore_eos=True, presence_penalty=0.5,
                          frequency_penalty=0.2, repetition_penalty=1.2),
           SamplingParams(temperature=1.0, seed=3, max_tokens=30, min_tokens=12, top_p=0.9, min_p=0.05,
                          logit_bias={7: 3.0, 100: -2.0}),
           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)]


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory):
    """(target, a different draft of the same vocabulary)."""
    return model_factory("qwen3"), make_model(str(tmp_path_factory.mktemp("draft")), "qwen3", seed=1)


def _run(llm, prompts=PROMPTS, params=GREEDY):
    """(token ids, finish reason, logprobs as (token, logprob) pairs) per prompt."""
    return [(o["token_ids"], o["finish_reason"], _logprob_pairs(o.get("logprobs")))
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _logprob_pairs(logprobs):
    if logprobs is None:
        return None
    return [[(e["token_id"], e["logprob"])] + [(t["token_id"], t["logprob"]) for t in e["top_logprobs"]]
            for e in logprobs]


def _same(got, expected):
    """Tokens and finish reasons exactly; logprobs to float rounding (a several-token forward pass
    sums in another order than a one-token one)."""
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    for g, e in zip(got, expected):
        if e[2] is None:
            assert g[2] is None
            continue
        assert [[t for t, _ in row] for row in g[2]] == [[t for t, _ in row] for row in e[2]]
        assert [v for row in g[2] for _, v in row] == pytest.approx([v for row in e[2] for _, v in row], abs=1e-4)


def _plain(path, prompts=PROMPTS, params=GREEDY, **kw):
    with LLM(path, **{**KW, **kw}) as llm:
        return _run(llm, prompts, params)


def _spec(method, models):
    target, draft = models
    return {"ngram": NGRAM,
            "draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": 3},
            "self": {"method": "draft_model", "model": target, "num_speculative_tokens": 3}}[method]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_tokens_are_plain_decodings(models, method, overlap):
    """Greedy and seeded sampling with every sampler stage: the same tokens (and logprobs) as
    without speculation. overlap: steps launched before the previous one's tokens are read, as
    on a GPU (a verification step then takes the step in flight in first). 'self': the target
    as its own draft, so that every draft is accepted, greedy and sampled at a temperature alone
    (the drafts use the target's noise; the draft does not apply top-k, penalties and the like,
    which only lowers its acceptance)."""
    target, _ = models
    tempered = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    expected = _plain(target) + _plain(target, params=tempered) + _plain(target, params=SAMPLED)
    with LLM(target, speculative_config=_spec(method, models), **KW) as llm:
        llm.engine.overlap = overlap
        got = _run(llm) + _run(llm, params=tempered)
        metrics = llm.get_metrics()
        got += _run(llm, params=SAMPLED)
        bm = llm.engine.block_manager
        check_block_manager(bm, [])
        assert bm.num_free_blocks == bm.num_blocks
    _same(got, expected)
    assert metrics["spec_decode_num_draft_tokens"] > 0
    if method == "self":
        assert metrics["spec_decode_num_accepted_tokens"] == metrics["spec_decode_num_draft_tokens"]
    if method == "ngram":
        assert metrics["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_prefix_caching_chunked_prefill_and_preemption(models, method):
    """A cache too small for the batch (preemptions), a token budget that chunks the prompts and
    cuts drafts, and a second pass whose prompts hit the prefix cache: the tokens of plain decoding,
    and a cache that ends with every block free and a consistent index."""
    target, _ = models
    tight = dict(num_kvcache_blocks=14, max_num_batched_tokens=24, max_model_len=128)
    prompts = PROMPTS + [p[::-1] for p in PROMPTS]
    expected = _plain(target, prompts, **tight)
    with LLM(target, speculative_config=_spec(method, models), **{**KW, **tight}) as llm:
        first, second = _run(llm, prompts), _run(llm, prompts[::-1])  # the newest first: cached
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.block_manager.prefix_hits > 0
        assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
        check_block_manager(engine.block_manager, [])
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    _same(first, expected)
    _same(second, expected[::-1])


def test_stops_inside_an_accepted_run(models):
    """The target as its own draft accepts every draft: a stop token, a stop string, max_tokens
    and max_model_len falling inside a run of accepted tokens end the sequence exactly there."""
    target, _ = models
    prompt = PROMPTS[0]
    free = _plain(target, [prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0][0]
    with LLM(target, **KW) as llm:
        tokenizer = llm.get_tokenizer()
    stop_id = free[9]  # the 10th token: inside the third step's run of four
    stop_text = tokenizer.decode(free[13:15])
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
              SamplingParams(temperature=0, max_tokens=30, stop=[stop_text], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, include_stop_str_in_output=True,
                             stop=[stop_text])]
    prompts = [prompt] * len(params) + [[9, 8] * 30]
    params.append(SamplingParams(temperature=0, max_tokens=500, ignore_eos=True))  # ends at max_model_len=64
    kw = dict(max_model_len=64)
    expected = [(o["token_ids"], o["text"], o["finish_reason"]) for o in LLM(target, **{**KW, **kw}).generate(
        prompts, params, use_tqdm=False)]
    with LLM(target, speculative_config=_spec("self", models), **{**KW, **kw}) as llm:
        got = [(o["token_ids"], o["text"], o["finish_reason"]) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert len(expected[0][0]) <= 10 and expected[0][2] == "stop" and len(expected[2][0]) == 7
    assert len(prompts[-1]) + len(expected[-1][0]) == 64


def test_constrained_requests_beside_speculating_ones(models):
    """A request under a grammar takes no drafts (speculation is off for constrained sequences)
    and keeps its mask in a verification step; the others speculate."""
    from nanovllm.structured_output import StructuredOutputsParams
    target, _ = models
    choice = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(
        choice=["yes please", "no thanks"]))
    params = [GREEDY, choice, GREEDY]
    prompts = PROMPTS[:3]
    expected = _plain(target, prompts, params)
    with LLM(target, speculative_config=NGRAM, **KW) as llm:
        for overlap in (False, True):
            llm.engine.overlap = overlap
            _same(_run(llm, prompts, params), expected)
        assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    with LLM(target, **KW) as llm:
        assert llm.get_tokenizer().decode(expected[1][0], skip_special_tokens=True) in ("yes please", "no thanks")


def test_large_batches_do_not_speculate(models):
    """Above disable_by_batch_size running sequences a step verifies nothing: overlapped plain
    decoding, the same tokens."""
    target, _ = models
    prompts = PROMPTS * 3
    # Eight end early: the last four then speculate.
    params = [GREEDY] * 4 + [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 8
    expected = _plain(target, prompts, params)
    with LLM(target, speculative_config={**NGRAM, "disable_by_batch_size": 4}, **KW) as llm:
        llm.engine.overlap = True
        drafted = []
        schedule = llm.engine.scheduler.schedule

        def recording(drafts=None):
            batch = schedule(drafts)
            if batch is not None and batch.spec is not None:
                drafted.append(len(llm.engine.scheduler.running))
            return batch
        llm.engine.scheduler.schedule = recording
        _same(_run(llm, prompts, params), expected)
    assert drafted and max(drafted) <= 4


def test_metrics_count_drafts_and_acceptances(models):
    target, _ = models
    with LLM(target, speculative_config=_spec("self", models), **KW) as llm:
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] == 0
        llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True), use_tqdm=False)
        m = llm.get_metrics()
    # 9 tokens: the prefill's, then two steps of three drafts and the bonus token.
    assert m["spec_decode_num_drafts"] == 2 and m["spec_decode_num_draft_tokens"] == 6
    assert m["spec_decode_num_accepted_tokens"] == 6 and m["spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 2]
    with LLM(target, **KW) as llm:
        assert "spec_decode_num_draft_tokens" not in llm.get_metrics()


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_tensor_parallel_verification(models, method):
    """TP=2 on the CPU: the verification steps' rows are drawn on rank 0 after both ranks' forward
    passes (a draft model runs whole on rank 0, outside the group); the tokens are those of a
    single-process engine without speculation."""
    target, _ = models
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = _plain(target, params=params)
    with LLM(target, tensor_parallel_size=2, speculative_config=_spec(method, models), **KW) as llm:
        got = _run(llm, params=params)
        assert llm.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    _same(got, expected)
