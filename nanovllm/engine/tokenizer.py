"""Tokenizer loading, tolerant of model directories that ship no tokenizer files."""
import json
import os

from transformers import AutoTokenizer

from nanovllm.config import Config

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(config: Config, tokenizer) -> set[int]:
    """Every id that ends generation: the config's eos, the tokenizer's, generation_config's."""
    ids = set()
    if config.eos >= 0:
        ids.add(config.eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_path = os.path.join(config.model, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids
