"""The Hermes tool-call parser and the reasoning splitter piece by piece (any split of a text gives
the whole text's result), and chat prompts for templates with and without tool support."""
import json
import random

import pytest

from helpers import QWEN3_LIKE, make_tokenizer
from nanovllm.entrypoints.openai.chat_prompt import chat_prompt_text, template_takes_tools
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest
from nanovllm.entrypoints.openai.tool_parsers import HermesToolStream, ToolSet, parse_tool_calls
from nanovllm.reasoning import PromptState, ReasoningStream

NAMES = {"get_weather", "count"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", "d": [1, {"e": []}]}}\n</tool_call>'
TEXTS = [
    # (text, content, [(name, arguments)])
    ("Let me check.\n" + CALL, "Let me check.", [("get_weather", '{"city": "Pa}ris \\"x\\"", "d": [1, {"e": []}]}')]),
    (CALL + '\n<tool_call>\n{"arguments": {"n": 3}, "name": "count"}\n</tool_call>\n', None,
     [("get_weather", '{"city": "Pa}ris \\"x\\"", "d": [1, {"e": []}]}'), ("count", '{"n": 3}')]),
    ('A <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> B',
     'A <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> B', []),
    ('<tool_call>\n{"name": "count", "arguments": "{\\"n\\": 1}"}\n</tool_call>', None, [("count", '{"n": 1}')]),
    ('<tool_call>\n{"name": "count", "arguments": {"n": 1}}', None, [("count", '{"n": 1}')]),  # never closed
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("  plain <tool text, no call  ", "plain <tool text, no call", []),
    ("", None, []),
]


def _stream(text: str, rng: random.Random):
    stream, content, calls = HermesToolStream(NAMES), "", {}
    pieces = []
    i = 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        pieces.append(text[i:j])
        i = j
    for out in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += out[0]
        for delta in out[1]:
            if "id" in delta:
                assert delta["index"] not in calls and delta["type"] == "function"
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)], stream.calls


@pytest.mark.parametrize("text, content, calls", TEXTS)
def test_tool_calls_parse_whole_and_in_any_pieces(text, content, calls):
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    assert whole_content == content and [(c.name, c.arguments) for c in whole_calls] == calls
    rng = random.Random(0)
    for _ in range(50):
        streamed_content, streamed_calls, parsed = _stream(text, rng)
        assert streamed_content == content and streamed_calls == calls
        assert [(c.name, c.arguments) for c in parsed] == calls
        for _, arguments in streamed_calls:
            json.loads(arguments)


REASONING = [
    (PromptState.OPEN, " <think>\nStep 1.\n\nStep 2.\n</think>\n\nAnswer  \n", "Step 1.\n\nStep 2.", "Answer"),
    (PromptState.OPEN, "No thinking here.", "", "No thinking here."),
    (PromptState.OPEN, "<thin", "", "<thin"),
    (PromptState.OPEN, "<think>cut short", "cut short", ""),
    (PromptState.INSIDE, "already thinking</think>done", "already thinking", "done"),
    (PromptState.CLOSED, "<think>x</think>y", "", "<think>x</think>y"),
]


@pytest.mark.parametrize("state, text, reasoning, content", REASONING)
def test_reasoning_splits_whole_and_in_any_pieces(state, text, reasoning, content):
    rng = random.Random(1)
    for trial in range(50):
        stream, got_r, got_c = ReasoningStream("<think>", "</think>", state), "", ""
        i = 0
        while i < len(text):
            j = len(text) if trial == 0 else i + rng.randint(1, 5)
            r, c = stream.feed(text[i:j])
            got_r, got_c, i = got_r + r, got_c + c, j
        r, c = stream.finish()
        assert (got_r + r, got_c + c) == (reasoning, content)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _request(**kwargs):
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": "hi"}], **kwargs})


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    plain = make_tokenizer(str(tmp_path_factory.mktemp("chatml")))
    tools = make_tokenizer(str(tmp_path_factory.mktemp("qwen3like")), chat_template=QWEN3_LIKE)
    return plain, tools


def test_templates_without_tool_support_get_the_hermes_convention_spelled_out(tokenizers):
    plain, native = tokenizers
    assert not template_takes_tools(plain, None) and template_takes_tools(native, None)
    req = _request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"}, {"role": "tool", "tool_call_id": "c2", "content": "sun"}])
    text = chat_prompt_text(plain, req, ToolSet.from_request(req))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text and "<tool_call>\n" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text
    assert "<|im_start|>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\nsun\n</tool_response><|im_end|>" in text
    native_text = chat_prompt_text(native, req, ToolSet.from_request(req))
    assert "# Tools\n<tools>" in native_text and '"arguments": {"city": "Paris"}' in native_text
    # tool_choice "none": no tools in the prompt.
    none = _request(tools=[WEATHER], tool_choice="none")
    assert "Tools" not in chat_prompt_text(plain, none, ToolSet.from_request(none))
    assert chat_prompt_text(plain, _request(), None) == plain.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_template_options_pass_through(tokenizers):
    plain, native = tokenizers
    closed = chat_prompt_text(native, _request(chat_template_kwargs={"enable_thinking": False}), None)
    assert closed.endswith("<think>\n\n</think>\n\n")
    custom = chat_prompt_text(plain, _request(chat_template="{{ messages[0]['content'] }}!"), None)
    assert custom == "hi!"
    cont = chat_prompt_text(plain, _request(messages=[{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "Hel"}],
                                            add_generation_prompt=False, continue_final_message=True), None)
    assert cont.endswith("<|im_start|>assistant\nHel")


def test_required_and_named_constraints():
    req = _request(tools=[WEATHER, {"type": "function", "function": {"name": "t2"}}], tool_choice="required",
                   parallel_tool_calls=False)
    tag = json.loads(ToolSet.from_request(req).constraint().key[1])["format"]
    assert tag["type"] == "tags_with_separator" and tag["stop_after_first"] and len(tag["tags"]) == 2
    assert tag["tags"][1]["content"]["json_schema"] == {"type": "object", "properties": {}}  # no parameters
    named = _request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tools = ToolSet.from_request(named)
    assert json.loads(tools.constraint().key[1])["format"]["begin"].endswith('"get_weather", "arguments": ')
    assert tools.finish_reason("stop", True) == "stop" and ToolSet.from_request(req).finish_reason("stop", True) == \
        "tool_calls"
    assert ToolSet.from_request(_request(tools=[WEATHER])).constraint() is None  # auto: parsed, not constrained
