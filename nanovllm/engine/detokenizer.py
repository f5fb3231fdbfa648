"""Incremental detokenization with stop strings, for one sequence.

Decoding token by token is not decoding the whole: a character's UTF-8 bytes may be split over
several byte-level tokens, and some decoders (SentencePiece's) change a token's text depending
on what precedes it. So, as vLLM and HF's DecodeStream do, we decode a short window:
`prefix_offset:read_offset` is text already emitted, kept only as context, and the new text is
what decoding `prefix_offset:` adds to it, emitted only once it no longer ends in U+FFFD (an
incomplete character that the next token may finish). The window starts on the last few prompt
tokens, so the first generated token is decoded in context too.

Stop strings: a new match must end inside the new text, so only the tail that could hold one is
searched. For streaming, text that may still turn out to be the start of a stop string is held
back until resolved (unless the stop string itself will be emitted: include_stop_str_in_output).
"""
from nanovllm.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


def make_decode(tokenizer, skip_special_tokens: bool):
    """ids -> str. The Rust backend's decode directly when it is equivalent (several times
    cheaper than going through transformers' wrapper, which matters once per token)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def decode_completion(tokenizer, prompt_token_ids: list[int], completion_token_ids: list[int],
                      skip_special_tokens: bool = True) -> str:
    """The text the incremental detokenizer would produce for these tokens, in one go."""
    decode = make_decode(tokenizer, skip_special_tokens)
    context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
    prefix = decode(context) if context else ""
    return decode(context + list(completion_token_ids))[len(prefix):]


class IncrementalDetokenizer:
    """`add(token_id) -> (delta, stop_string)`: delta is new text safe to stream; stop_string is
    the stop string that just ended the text (`text` is then final), else None. When the sequence
    ends for another reason, `flush()` returns what was held back."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self._decode = make_decode(tokenizer, params.skip_special_tokens)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        self.text = ""
        self.stop_strings = params.stop_list
        self.include_stop = params.include_stop_str_in_output
        self._hold_back = bool(self.stop_strings) and not self.include_stop
        self._emitted = 0  # text[:_emitted] has been returned as deltas
        self.stopped_by: str | None = None
        self.unread = ""  # deltas a consumer has not taken yet (OutputProcessor.take_delta)

    @property
    def finished(self) -> bool:
        return self.stopped_by is not None

    def add(self, token_id: int, check_stop: bool = True) -> tuple[str, str | None]:
        """Append one generated token. check_stop=False (under min_tokens) skips the stop-string
        search for this token, as vLLM does."""
        if self.stopped_by is not None:
            return "", self.stopped_by
        self._ids.append(token_id)
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return "", None  # nothing yet, or an unfinished character
        piece = new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        self._compact()
        start = len(self.text)
        self.text += piece
        if check_stop and self.stop_strings:
            stop = self._find_stop(start)
            if stop is not None:
                return self._take(len(self.text)), self.stopped_by
        return self._take(len(self.text) - self._pending_stop_prefix()), None

    def flush(self) -> str:
        """The sequence ended without a stop string: release held-back text, plus any unfinished
        character's bytes (as U+FFFD, as a one-shot decode would show them)."""
        if self.stopped_by is None and len(self._ids) > self._read_offset:
            new_text = self._decode(self._ids[self._prefix_offset:])
            self.text += new_text[len(self._prefix_text):]
            self._prefix_offset = self._read_offset = len(self._ids)
            self._prefix_text = ""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _compact(self):
        # Ids before the window are never decoded again.
        if self._prefix_offset > 64:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0

    def _find_stop(self, new_start: int) -> str | None:
        """Earliest-starting stop string that ends in text[new_start:] (earlier ends were searched
        before); truncates text if there is one."""
        best, best_at = None, len(self.text)
        for stop in self.stop_strings:
            lo = max(0, new_start - len(stop) + 1)
            at = self.text.find(stop, lo, min(len(self.text), best_at + len(stop)))
            if at != -1 and at < best_at:
                best, best_at = stop, at
        if best is None:
            return None
        self.stopped_by = best
        self.text = self.text[:best_at + len(best) if self.include_stop else best_at]
        return best

    def _pending_stop_prefix(self) -> int:
        """Length of the longest tail of text that starts some stop string (to hold back)."""
        if not self._hold_back:
            return 0
        text = self.text
        longest = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
