"""Output parsing on a server whose model is scripted (helpers.script_model): the tiny random Qwen3
with <think> and <tool_call> tokens and a Qwen3-like template that renders tools, served with the
qwen3 reasoning parser, in this process (thread engine, ASGI transport), through the official
openai client. "auto" tool calls parsed from the text, streamed and not; reasoning_content split off,
a constraint applied after the reasoning; tool conversations rendered by the template; chat_template_kwargs."""
import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from helpers import QWEN3_LIKE, make_reasoning_model, script_model
from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.entrypoints.openai.api_server import build_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = make_reasoning_model(str(tmp_path_factory.mktemp("reasoning")))
    config = Config(path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=512,
                    reasoning_parser="qwen3")
    engine = AsyncLLMEngine(config, separate_process=False)
    engine.start()
    yield engine, build_app(engine, ["tiny"]), AutoTokenizer.from_pretrained(path)
    engine.shutdown()


def _ask(served, script: str, stream: bool = False, **kwargs):
    """The model writes `script` (then eos); the reply (or its chunks) through the openai client."""
    engine, app, tok = served
    script_model(engine.engine, tok.encode(script))

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        args = {"model": "tiny", "messages": CHAT, "max_tokens": 120, "temperature": 0, **kwargs}
        if not stream:
            return await client.chat.completions.create(**args)
        return [c async for c in await client.chat.completions.create(stream=True, **args)]
    return asyncio.run(main())


def _joined(chunks):
    """(reasoning, content, {index: [name, arguments, id]}, finish_reason) of a stream."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                if piece.id is not None:
                    calls[piece.index] = [piece.function.name, "", piece.id]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = CALL + '\n<tool_call>\n{"arguments": {"zone": "CET"}, "name": "get_time"}\n</tool_call>'


@pytest.mark.parametrize("script, content, calls", [
    ("I will check.\n" + CALL, "I will check.", [("get_weather", '{"city": "Paris"}')]),
    (TWO_CALLS, None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ('<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', []),
    ("No tools needed.", "No tools needed.", []),
])
def test_auto_tool_calls_are_parsed_streamed_or_not(served, script, content, calls):
    full = _ask(served, script, tools=[WEATHER, CLOCK]).choices[0]
    got = [(c.function.name, c.function.arguments) for c in full.message.tool_calls or []]
    assert full.message.content == content and got == calls
    assert full.finish_reason == ("tool_calls" if calls else "stop")
    assert len({c.id for c in full.message.tool_calls or []}) == len(calls)
    reasoning, streamed, pieces, finish = _joined(_ask(served, script, stream=True, tools=[WEATHER, CLOCK]))
    assert (streamed or None) == content and finish == full.finish_reason and not reasoning
    assert [tuple(pieces[i][:2]) for i in sorted(pieces)] == calls
    for _, arguments, _ in pieces.values():
        json.loads(arguments)


def test_tool_choice_none_gives_the_text(served):
    out = _ask(served, CALL, tools=[WEATHER], tool_choice="none").choices[0]
    assert out.message.tool_calls is None and out.message.content == CALL and out.finish_reason == "stop"


def test_reasoning_is_split_off(served):
    script = "<think>\nLet me think.\n</think>\n\nThe answer."
    full = _ask(served, script).choices[0].message
    assert full.reasoning_content == "Let me think." and full.content == "The answer."
    reasoning, content, _, finish = _joined(_ask(served, script, stream=True))
    assert (reasoning, content, finish) == ("Let me think.", "The answer.", "stop")
    truncated = _ask(served, "<think>\nStill thinking", max_tokens=3).choices[0]
    assert truncated.finish_reason == "length" and truncated.message.reasoning_content and not truncated.message.content


def test_reasoning_then_tool_calls(served):
    out = _ask(served, "<think>Need the weather.</think>\n" + CALL, tools=[WEATHER]).choices[0]
    assert out.message.reasoning_content == "Need the weather." and out.finish_reason == "tool_calls"
    assert out.message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_constraints_apply_after_the_reasoning(served):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"]}
    # The script breaks the schema in the reasoning (allowed) and in the answer (masked).
    out = _ask(served, '<think>{"a": "x"}</think>{"a": "x"}',
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).choices[0]
    assert out.message.reasoning_content == '{"a": "x"}' and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.message.content), schema)
    required = _ask(served, "<think>x</think>" + CALL, tools=[WEATHER], tool_choice="required").choices[0]
    assert required.message.reasoning_content == "x" and required.finish_reason == "tool_calls"
    assert required.message.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_chat_template_kwargs_reach_the_template(served):
    # enable_thinking=False: the template closes an empty think block, so the output is all answer.
    out = _ask(served, "<think>not reasoning</think>ok", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.reasoning_content is None
    assert out.choices[0].message.content == "<think>not reasoning</think>ok"


def test_tool_conversations_render_through_the_template(served):
    _, _, tok = served
    messages = CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = _ask(served, "It is 21 degrees.", messages=messages, tools=[WEATHER])
    assert out.choices[0].message.content == "It is 21 degrees."
    expected = tok.apply_chat_template(
        CHAT + [{"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}],
        tools=[WEATHER], tokenize=False, add_generation_prompt=True, chat_template=QWEN3_LIKE)
    assert '"arguments": {"city": "Paris"}' in expected and "<tool_response>\n21 degrees" in expected
    assert out.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))
