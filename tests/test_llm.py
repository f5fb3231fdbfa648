"""The seed's user-facing contract and the validation at the edge."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

from nanovllm import LLM, SamplingParams
from nanovllm.config import Config, physical_cpu_cores


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("qwen3"), dtype="float32", max_model_len=256)


def test_config_fields_and_defaults_follow_the_seed():
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    assert defaults["max_num_batched_tokens"] == 16384 and defaults["max_num_seqs"] == 512
    assert defaults["max_model_len"] == 4096 and defaults["gpu_memory_utilization"] == 0.9
    assert defaults["tensor_parallel_size"] == 1 and defaults["enforce_eager"] is False
    assert defaults["hf_config"] is None and defaults["eos"] == -1
    assert defaults["kvcache_block_size"] == 256 and defaults["num_kvcache_blocks"] == -1
    assert list(defaults)[:12] == ["model", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                                   "gpu_memory_utilization", "tensor_parallel_size", "enforce_eager",
                                   "hf_config", "eos", "kvcache_block_size", "num_kvcache_blocks", "device"]
    assert defaults["device"] == "auto" and defaults["dtype"] == "auto" and defaults["enable_prefix_caching"] is True
    assert defaults["load_format"] == "auto" and defaults["seed"] == 0


def test_config_fills_from_model(llm):
    cfg = llm.config
    assert cfg.max_model_len == 256 and cfg.num_kvcache_blocks > 0 and cfg.eos == llm.get_tokenizer().eos_token_id
    assert cfg.hf_config.architectures == ["Qwen3ForCausalLM"]


def test_max_model_len_capped_by_model(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32")
    assert llm.config.max_model_len == 1024  # max_position_embeddings of the tiny model


def test_unknown_keyword_is_a_type_error(model_factory):
    with pytest.raises(TypeError, match="max_num_seq\\b"):
        LLM(model_factory("qwen3"), max_num_seq=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(kvcache_block_size=24), "kvcache_block_size must be a positive multiple of 16"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(dtype="int8"), "dtype must be"),
    (dict(load_format="pickle"), "load_format"),
    (dict(device="tpu"), "device"),
    (dict(cpu_threads=0), "cpu_threads must be an integer >= 1"),
])
def test_bad_config_values(model_factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_factory("qwen3"), **kwargs)


def test_bad_model_paths(tmp_path, model_factory):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path))
    odd = tmp_path / "odd"
    shutil.copytree(model_factory("qwen3"), odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (odd / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM, MixtralForCausalLM, Qwen2ForCausalLM, "
                       "Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        LLM(str(odd))


@pytest.mark.parametrize("make_params, match", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
    (lambda: SamplingParams(temperature=-0.5), r"temperature must be a number in \[0, 100\]"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(n=0), "n must be"),
    # Seeds are signed 64-bit, as vLLM's; nothing is folded into that range silently.
    (lambda: SamplingParams(seed=2**63), r"seed must be an integer in \[-2\*\*63, 2\*\*63-1\]"),
    (lambda: SamplingParams(seed=2**80), "seed must be"),
    (lambda: SamplingParams(seed=-2**63 - 1), "seed must be"),
    # Every float is finite and within a sane range.
    *[(lambda name=name, v=v: SamplingParams(**{name: v}), f"{name} must be")
      for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
      for v in (float("inf"), float("-inf"), float("nan"), 1e308)],
    (lambda: SamplingParams(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
])
def test_bad_sampling_params(make_params, match):
    with pytest.raises(ValueError, match=match):
        make_params()


def test_sampling_params_range_edges_are_accepted():
    for seed in (-2**63, 2**63 - 1, 0):
        assert SamplingParams(seed=seed).seed == seed
    assert SamplingParams(temperature=100.0).temperature == 100.0
    assert SamplingParams(repetition_penalty=0.01).repetition_penalty == 0.01


@pytest.mark.parametrize("prompts, params, exc, match", [
    (["ok", ""], None, ValueError, "prompt must not be empty"),
    ([[1, 2], []], None, ValueError, "prompt must not be empty"),
    ([[1, 2], list(range(3, 259))], None, ValueError, "256 tokens but max_model_len is 256"),
    ([[1, 2], [3, 512]], None, ValueError, r"token id 512 is outside the vocabulary \[0, 512\)"),
    ([[1, 2], [3, -1]], None, ValueError, "token id -1"),
    ([[1, 2], [3, 600, -1]], None, ValueError, "token id 600 "),  # the first offender is named
    ([[1, 2], [3, True]], None, ValueError, "token id True"),  # not a plain int: the slow check names it
    ([[1, 2], [3, 4.0]], None, ValueError, r"token id 4\.0"),
    ([[1, 2], [3, 4]], [SamplingParams()], ValueError, "got 1 sampling_params for 2 prompts"),
    ([[1, 2], 7], None, TypeError, "a prompt must be a string or a list of token ids"),
])
def test_bad_requests_fail_before_any_work(llm, prompts, params, exc, match):
    with pytest.raises(exc, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    # The engine is untouched: the next request runs normally.
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 3


def test_generate_output_shape_and_order(llm):
    prompts = ["Hello, world!", [10, 11, 12], "What is the capital of France?"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 7, 5)]
    outs = llm.generate(prompts, params)  # with the tqdm bar
    assert [len(o["token_ids"]) for o in outs] == [3, 7, 5]
    for o in outs:
        assert set(o) >= {"text", "token_ids", "finish_reason", "prompt_token_ids", "outputs"}
        assert o["finish_reason"] == "length" and isinstance(o["text"], str)
    assert outs[1]["prompt_token_ids"] == [10, 11, 12]


def test_single_prompt_and_default_params(llm):
    out = llm.generate("Hello", use_tqdm=False)
    assert len(out) == 1 and 1 <= len(out[0]["token_ids"]) <= 64


def test_eos_stops_with_reason_stop(model_factory):
    path = model_factory("qwen3")
    probe = LLM(path, dtype="float32")
    greedy = probe.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]["token_ids"]
    llm = LLM(path, dtype="float32", eos=greedy[3])
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    first = greedy.index(greedy[3])
    assert out["token_ids"] == greedy[:first + 1] and out["finish_reason"] == "stop"
    ignored = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)[0]
    assert ignored["token_ids"] == greedy and ignored["finish_reason"] == "length"


def test_random_sampling_is_reproducible_with_seed(llm):
    p = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=123)
    a = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0]["token_ids"]
    b = llm.generate([[1, 2, 3], [4, 5]], p, use_tqdm=False)[0]["token_ids"]
    assert a == b
    c = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=124),
                     use_tqdm=False)[0]["token_ids"]
    assert c != a


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "introduce yourself"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.chat(conv, params, use_tqdm=False)
    ids = tok.encode(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    assert out[0]["prompt_token_ids"] == ids
    assert ids[-3:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    assert out[0]["token_ids"] == llm.generate([ids], params, use_tqdm=False)[0]["token_ids"]
    two = llm.chat([conv, [{"role": "user", "content": "list all prime numbers within 100"}]], params,
                   use_tqdm=False)
    assert len(two) == 2 and two[0]["token_ids"] == out[0]["token_ids"]


def test_model_without_tokenizer(model_factory):
    path = model_factory("llama", with_tokenizer=False)
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))
    llm = LLM(path, dtype="float32")
    assert llm.get_tokenizer() is None
    assert llm.config.eos == json.load(open(os.path.join(path, "config.json")))["eos_token_id"]
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 4 and out[0]["text"] == ""
    with pytest.raises(ValueError, match="no tokenizer files: pass prompts as token-id lists"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids \[600\] are outside the vocabulary"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[600]), use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_bf16_runs_on_cpu(model_factory):
    llm = LLM(model_factory("qwen2"), dtype="bfloat16")
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 5


def test_cpu_threads_sets_torch_threads(model_factory):
    before = torch.get_num_threads()
    try:
        LLM(model_factory("qwen3"), dtype="float32", max_model_len=256, cpu_threads=1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        LLM(model_factory("qwen3"), dtype="float32", max_model_len=256)  # default: the physical cores, at most
        assert torch.get_num_threads() == min(physical_cpu_cores(), before)
        assert 1 <= physical_cpu_cores() <= len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
