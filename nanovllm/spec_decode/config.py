"""`speculative_config`: vLLM's names and meanings, checked before anything loads.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}

Optional for both: `disable_by_batch_size` (speculate only in steps that run at most this many
sequences: above it a verification step costs more than the tokens it saves; the default is
DEFAULT_DISABLE_BY_BATCH_SIZE) and `draft_tensor_parallel_size` (1: the draft model runs on the
first device whatever the target's tensor parallelism).
"""
import json
import os
from dataclasses import dataclass, field, fields

MAX_SPECULATIVE_TOKENS = 16
# Above this many running sequences a step does not speculate. A verification step of B x (k + 1)
# tokens moves the weights once like a decode step, but as B grows decoding stops being bound by
# the weights' bandwidth and the rejected drafts' compute and KV reads cost more than the accepted
# tokens save. Measured on the H200 (`python -m benchmarks.speculative ngram --batch-sizes
# 1,8,16,32,64`, the embedded GGUF copying its prompt, k=4): 1.63x at 1, 1.57x at 16, 0.97x at 32.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
METHODS = ("ngram", "draft_model")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_tensor_parallel_size: int = 1
    # Derived for the draft model: its transformers config.
    draft_hf_config: object = field(default=None, repr=False, compare=False)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "draft_hf_config"]


def _name(key: str) -> str:
    return f"speculative_config.{key}"


def _int(key: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{_name(key)} must be {allowed}, got {value!r}")
    return value


def parse_speculative_config(value, target_path: str, hf_config, max_model_len: int) -> SpeculativeConfig | None:
    """A validated SpeculativeConfig from a dict (or a JSON object as a string, or one already
    built), or None. target_path, hf_config, max_model_len: the target model's. Raises ValueError
    naming the field."""
    if value is None:
        return None
    if isinstance(value, SpeculativeConfig):
        value = {name: getattr(value, name) for name in SpeculativeConfig.field_names()}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative_config must be a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a dict (or None), got {type(value).__name__}")
    unknown = sorted(set(value) - set(SpeculativeConfig.field_names()))
    if unknown:
        raise ValueError(f"speculative_config has unknown field(s) {unknown}; "
                         f"allowed: {SpeculativeConfig.field_names()}")
    method = value.get("method")
    if method is None and value.get("model") is not None:
        method = "draft_model"  # as vLLM: a draft model given alone names its method
    if method not in METHODS:
        raise ValueError(f"{_name('method')} must be one of {list(METHODS)}, got {method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError(f"{_name('num_speculative_tokens')} is required (an integer in [1, {MAX_SPECULATIVE_TOKENS}])")
    k = _int("num_speculative_tokens", value["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
    disable = _int("disable_by_batch_size", value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE), 1)
    draft_tp = value.get("draft_tensor_parallel_size", 1)
    if draft_tp != 1:
        raise ValueError(f"{_name('draft_tensor_parallel_size')} must be 1 (the draft model runs on one device), "
                         f"got {draft_tp!r}")
    config = SpeculativeConfig(method, k, disable_by_batch_size=disable)
    if method == "ngram":
        if value.get("model") is not None:
            raise ValueError(f"{_name('model')} is for method 'draft_model'; method 'ngram' takes none")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        lo = _int("prompt_lookup_min", hi if lo is None else lo, 1)
        hi = _int("prompt_lookup_max", lo if hi is None else hi, 1)
        if lo > hi:
            raise ValueError(f"{_name('prompt_lookup_min')}={lo} must be <= {_name('prompt_lookup_max')}={hi}")
        config.prompt_lookup_min, config.prompt_lookup_max = lo, hi
        return config
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if value.get(key) is not None:
            raise ValueError(f"{_name(key)} is for method 'ngram'")
    config.model, config.draft_hf_config = _check_draft(value.get("model"), hf_config, max_model_len)
    check_same_tokenizer(config.model, target_path)
    return config


def _check_draft(path, hf_config, max_model_len: int):
    """The draft model's directory and transformers config, checked against the target's."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"{_name('model')} must be the path of the draft model's directory (method 'draft_model')")
    if not os.path.exists(path):
        raise ValueError(f"{_name('model')}: the draft model path {path!r} does not exist")
    if path.lower().endswith(".gguf") or not os.path.isfile(os.path.join(path, "config.json")):
        from nanovllm.models.model_path import resolve_model_path  # a GGUF: its converted directory
        path = resolve_model_path(path)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"{_name('model')}: {path!r} has no config.json (a Hugging Face model directory "
                             "or a .gguf file is expected)")
    from transformers import AutoConfig
    draft = AutoConfig.from_pretrained(path)
    from nanovllm.models.registry import get_model_class
    try:
        get_model_class(draft)
    except ValueError as e:
        raise ValueError(f"{_name('model')}: {e}") from None
    if draft.vocab_size != hf_config.vocab_size:
        raise ValueError(f"{_name('model')}: the draft's vocabulary has {draft.vocab_size} tokens and the target's "
                         f"{hf_config.vocab_size}: speculative decoding needs the same tokenizer and vocabulary")
    draft_len = getattr(draft, "max_position_embeddings", None)
    if draft_len is not None and draft_len < max_model_len:
        raise ValueError(f"{_name('model')}: the draft model's max_position_embeddings ({draft_len}) is below "
                         f"max_model_len ({max_model_len}): lower max_model_len")
    return path, draft


def check_same_tokenizer(draft_path: str, target_path: str):
    """Where both models ship tokenizer files, their vocabularies must be the same token for token."""
    has = [any(os.path.exists(os.path.join(p, f)) for f in _TOKENIZER_FILES) for p in (draft_path, target_path)]
    if not all(has):
        return
    from transformers import AutoTokenizer
    draft, target = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (draft_path, target_path))
    if draft != target:
        differ = sorted(set(draft.items()) ^ set(target.items()))[:3]
        raise ValueError(f"{_name('model')}: the draft's tokenizer differs from the target's (e.g. {differ}): "
                         "speculative decoding needs the same tokenizer and vocabulary")


def draft_memory(spec: SpeculativeConfig | None, dtype, kv_dtype, block_size: int) -> tuple[int, int]:
    """(bytes of one KV block of the draft model in kv_dtype, bytes of its weights in dtype): what
    the target's KV budget leaves the draft, which holds as many blocks as the target. (0, 0)
    without a draft."""
    if spec is None or spec.method != "draft_model":
        return 0, 0
    import torch

    from nanovllm.models.loader import build_model
    hf = spec.draft_hf_config
    model = build_model(hf, dtype, torch.device("meta"))  # shapes only: nothing allocated
    kv_heads, head_dim = model.kv_cache_shape()
    elem = torch.tensor([], dtype=kv_dtype).element_size()
    block = 2 * len(model.attention_layers) * block_size * kv_heads * head_dim * elem
    return block, sum(p.numel() * p.element_size() for p in model.parameters())
