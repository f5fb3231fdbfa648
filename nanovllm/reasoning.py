"""Reasoning parsers: where a reasoning model's thinking ends and its answer begins.

`Config(reasoning_parser="qwen3")` (`nanovllm serve --reasoning-parser qwen3`) names one. The
engine uses its marker tokens so that a structured-output constraint applies to the answer, not to
the thinking (`structured_output/matcher.py`); the server splits the text into `reasoning_content`
and `content` with `ReasoningStream`, streamed or not (a non-streamed text is one feed), so both
agree on where the answer starts:

- the prompt leaves the model inside a block (its last marker is the opening tag, as templates that
  open the block themselves do): everything up to the closing tag is reasoning;
- the prompt closes the block (it ends with the closing tag and whitespace: Qwen3's
  `enable_thinking=False`): everything is answer;
- otherwise the model decides: an output that begins with the opening tag reasons until the
  closing tag; any other output is all answer.
"""
from enum import Enum


class PromptState(Enum):
    INSIDE = "inside"   # the prompt opened a reasoning block: the output starts in it
    CLOSED = "closed"   # the prompt ends with a closed block: no reasoning
    OPEN = "open"       # the model decides, by whether it starts with the opening tag


class ReasoningParser:
    name = ""
    start_tag = "<think>"
    end_tag = "</think>"

    def __init__(self, tokenizer):
        if tokenizer is None:
            raise ValueError(f"reasoning_parser {self.name!r} needs the model's tokenizer")
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        ids = []
        for tag in (self.start_tag, self.end_tag):
            if tag not in vocab or tokenizer.encode(tag, add_special_tokens=False) != [vocab[tag]]:
                raise ValueError(f"reasoning_parser {self.name!r} needs {tag!r} to be one token of the "
                                 "model's vocabulary, and it is not: this is not a model it parses")
            ids.append(vocab[tag])
        self.start_token_id, self.end_token_id = ids

    def prompt_state(self, prompt_token_ids: list[int]) -> PromptState:
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            token = prompt_token_ids[i]
            if token == self.start_token_id:
                return PromptState.INSIDE
            if token == self.end_token_id:
                rest = self.tokenizer.decode(prompt_token_ids[i + 1:]) if i + 1 < len(prompt_token_ids) else ""
                return PromptState.CLOSED if not rest.strip() else PromptState.OPEN
        return PromptState.OPEN

    def stream(self, prompt_token_ids: list[int]) -> "ReasoningStream":
        return ReasoningStream(self.start_tag, self.end_tag, self.prompt_state(prompt_token_ids))


class ReasoningStream:
    """Text in, (reasoning, content) pieces out. Each part comes without its leading and trailing
    whitespace (trailing whitespace is held until more text follows it), and a piece of a tag is
    held until it is known not to be one."""

    def __init__(self, start_tag: str, end_tag: str, state: PromptState):
        self.start_tag, self.end_tag = start_tag, end_tag
        self.section = {PromptState.INSIDE: "reasoning", PromptState.CLOSED: "content"}.get(state, "undecided")
        self._held = ""  # text received and not yet given out
        self._started = {"reasoning": False, "content": False}

    def feed(self, text: str) -> tuple[str, str]:
        held = self._held + text
        out = {"reasoning": "", "content": ""}
        while True:
            if self.section == "undecided":
                lead = held.lstrip()
                if lead.startswith(self.start_tag):
                    self.section, held = "reasoning", lead[len(self.start_tag):]
                    continue
                if self.start_tag.startswith(lead):
                    break  # may still become the opening tag
                self.section = "content"
            elif self.section == "reasoning":
                end = held.find(self.end_tag)
                if end >= 0:
                    out["reasoning"] += self._take("reasoning", held[:end], closing=True)[0]
                    self.section, held = "content", held[end + len(self.end_tag):]
                    continue
                keep = _partial_suffix(held, self.end_tag)
                piece, rest = self._take("reasoning", held[:len(held) - keep])
                out["reasoning"] += piece
                held = rest + held[len(held) - keep:]
                break
            else:
                piece, held = self._take("content", held)
                out["content"] += piece
                break
        self._held = held
        return out["reasoning"], out["content"]

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the output."""
        held, self._held = self._held, ""
        if self.section == "reasoning":
            return self._take("reasoning", held, closing=True)[0], ""
        return "", self._take("content", held, closing=True)[0]

    def _take(self, section: str, text: str, closing: bool = False) -> tuple[str, str]:
        """(what of text to give out now, what to hold): the section's leading whitespace is
        dropped, and its trailing whitespace held, or dropped when the section closes."""
        if not self._started[section]:
            text = text.lstrip()
        piece = text.rstrip()
        if piece:
            self._started[section] = True
        return piece, "" if closing else text[len(piece):]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}


def reasoning_parser(name: str, tokenizer) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name](tokenizer)
