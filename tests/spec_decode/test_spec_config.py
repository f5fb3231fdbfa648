"""speculative_config: vLLM's names, and every bad value refused before anything loads, naming the field."""
import json

import pytest
from transformers import Qwen3Config

from helpers import make_model
from nanovllm import LLM
from nanovllm.config import Config
from nanovllm.spec_decode.config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig


def _config(model, spec) -> Config:
    return Config(model, dtype="float32", max_model_len=256, speculative_config=spec)


def test_valid_configs_parse_with_vllm_defaults(model_factory):
    target = model_factory("qwen3")
    ngram = _config(target, {"method": "ngram", "num_speculative_tokens": 4}).speculative_config
    assert isinstance(ngram, SpeculativeConfig)
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert ngram.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    as_json = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                          "disable_by_batch_size": 8})
    parsed = _config(target, as_json).speculative_config  # the server's --speculative-config
    assert (parsed.num_speculative_tokens, parsed.prompt_lookup_min, parsed.prompt_lookup_max) == (2, 3, 3)
    assert parsed.disable_by_batch_size == 8
    draft = _config(target, {"model": target, "num_speculative_tokens": 3}).speculative_config
    assert draft.method == "draft_model" and draft.model == target


@pytest.mark.parametrize("spec, field", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "speculative_config.disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "speculative_config.model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown field"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such/model"}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "{target}", "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_max"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "{target}", "draft_tensor_parallel_size": 2},
     "speculative_config.draft_tensor_parallel_size"),
    ("{not json", "speculative_config must be a JSON object"),
    ([1, 2], "speculative_config must be a dict"),
])
def test_bad_configs_name_the_field(model_factory, spec, field):
    target = model_factory("qwen3")
    if isinstance(spec, dict) and spec.get("model") == "{target}":
        spec = {**spec, "model": target}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        LLM(target, dtype="float32", speculative_config=spec)


def test_a_draft_with_another_vocabulary_is_refused(model_factory, tmp_path):
    target = model_factory("qwen3")
    other = tmp_path / "other"
    Qwen3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, architectures=["Qwen3ForCausalLM"]).save_pretrained(other)
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary has 256 tokens"):
        _config(target, {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})


def test_a_draft_with_another_tokenizer_is_refused(model_factory, tmp_path):
    target = model_factory("qwen3")
    draft = make_model(str(tmp_path / "draft"), "qwen3", seed=1)
    from tokenizers import Tokenizer
    tok_path = tmp_path / "draft" / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: the same size, another vocabulary
    tok_path.write_text(json.dumps(tok))
    Tokenizer.from_file(str(tok_path))  # still a valid tokenizer
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's tokenizer differs"):
        _config(target, {"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
