"""Prompts to token ids off the event loop, and a bound that refuses a prompt before tokenizing it.

Tokenizing a 7 MiB prompt takes seconds; on the event loop it would stall every other request and
/health meanwhile. So chat templates and tokenization run on a small pool of threads (the Rust
tokenizer releases the interpreter lock while it encodes, and encoding with one shared tokenizer
from several threads is safe: nothing here changes its truncation or padding settings).

Before that, a prompt far longer than any prompt of max_model_len tokens is refused from its length
alone: no token of the vocabulary stands for more characters than its longest entry (byte-level
BPE: one character per byte; SentencePiece: one per character), and Unicode normalization (NFC,
NFKC) merges at most a few code points into one, so a prompt of more than
`max_model_len * longest_token * _NORMALIZATION_SLACK` characters cannot fit. The bound is kept
only for BPE vocabularies, where text never collapses into fewer tokens than that: WordPiece and
Unigram vocabularies may fuse any run of unknown characters into one token.
"""
import asyncio
import os
from concurrent.futures import ThreadPoolExecutor

from nanovllm.entrypoints.openai.protocol import APIError

_NORMALIZATION_SLACK = 4  # NFC merges up to 3 code points into one (Hangul jamo, stacked diacritics)


def max_chars_per_token(tokenizer) -> int | None:
    """Most characters of text one token can stand for, or None where that has no bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    if getattr(backend.model, "fuse_unk", False) and not getattr(backend.model, "byte_fallback", False):
        return None
    return max(map(len, tokenizer.get_vocab()), default=1) * _NORMALIZATION_SLACK


class TokenizePool:
    def __init__(self, tokenizer, max_model_len: int, workers: int | None = None):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        per_token = max_chars_per_token(tokenizer) if tokenizer is not None else None
        self.max_prompt_chars = max_model_len * per_token if per_token is not None else None
        self._pool = ThreadPoolExecutor(max_workers=workers or min(4, os.cpu_count() or 1),
                                        thread_name_prefix="nanovllm-tokenize")

    def check_length(self, num_chars: int, field: str):
        """Refuse a prompt of num_chars characters that could never fit max_model_len tokens."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(f"the {field} has {num_chars} characters, more than any prompt of this model's maximum "
                           f"context length ({self.max_model_len} tokens) can hold; shorten the {field}",
                           param=field)

    async def run(self, fn, *args):
        """fn(*args) on a worker thread (it may tokenize or apply a chat template)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self):
        self._pool.shutdown(wait=False, cancel_futures=True)
