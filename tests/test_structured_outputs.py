"""Structured outputs, logit_bias and the reasoning gate end to end through `nanovllm.LLM`, on the
tiny random Qwen3 and on the embedded SmolLM2: every constraint kind followed (schemas checked with
jsonschema), mixed batches unchanged by their neighbours' constraints, n > 1, seeds, stop strings,
max_tokens, logprobs, prefix caching, ignore_eos, min_tokens; bad inputs rejected before queueing."""
import json
import math
import re

import jsonschema
import pytest

from helpers import make_reasoning_model, script_model, whitespace_token_ids
from nanovllm import LLM, SamplingParams, StructuredOutputsParams as Constraint

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "member": {"type": "boolean"},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["name", "age", "member", "role", "tags"], "additionalProperties": False}
GRAMMAR = 'root ::= "(" digit digit? digit? ")" | "none"\ndigit ::= [0-9]'


@pytest.fixture(scope="module")
def tiny(model_factory):
    llm = LLM(model_factory("qwen3"), dtype="float32", max_model_len=512, kvcache_block_size=16, max_num_seqs=32)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def no_space(tiny):
    """logit_bias keeping a random model off whitespace-only tokens (see helpers)."""
    return {t: -100.0 for t in whitespace_token_ids(tiny.get_tokenizer())}


def _check(kind: str, text: str):
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "regex":
        assert re.fullmatch(r"[a-z]{2,5}-\d{2}", text), text
    elif kind == "choice":
        assert text in ("red", "green", "blue, or not")
    elif kind == "grammar":
        assert re.fullmatch(r"\(\d{1,3}\)|none", text), text
    else:
        assert text == "tag: x", text


CONSTRAINTS = {
    "json": Constraint(json=PERSON),
    "regex": Constraint(regex=r"[a-z]{2,5}-\d{2}"), "choice": Constraint(choice=["red", "green", "blue, or not"]),
    "grammar": Constraint(grammar=GRAMMAR),
    "structural_tag": Constraint(structural_tag={"type": "structural_tag", "format": {
        "type": "tag", "begin": "tag: ", "content": {"type": "const_string", "value": "x"}, "end": ""}}),
}


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_every_kind_is_followed_greedy_and_sampled(tiny, no_space, kind):
    params = [SamplingParams(temperature=t, seed=s, max_tokens=150, logit_bias=no_space,
                             structured_outputs=CONSTRAINTS[kind]) for t, s in ((0.0, None), (1.0, 1), (1.0, 2))]
    outs = tiny.generate(["Hello, world!", "The quick brown fox", "2 3 5 7"], params, use_tqdm=False)
    for out in outs:
        assert out["finish_reason"] == "stop", out  # the grammar completes: eos is all it allows then
        _check(kind, out["text"])


def test_json_object_allows_any_object_and_only_objects(model_factory):
    """A random model's free JSON never ends: the model is scripted (helpers.script_model)."""
    llm = LLM(model_factory("qwen3"), dtype="float32", max_model_len=256)
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=80, structured_outputs=Constraint(json_object=True))
    script_model(llm.engine, tok.encode('{"k": [1, true, null, {"v": "w"}], "n": -2.5e3}'))
    out = llm.generate(["Hi"], sp, use_tqdm=False)[0]
    assert out["text"] == '{"k": [1, true, null, {"v": "w"}], "n": -2.5e3}' and out["finish_reason"] == "stop"
    script_model(llm.engine, tok.encode("[1, 2]"))
    assert llm.generate(["Hi"], sp, use_tqdm=False)[0]["text"].startswith("{")  # not an array: an object
    llm.shutdown()


def test_the_plain_draw_under_masks(tiny):
    """No logit_bias: the rows take the sampler's default draw (on a GPU the masked CUDA graph)."""
    c = Constraint(json=PERSON, disable_any_whitespace=True)
    outs = tiny.generate(["Hello, world!"] * 3, [SamplingParams(temperature=t, seed=3, max_tokens=150,
                                                                structured_outputs=c) for t in (0.0, 0.7, 1.3)],
                         use_tqdm=False)
    for out in outs:
        assert out["finish_reason"] == "stop"
        jsonschema.validate(json.loads(out["text"]), PERSON)
        assert ", " in out["text"] and "\n" not in out["text"]  # the fixed separators


def test_neighbours_constraints_change_nothing(tiny, no_space):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True, top_k=40)]
    constrained = [SamplingParams(temperature=0.8, seed=4, max_tokens=100, logit_bias=no_space,
                                  structured_outputs=c) for c in (CONSTRAINTS["json"], CONSTRAINTS["choice"])]
    prompts = ["The quick brown fox", "Paris is the capital"]
    alone = [o["token_ids"] for o in tiny.generate(prompts, free, use_tqdm=False)]
    alone_constrained = [o["token_ids"] for o in tiny.generate(prompts, constrained, use_tqdm=False)]
    mixed = tiny.generate([prompts[0], prompts[0], prompts[1], prompts[1]], constrained[:1] + free + constrained[1:],
                          use_tqdm=False)
    assert [mixed[1]["token_ids"], mixed[2]["token_ids"]] == alone
    assert [mixed[0]["token_ids"], mixed[3]["token_ids"]] == alone_constrained


def test_overlapped_steps_draw_the_same_tokens(tiny, no_space):
    """The GPU's loop (overlap: a constrained step's draw is launched at the next step, after its
    scheduling) run on the CPU: every kind, unconstrained neighbours, n > 1, min_tokens, stop strings
    and max_tokens give the tokens of the plain loop, and the constraints hold."""
    kinds = list(CONSTRAINTS)
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=60, logit_bias=no_space,
                             min_tokens=3 if i == 4 else 0, n=2 if i == 1 else 1, stop=["}"] if i == 7 else None,
                             structured_outputs=None if i % 3 == 2 else CONSTRAINTS[kinds[i % len(kinds)]])
              for i in range(10)]
    prompts = [f"Request number {i}:" for i in range(10)]
    runs = {}
    try:
        for overlap in (False, True):
            tiny.engine.overlap = overlap
            runs[overlap] = tiny.generate(prompts, params, use_tqdm=False)
    finally:
        tiny.engine.overlap = False
    assert [o["token_ids"] for o in runs[True]] == [o["token_ids"] for o in runs[False]]
    checked = 0
    for i, out in enumerate(runs[True]):
        if params[i].structured_outputs is not None and params[i].stop is None and out["finish_reason"] == "stop":
            _check(kinds[i % len(kinds)], out["text"])  # the grammar completed (eos is all it then allows)
            checked += 1
    assert checked >= 3


def test_n_completions_each_follow_the_grammar_and_seeds_reproduce(tiny, no_space):
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=150, logit_bias=no_space,
                        structured_outputs=CONSTRAINTS["json"])
    first, again = tiny.generate(["Hello, world!", "Hello, world!"], [sp, sp], use_tqdm=False)
    texts = [o["text"] for o in first["outputs"]]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1  # distinct seeds per completion
    assert [o["text"] for o in again["outputs"]] == texts


def test_stop_strings_and_max_tokens_end_a_constrained_output(tiny):
    regex = Constraint(regex=r"[a-z]{3}-[a-z]{3}-[a-z]{3}")
    out = tiny.generate(["Hello"], SamplingParams(temperature=0, max_tokens=50, stop=["-"],
                                                  structured_outputs=regex), use_tqdm=False)[0]
    assert out["finish_reason"] == "stop" and re.fullmatch(r"[a-z]{3}", out["text"]), out
    out = tiny.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2, structured_outputs=regex),
                        use_tqdm=False)[0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 2
    assert re.fullmatch(r"[a-z-]+", out["text"]) and "[a-z]{3}-[a-z]{3}-[a-z]{3}"  # a valid prefix


def test_logprobs_are_those_of_the_constrained_distribution(tiny):
    choices = ["red", "green", "blue, or not"]
    out = tiny.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20, logprobs=5,
                                                  structured_outputs=Constraint(choice=choices)), use_tqdm=False)[0]
    assert out["text"] in choices and len(out["logprobs"]) == len(out["token_ids"])
    tok = tiny.get_tokenizer()
    first = out["logprobs"][0]
    finite = [e for e in first["top_logprobs"] if e["logprob"] > -math.inf]
    assert all(any(c.startswith(tok.decode([e["token_id"]])) for c in choices) for e in finite)
    assert abs(sum(math.exp(e["logprob"]) for e in finite) - 1) < 1e-4 or len(finite) == 5
    assert out["logprobs"][-1]["token_id"] == tiny.config.eos and out["logprobs"][-1]["logprob"] > -1e-3


def test_prefix_caching_with_constraints(tiny, no_space):
    prompt = list(range(40, 120))  # 80 tokens: 5 full blocks of 16
    sp = SamplingParams(temperature=0, max_tokens=150, logit_bias=no_space, structured_outputs=CONSTRAINTS["json"])
    first = tiny.generate([prompt], sp, use_tqdm=False)[0]
    second = tiny.generate([prompt], sp, use_tqdm=False)[0]
    assert second["num_cached_tokens"] >= 64 and second["token_ids"] == first["token_ids"]
    jsonschema.validate(json.loads(second["text"]), PERSON)


def test_ignore_eos_and_min_tokens_meet_a_finished_grammar(tiny):
    eos = tiny.config.eos
    out = tiny.generate(["Hi"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                               structured_outputs=Constraint(choice=["red"])), use_tqdm=False)[0]
    n = len(tiny.get_tokenizer().encode("red"))
    assert out["finish_reason"] == "length" and out["text"] == "red"
    assert out["token_ids"][n:] == [eos] * (8 - n)  # after the grammar: only eos
    out = tiny.generate(["Hi"], SamplingParams(temperature=0, max_tokens=30, min_tokens=6,
                                               structured_outputs=Constraint(regex="[a-z]+")), use_tqdm=False)[0]
    assert len(out["token_ids"]) > 6 and re.fullmatch("[a-z]+", out["text"])  # eos kept out for 6 tokens


def test_logit_bias(tiny):
    prompt = ["The quick brown fox"]
    greedy = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    first = greedy["token_ids"][0]
    banned = tiny.generate(prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                  logit_bias={first: -100}), use_tqdm=False)[0]
    assert banned["token_ids"][0] != first
    forced = tiny.generate(prompt * 2, [SamplingParams(temperature=t, seed=1, max_tokens=4, ignore_eos=True,
                                                       logit_bias={77: 100}) for t in (0.0, 1.0)], use_tqdm=False)
    assert all(o["token_ids"] == [77] * 4 for o in forced)


def test_bad_requests_are_rejected_before_anything_is_queued(tiny):
    ok = SamplingParams(max_tokens=4)
    for bad, words in ((SamplingParams(logit_bias={10**6: 1.0}), "logit_bias token ids"),
                       (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids")):
        with pytest.raises(ValueError, match=words):
            tiny.generate(["a", "b"], [ok, bad], use_tqdm=False)
        assert not tiny.engine.has_unfinished() and tiny.engine.structured.num_live == 0
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        SamplingParams(structured_outputs=Constraint(grammar="root ::= x"))
    assert tiny.generate(["a"], ok, use_tqdm=False)[0]["finish_reason"] in ("stop", "length")


def test_aborted_and_finished_requests_release_their_grammars(tiny):
    engine = tiny.engine
    engine.add_request("x", [1, 2, 3], SamplingParams(n=2, max_tokens=50, structured_outputs=CONSTRAINTS["json"]))
    assert engine.structured.num_live == 2
    engine.step()
    engine.abort_request("x")
    engine.drain()
    assert engine.structured.num_live == 0


def test_constraint_applies_after_the_reasoning(tmp_path):
    path = make_reasoning_model(str(tmp_path / "reasoning"))
    llm = LLM(path, dtype="float32", max_model_len=256, reasoning_parser="qwen3")
    tok = llm.get_tokenizer()
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"]}
    # The script breaks the schema both in the reasoning and in the answer: only the answer is held to it.
    script_model(llm.engine, tok.encode('<think>{"a": "x"}</think>{"a": "x"}'))
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=Constraint(json=schema, disable_any_whitespace=True))
    thinking, direct = llm.generate(["<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"],
                                    sp, use_tqdm=False)
    reasoning, _, answer = thinking["text"].partition("</think>")
    assert reasoning == '<think>{"a": "x"}' and thinking["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer), schema)
    jsonschema.validate(json.loads(direct["text"]), schema)  # the prompt closed the block: constrained at once
    llm.shutdown()


def test_the_embedded_model_follows_constraints(smollm_dir):
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
    tok = llm.get_tokenizer()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"]}
    chat = lambda q: tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,  # noqa: E731
                                             add_generation_prompt=True)
    outs = llm.generate([chat("Describe Paris as JSON with keys city and country."), chat("Capital of France?")],
                        [SamplingParams(temperature=0, max_tokens=60, structured_outputs=Constraint(json=schema)),
                         SamplingParams(temperature=0, max_tokens=10, structured_outputs=Constraint(choice=["Paris", "Rome"]))],
                        use_tqdm=False)
    jsonschema.validate(json.loads(outs[0]["text"]), schema)
    assert outs[1]["text"] == "Paris" and outs[1]["finish_reason"] == "stop"
    llm.shutdown()
