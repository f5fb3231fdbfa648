"""OpenAI tool calling in the Hermes format, the one Qwen2.5 / Qwen3 (and Hermes) models are trained on:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- `ToolSet.from_request` validates `tools`, `tool_choice` and `parallel_tool_calls` (400s name the field).
- The tools reach the model through the chat template's `tools` argument; a template that ignores
  it gets the default tool prompt in the system message instead (`chat_prompt.py`).
- `tool_choice="required"` or a named function is enforced by a grammar (`ToolSet.constraint`, an
  xgrammar structural tag of this format), so any model, however small, produces valid calls;
  `"auto"` parses what the model writes.
- `HermesToolStream` parses the output, streamed or not (a whole text is one feed), into content and
  tool calls: streamed, a call's first piece carries its id and name, and the pieces of its
  `arguments` join into the JSON text the model wrote.
"""
import json
import re
import uuid
from dataclasses import dataclass, field

from nanovllm.entrypoints.openai.protocol import APIError
from nanovllm.structured_output import StructuredOutputsParams

START_TAG, END_TAG = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL_PREFIX = '<tool_call>\n{"name": "'
_CALL_ARGUMENTS = '", "arguments": '
_CALL_END = "}\n</tool_call>"
# The start of a call's JSON, as far as its arguments: `{"name": "...", "arguments": ` then `{`.
_STREAMABLE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolSet:
    tools: list[dict]               # as the chat template takes them: {"type": "function", "function": {...}}
    choice: str                     # "auto", "required" or "named"
    named: str | None = None        # the function tool_choice names
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @classmethod
    def from_request(cls, req) -> "ToolSet | None":
        """None where the model gets no tools (none given, or tool_choice "none")."""
        choice = req.tool_choice
        if not req.tools:
            if choice is not None and choice != "none":
                raise APIError("tool_choice needs tools: there is no tool to choose", param="tool_choice")
            return None
        if choice == "none":
            return None
        tools, seen = [], set()
        for i, tool in enumerate(req.tools):
            fn = tool.function
            if not _NAME.fullmatch(fn.name):
                raise APIError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {fn.name!r}",
                               param="tools")
            if fn.name in seen:
                raise APIError(f"tools[{i}].function.name {fn.name!r} is used by more than one tool", param="tools")
            seen.add(fn.name)
            if fn.parameters is not None:
                try:
                    StructuredOutputsParams(json=fn.parameters)
                except ValueError as e:
                    raise APIError(str(e).replace("structured_outputs.json", f"tools[{i}].function.parameters"),
                                   param="tools") from None
            tools.append({"type": "function", "function": fn.model_dump(exclude_none=True)})
        named = None
        if choice is None or choice == "auto":
            kind = "auto"
        elif choice == "required":
            kind = "required"
        else:
            kind, named = "named", choice.function.name
            if named not in seen:
                raise APIError(f"tool_choice names function {named!r}, which is not among the tools "
                               f"({', '.join(sorted(seen))})", param="tool_choice")
        return cls(tools, kind, named, req.parallel_tool_calls is not False)

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of the calls tool_choice requires ("required" or named); None for "auto"."""
        if self.choice == "auto":
            return None
        tags = [_call_tag(t["function"]) for t in self.tools
                if self.choice == "required" or t["function"]["name"] == self.named]
        if self.choice == "named":
            fmt = tags[0]
        else:
            fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                   "stop_after_first": not self.parallel}
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the model stopped after calling tools, except for a named
        function (then "stop")."""
        if called and reason == "stop" and self.choice != "named":
            return "tool_calls"
        return reason


def _call_tag(function: dict) -> dict:
    schema = function.get("parameters")
    if schema is None:  # OpenAI: no parameters means an empty parameter list
        schema = {"type": "object", "properties": {}}
    return {"type": "tag", "begin": _CALL_PREFIX + function["name"] + _CALL_ARGUMENTS,
            "content": {"type": "json_schema", "json_schema": schema}, "end": _CALL_END}


def format_tool_call(name: str, arguments) -> str:
    """A call as the model writes it (for conversations rendered without the template's help)."""
    return f'{START_TAG}\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n{END_TAG}'


