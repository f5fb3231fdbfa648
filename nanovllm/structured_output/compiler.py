"""Compiling constraints against the model's vocabulary (xgrammar), cached by their text.

Built on the first constrained request, so an engine that never sees one never imports xgrammar:
the vocabulary's xgrammar view (`TokenizerInfo`, a fraction of a second) and a compiler whose
cache holds every compiled grammar by (kind, text), as `StructuredOutputsParams.key` gives it.
The tokenizer's special tokens (im_start, eos, ...) are kept out of every grammar: as text they
would fit inside a JSON string, but the detokenizer drops them.
"""
import json
import os
from collections import OrderedDict

from nanovllm.structured_output.params import StructuredOutputsParams, import_xgrammar, xgrammar_message

_CACHE_BYTES = 512 << 20  # compiled grammars kept, least recently used dropped first


def _compile_threads() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        xgr = import_xgrammar()
        # xgrammar sees the tokenizer's tokens only. The rows of a model's vocabulary beyond them
        # (Qwen3: 151,936 for 151,669 tokens; a random model over a small tokenizer: 100k more)
        # would each be a special token to it, and every fill and every accepted token pays for
        # each: 0.1 ms per row and step at 100k of them, 10x the grammar's own work. The masks
        # cover these tokens (`words` per row); the rows beyond are never allowed.
        vocab_size = min(vocab_size, max(tokenizer.get_vocab().values()) + 1)
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.stop_token_ids = sorted(t for t in stop_token_ids if t < vocab_size)
        if not self.stop_token_ids:
            raise ValueError("structured outputs need an eos token inside the vocabulary")
        detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
        vocab = [""] * vocab_size
        for token, i in tokenizer.get_vocab().items():
            if i < vocab_size:
                vocab[i] = token
        special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        for i in special | set(getattr(tokenizer, "all_special_ids", ())):
            if i < vocab_size:
                vocab[i] = ""  # xgrammar's mark of a special token: never part of a grammar's text
        self.tokenizer_info = xgr.TokenizerInfo.from_vocab_and_metadata(vocab, detected.dump_metadata())
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=_compile_threads(),
                                             cache_enabled=False)  # our cache below, by the request's text
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._cache_bytes = 0

    def compile(self, params: StructuredOutputsParams):
        """The CompiledGrammar of params (from the cache when seen before); ValueError naming the
        field when xgrammar rejects it."""
        key = (*params.key, params.disable_any_whitespace)
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        kind, text = params.key
        try:
            c = self._compiler
            if kind == "json":
                compiled = c.compile_json_schema(_bounded_strings_as_patterns(text),
                                                 any_whitespace=not params.disable_any_whitespace)
            elif kind == "json_object":  # an object (OpenAI's JSON mode), not any JSON value
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=not params.disable_any_whitespace)
            elif kind == "regex":
                compiled = c.compile_regex(text)
            elif kind in ("grammar", "choice"):
                compiled = c.compile_grammar(text)
            else:  # a structural tag: its JSON schemas too
                compiled = c.compile_structural_tag(_bounded_strings_as_patterns(text))
        except Exception as e:
            raise ValueError(f"structured_outputs.{kind} could not be compiled: {xgrammar_message(e)}") from None
        self._cache[key] = compiled
        self._cache_bytes += compiled.memory_size_bytes
        while self._cache_bytes > _CACHE_BYTES and len(self._cache) > 1:
            self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
        return compiled


def _bounded_strings_as_patterns(schema_text: str) -> str:
    """xgrammar 0.2.9 compiles a string with minLength / maxLength into a repetition of
    [^"\\\r\n], which lets raw control characters (tab, 0x03...) into the string: invalid JSON
    (mlc-ai/xgrammar#800, fixes pending). The same bounds as a pattern go through its JSON-string
    regex, which keeps them out; escapes are unavailable in both forms."""
    if "Length" not in schema_text:
        return schema_text

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        node = {k: rewrite(v) for k, v in node.items()}
        if (node.get("type") == "string" and "pattern" not in node and "format" not in node
                and isinstance(node.get("minLength", 0), int) and isinstance(node.get("maxLength", 0), int)
                and ("minLength" in node or "maxLength" in node)):
            low, high = node.pop("minLength", 0), node.pop("maxLength", "")
            node["pattern"] = f"^[\\s\\S]{{{low},{high}}}$"
        return node
    return json.dumps(rewrite(json.loads(schema_text)), ensure_ascii=False)
