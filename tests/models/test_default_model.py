"""The embedded default model (SmolLM2-135M-Instruct from its GGUF) through our engine."""
import time

import pytest

from helpers import HFReference, assert_greedy_match
from nanovllm import LLM, SamplingParams
from nanovllm.models import gguf_convert

SEED_PROMPTS = ["introduce yourself", "list all prime numbers within 100"]


@pytest.fixture(scope="module")
def llm(smollm_dir):
    return LLM(dtype="float32")  # no model: the embedded default


def test_default_is_the_converted_gguf(llm, smollm_dir):
    assert llm.config.model == smollm_dir
    assert llm.config.hf_config.architectures == ["LlamaForCausalLM"]
    assert llm.get_tokenizer().decode([llm.config.eos]) == "<|im_end|>"


def test_seed_prompts_match_hf_greedy(llm, smollm_dir):
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in SEED_PROMPTS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    ref = HFReference(smollm_dir)
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        assert out["prompt_token_ids"] == ids
        assert_greedy_match(out["token_ids"], *ref.greedy(ids, 32), prompt)


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out["text"], out["text"]
    assert out["finish_reason"] in ("stop", "length")


def test_second_start_reuses_the_cache(smollm_dir, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached conversion should have been reused")
    monkeypatch.setattr(gguf_convert, "_write_model_dir", no_conversion)
    start = time.perf_counter()
    llm = LLM(dtype="float32", max_model_len=256)
    assert llm.config.model == smollm_dir
    assert time.perf_counter() - start < 30  # model load only (seconds), no conversion


def test_truncated_gguf_is_a_clear_error(tmp_path, monkeypatch):
    from nanovllm.models.default_model import default_model_path
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(open(default_model_path(), "rb").read(1 << 20))
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOVLLM_CACHE_DIR", str(cache))
    with pytest.raises(ValueError, match="not a valid GGUF file"):
        LLM(str(bad))
    assert not cache.exists() or not any(cache.iterdir())