# ---- parsing the output ------------------------------------------------------------------------
class _JsonEnd:
    """Where a JSON object or array ends, found piece by piece (strings and escapes respected)."""
    __slots__ = ("depth", "in_string", "escape")

    def __init__(self):
        self.depth, self.in_string, self.escape = 0, False, False

    def feed(self, text: str) -> int | None:
        """Index in text just past the value's end, or None if it does not end in text."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass
class _Call:
    index: int
    space_before: str = ""          # whitespace held before the opening tag (content's, if no call)
    raw: str = ""                   # the block's text after the opening tag
    id: str | None = None
    name: str | None = None         # known once announced
    args_start: int | None = None   # offset in raw where the (streamed) arguments begin
    args_end: int | None = None     # offset in raw just past them, once seen
    sent: int = 0                   # offset in raw up to which arguments went out
    scanner: _JsonEnd = field(default_factory=_JsonEnd)


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


class HermesToolStream:
    """Text in, (content piece, tool-call deltas) out; `calls` holds the calls parsed so far.

    Content comes without leading and trailing whitespace (trailing whitespace is held until more
    content follows), and text that may be the start of an opening tag is held until it is known.
    A block whose JSON names no known tool, or does not parse, is content, as the model wrote it."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.calls: list[ParsedToolCall] = []
        self._held = ""
        self._call: _Call | None = None
        self._content_started = False
        self._num_blocks = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        held = self._held + text
        content, deltas = "", []
        while True:
            if self._call is None:
                start = held.find(START_TAG)
                if start < 0:
                    keep = _partial_suffix(held, START_TAG)
                    piece, rest = self._content(held[:len(held) - keep])
                    content += piece
                    held = rest + held[len(held) - keep:]
                    break
                piece, space = self._content(held[:start])  # whitespace before a call is dropped
                content += piece
                self._call = _Call(self._num_blocks, space)
                self._num_blocks += 1
                held = held[start + len(START_TAG):]
                continue
            end = held.find(END_TAG)
            keep = 0 if end >= 0 else _partial_suffix(held, END_TAG)
            upto = end if end >= 0 else len(held) - keep
            self._call.raw += held[:upto]
            deltas += self._stream_call()
            if end < 0:
                held = held[upto:]
                break
            piece, call_deltas = self._close_call()
            content += piece
            deltas += call_deltas
            held = held[end + len(END_TAG):]
        self._held = held
        return content, deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the output: what is still held (an unclosed call is closed as it stands)."""
        held, self._held = self._held, ""
        if self._call is not None:
            self._call.raw += held
            deltas = self._stream_call()
            piece, call_deltas = self._close_call(closed=False)
            return piece, deltas + call_deltas
        return self._content(held, closing=True)[0], []

    # ---- content ---------------------------------------------------------------------------
    def _content(self, text: str, closing: bool = False) -> tuple[str, str]:
        if not self._content_started:
            text = text.lstrip()
        piece = text.rstrip()
        if piece:
            self._content_started = True
        return piece, "" if closing else text[len(piece):]

    # ---- calls -----------------------------------------------------------------------------
    def _stream_call(self) -> list[dict]:
        call, deltas = self._call, []
        if call.name is None and call.args_start is None:
            m = _STREAMABLE.match(call.raw)
            if m is None:
                return deltas
            name = _json_string(m.group(1))
            if name not in self.tool_names:
                call.args_start = -1  # not a call of ours: content once the block closes
                return deltas
            call.id, call.name, call.args_start = tool_call_id(), name, m.end()
            call.sent = call.args_start
            deltas.append({"index": len(self.calls), "id": call.id, "type": "function",
                           "function": {"name": name, "arguments": ""}})
        if call.name is None or call.args_end is not None:
            return deltas
        new = call.raw[call.sent:]
        end = call.scanner.feed(new)
        piece = new if end is None else new[:end]
        if end is not None:
            call.args_end = call.sent + end
        if piece:
            call.sent += len(piece)
            deltas.append({"index": len(self.calls), "function": {"arguments": piece}})
        return deltas

    def _close_call(self, closed: bool = True) -> tuple[str, list[dict]]:
        call, self._call = self._call, None
        if call.name is not None:  # streamed
            self.calls.append(ParsedToolCall(call.id, call.name, call.raw[call.args_start:call.sent]))
            return "", []
        parsed = _whole_call(call.raw, self.tool_names)
        if parsed is None:  # not a call: the block is content, as written
            text = call.space_before + START_TAG + call.raw + (END_TAG if closed else "")
            return self._content(text, closing=not closed)[0], []
        name, arguments = parsed
        parsed_call = ParsedToolCall(tool_call_id(), name, arguments)
        index = len(self.calls)
        self.calls.append(parsed_call)
        return "", [{"index": index, "id": parsed_call.id, "type": "function",
                     "function": {"name": name, "arguments": arguments}}]


def _whole_call(raw: str, tool_names: set[str]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a block in any key order, or None if it is not a call of ours."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            if isinstance(json.loads(args), dict):
                return obj["name"], args
        except ValueError:
            pass
        return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


def _json_string(body: str) -> str:
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return body


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper beginning of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[ParsedToolCall]]:
    """(content or None, calls) of a whole output."""
    stream = HermesToolStream(tool_names)
    content, _ = stream.feed(text)
    rest, _ = stream.finish()
    content += rest
    return content or None, stream.calls
