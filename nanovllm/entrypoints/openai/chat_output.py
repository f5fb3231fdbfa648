"""One chat completion's text as the parts of an assistant message: `reasoning_content` (with a
reasoning parser), `content` and `tool_calls` (with tools). Streamed text goes through the same
objects as a whole text, so the chunks of a stream join into the non-streamed message."""
from dataclasses import dataclass, field

from nanovllm.entrypoints.openai.tool_parsers import HermesToolStream, ToolSet
from nanovllm.reasoning import ReasoningParser


@dataclass
class MessageParts:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # streamed pieces ({"index", ...})


class ChatOutputStream:
    def __init__(self, reasoning: ReasoningParser | None, prompt_token_ids: list[int], tools: ToolSet | None):
        self._reasoning = reasoning.stream(prompt_token_ids) if reasoning is not None else None
        self._tools = HermesToolStream(tools.names) if tools is not None else None

    @property
    def tool_calls(self):
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> MessageParts:
        return self._parts(*(self._reasoning.feed(text) if self._reasoning is not None else ("", text)))

    def finish(self) -> MessageParts:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        parts = self._parts(reasoning, content)
        if self._tools is not None:
            rest, deltas = self._tools.finish()
            parts.content += rest
            parts.tool_calls += deltas
        return parts

    def _parts(self, reasoning: str, content: str) -> MessageParts:
        if self._tools is None or not content:
            return MessageParts(reasoning, content)
        content, deltas = self._tools.feed(content)
        return MessageParts(reasoning, content, deltas)

    def whole(self, text: str) -> MessageParts:
        """A whole output (after no other feed)."""
        first, last = self.feed(text), self.finish()
        return MessageParts(first.reasoning + last.reasoning, first.content + last.content)
