"""Sampling features end to end through `nanovllm.LLM`: seeds, n, logprobs, penalties, min_tokens,
stop token ids, and stop strings and streaming on the real SmolLM2 model."""
import pytest
import torch

from helpers import assert_greedy_match
from nanovllm import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def tiny(model_factory):
    path = model_factory("qwen3")
    llm = LLM(path, dtype="float32", max_model_len=256, kvcache_block_size=BLOCK, max_num_seqs=32)
    yield path, llm
    llm.shutdown()


def _ids(out):
    return [o["token_ids"] for o in out["outputs"]]


def test_seeded_requests_reproduce_across_batches_and_orders(tiny):
    _, llm = tiny
    a, b, c = [7, 8, 9, 10, 11], list(range(20, 60)), [300, 301, 302]
    sp_a = SamplingParams(seed=42, temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, presence_penalty=0.5,
                          frequency_penalty=0.3, repetition_penalty=1.1, max_tokens=12, ignore_eos=True, n=2)
    sp_b = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    sp_c = SamplingParams(temperature=1.2, top_p=0.5, max_tokens=20, ignore_eos=True, n=3)
    alone = _ids(llm.generate([a], sp_a, use_tqdm=False)[0])
    assert alone[0] != alone[1]  # the n completions get distinct seeds
    mixed = llm.generate([b, a, c, a], [sp_b, sp_a, sp_c, sp_a], use_tqdm=False)
    reordered = llm.generate([c, a], [sp_c, sp_a], use_tqdm=False)
    assert _ids(mixed[1]) == _ids(mixed[3]) == _ids(reordered[1]) == alone


def test_n_completions_share_the_prompt_blocks(tiny):
    _, llm = tiny
    engine = llm.engine
    prompt = list(range(100, 170))  # 70 tokens: 4 full blocks, then 6 tokens
    seqs = engine.add_request("n4", prompt, SamplingParams(n=4, seed=5, max_tokens=6, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
        if all(s.num_computed_tokens >= len(prompt) for s in seqs):
            tables = [s.block_table[:4] for s in seqs]
    assert tables[1:] == tables[:1] * 3
    assert [s.num_cached_tokens for s in seqs[1:]] == [69] * 3  # all but the last prompt token
    # 76 tokens need 5 blocks each: the 4 shared prompt blocks, plus one of its own per completion.
    assert peak == 4 + 4
    out = llm.generate([prompt], SamplingParams(n=4, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert [o["index"] for o in out["outputs"]] == [0, 1, 2, 3]
    assert _ids(out) == [s.completion_token_ids for s in seqs] and len({tuple(t) for t in _ids(out)}) == 4


def test_logprobs_are_those_of_the_raw_model(tiny, hf_reference):
    path, llm = tiny
    prompt = [5, 17, 33, 80, 120, 7]
    params = [SamplingParams(logprobs=5, temperature=0.8, seed=3, top_k=30, repetition_penalty=1.3, max_tokens=8,
                             ignore_eos=True),
              SamplingParams(logprobs=2, temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True)]
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert "logprobs" not in outs[2]
    for out, sp in zip(outs[:2], params):
        tokens, entries = out["token_ids"], out["logprobs"]
        assert len(entries) == len(tokens) == 8
        ref = torch.log_softmax(hf_reference("qwen3").logits(prompt + tokens)[len(prompt) - 1:-1].double(), -1)
        for t, (token, entry, row) in enumerate(zip(tokens, entries, ref)):
            assert entry["token_id"] == token
            assert entry["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert entry["rank"] == int((row > row[token] + 1e-6).sum()) + 1
            top = row.topk(sp.logprobs)
            assert [e["token_id"] for e in entry["top_logprobs"]] == top.indices.tolist()
            assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_repetition_penalty_matches_hf_greedy(tiny, hf_reference):
    _, llm = tiny
    prompt = [11, 12, 13, 11, 12, 13, 11]
    out = llm.generate([prompt], SamplingParams(temperature=0, repetition_penalty=1.8, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    hf = hf_reference("qwen3").model.generate(
        torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.8, eos_token_id=None,
        pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    assert_greedy_match(out["token_ids"], hf.sequences[0, len(prompt):].tolist(), [s[0] for s in hf.scores],
                        "repetition_penalty=1.8")


def test_min_tokens_and_stop_token_ids(tiny):
    _, llm = tiny
    prompt = [40, 41, 42, 43]
    greedy = dict(temperature=0, max_tokens=10, ignore_eos=True)
    base = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]["token_ids"]
    stop_at = base.index(base[3])
    first_banned = SamplingParams(**greedy, stop_token_ids=[base[0]], min_tokens=4)
    outs = llm.generate([prompt] * 2, [SamplingParams(**greedy, stop_token_ids=[base[3]]), first_banned],
                        use_tqdm=False)
    assert outs[0]["token_ids"] == base[:stop_at + 1]
    assert outs[0]["finish_reason"] == "stop"
    tokens = outs[1]["token_ids"]
    assert base[0] not in tokens[:4] and tokens[0] != base[0]
    if outs[1]["finish_reason"] == "stop":
        assert len(tokens) > 4 and tokens[-1] == base[0] and base[0] not in tokens[:-1]


# ---- the real SmolLM2 model: stop strings, eos under min_tokens, streaming ---------------------------
@pytest.fixture(scope="module")
def smol():
    from nanovllm.models.default_model import default_model_path
    from nanovllm.models.gguf_convert import convert_gguf
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(convert_gguf(path), dtype="float32", max_model_len=256, kvcache_block_size=BLOCK, max_num_seqs=8)
    yield llm
    llm.shutdown()


def _stream(llm, prompts, params) -> list[dict]:
    """Run requests through the engine as a streaming server would: take text deltas after each step."""
    engine, proc = llm.engine, llm.engine.output_processor
    seqs = []
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        for seq in engine.add_request(f"stream-{i}", prompt, sp):
            proc.watch(seq)
            seqs.append(seq)
    shown = [""] * len(seqs)
    while engine.has_unfinished():
        engine.step()
        for i, seq in enumerate(seqs):
            shown[i] += proc.take_delta(seq)
            assert proc.text(seq).startswith(shown[i])  # never shows text it takes back
    return [dict(text=proc.text(s), shown=shown[i], token_ids=s.completion_token_ids, finish_reason=s.finish_reason,
                 stop_reason=s.stop_reason) for i, s in enumerate(seqs)]


def test_stop_strings_and_min_tokens_on_smollm2(smol):
    tok = smol.get_tokenizer()

    def chat(text):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
        return tok.encode(prompt, add_special_tokens=False)

    france, japanese = chat("What is the capital of France?"), chat("Translate 'good morning' into Japanese.")
    greedy = dict(temperature=0, max_tokens=16)
    base_fr, base_ja = smol.generate([france, japanese], SamplingParams(**greedy), use_tqdm=False)
    eos = tok.eos_token_id
    assert base_fr["finish_reason"] == "stop" and base_fr["token_ids"][-1] == eos
    text_fr = base_fr["text"]
    # A stop string across the boundary between the second and third tokens of the answer.
    cut = len(tok.decode(base_fr["token_ids"][:2]))
    stop = text_fr[cut - 2:cut + 3]
    assert len(stop) == 5 and text_fr.find(stop) == cut - 2
    # A multi-byte character of the Japanese answer (each is several byte tokens in this vocabulary).
    ja = base_ja["text"]
    char = next(c for c in ja[1:] if ord(c) > 0x2000 and c != "\ufffd")
    assert len(char.encode()) > 1
    stop_id = base_fr["token_ids"][3]
    n_fr = len(base_fr["token_ids"])
    cases = [
        (france, SamplingParams(**greedy, stop=["zzz", stop])),
        (france, SamplingParams(**greedy, stop=stop, include_stop_str_in_output=True)),
        (japanese, SamplingParams(**greedy, stop=char)),
        (france, SamplingParams(temperature=0, min_tokens=n_fr + 2, max_tokens=n_fr + 4)),
        (france, SamplingParams(**greedy, stop_token_ids=[stop_id])),
        (japanese, SamplingParams(**greedy)),
    ]
    res = _stream(smol, [p for p, _ in cases], [sp for _, sp in cases])
    for r in res:
        assert r["shown"] == r["text"]
    assert (res[0]["text"], res[0]["finish_reason"], res[0]["stop_reason"]) == (text_fr[:cut - 2], "stop", stop)
    assert (res[1]["text"], res[1]["stop_reason"]) == (text_fr[:cut + 3], stop)
    assert (res[2]["text"], res[2]["stop_reason"]) == (ja[:ja.index(char)], char)
    long = res[3]["token_ids"]
    assert len(long) >= n_fr + 2 and eos not in long[:n_fr + 2] and long[:n_fr - 1] == base_fr["token_ids"][:-1]
    at = base_fr["token_ids"].index(stop_id)
    assert res[4]["token_ids"] == base_fr["token_ids"][:at + 1] and res[4]["stop_reason"] == stop_id
    assert res[4]["text"] == tok.decode(base_fr["token_ids"][:at])
    assert res[5]["text"] == ja and res[5]["token_ids"] == base_ja["token_ids"]
