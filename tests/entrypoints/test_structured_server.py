"""Structured outputs and tool calls through the official openai client against real servers, on the
tiny random Qwen3 (a template without tool support: the default tool prompt) and the embedded
SmolLM2: response_format (and `parse()` with a pydantic model), vLLM's structured_outputs and
guided_* on both endpoints, tool_choice required / named, streamed tool calls that join into valid
arguments; every bad input a 400 naming its field, and the server healthy afterwards."""
import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from helpers import whitespace_token_ids

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    member: bool
    role: Literal["admin", "user"]


@pytest.fixture(scope="module")
def no_space(model_factory):
    """logit_bias keeping the random model off whitespace-only tokens (helpers.whitespace_token_ids)."""
    return {str(t): -100 for t in whitespace_token_ids(AutoTokenizer.from_pretrained(model_factory("qwen3")))}


def _model(server):
    return server.client().models.list().data[0].id


def test_parse_with_a_pydantic_model(tiny_server, no_space):
    client = tiny_server.client()
    for seed in (1, 2):
        completion = client.chat.completions.parse(model=_model(tiny_server), messages=CHAT, response_format=Person,
                                                   logit_bias=no_space, seed=seed, temperature=1.0, max_tokens=120)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_response_format_json_schema_n_and_stream(tiny_server, no_space):
    client = tiny_server.client()
    schema = Person.model_json_schema()
    kwargs = dict(model=_model(tiny_server), messages=CHAT, logit_bias=no_space, seed=5, temperature=0.9,
                  max_tokens=120, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    full = client.chat.completions.create(n=2, **kwargs)
    for choice in full.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                   if c.choices)
    assert text == full.choices[0].message.content  # the same seed: the same JSON


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": r"[a-z]{2,4}-\d{2}"}, lambda t: re.fullmatch(r"[a-z]{2,4}-\d{2}", t)),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"guided_grammar": 'root ::= "(" [0-9] [0-9]? ")"'}, lambda t: re.fullmatch(r"\(\d\d?\)", t)),
    ({"structured_outputs": {"regex": "(yes|no)!"}}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda t: json.loads(t)["ok"] in (True, False)),
])
def test_vllm_fields_on_both_endpoints(tiny_server, no_space, extra, check):
    client = tiny_server.client()
    model = _model(tiny_server)
    body = {**extra, "logit_bias": no_space}
    out = client.completions.create(model=model, prompt="Hello", max_tokens=60, temperature=0, extra_body=body)
    assert out.choices[0].finish_reason == "stop" and check(out.choices[0].text), out.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Hello", max_tokens=60, temperature=0, stream=True, extra_body=body) if c.choices)
    assert streamed == out.choices[0].text
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=60, temperature=0.8, seed=3,
                                          extra_body=body)
    assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content)


def _arguments_valid(call, tool):
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_and_named_tool_choice(tiny_server, no_space):
    client = tiny_server.client()
    common = dict(model=_model(tiny_server), messages=CHAT, tools=[WEATHER, CLOCK], logit_bias=no_space,
                  max_tokens=150, temperature=1.0)
    for seed in (1, 2, 3):
        out = client.chat.completions.create(tool_choice="required", seed=seed, **common)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _arguments_valid(call, WEATHER if call.function.name == "get_weather" else CLOCK)
    single = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, seed=4, **common)
    assert len(single.choices[0].message.tool_calls) == 1
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           seed=5, **common)
    choice = named.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's, for a named function
    assert len(choice.message.tool_calls) == 1
    _arguments_valid(choice.message.tool_calls[0], CLOCK)


def test_streamed_tool_calls_join_into_the_non_streamed_ones(tiny_server, no_space):
    client = tiny_server.client()
    common = dict(model=_model(tiny_server), messages=CHAT, tools=[WEATHER, CLOCK], tool_choice="required",
                  logit_bias=no_space, max_tokens=150, temperature=1.0, seed=8)
    full = client.chat.completions.create(**common).choices[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **common):
        for choice in chunk.choices:
            assert not choice.delta.content
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:  # a call's first piece: its id, type and name
                    assert piece.index not in calls and piece.type == "function"
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [[c.function.name, c.function.arguments] for c in full.message.tool_calls]


def test_tool_conversations_render(tiny_server):
    client = tiny_server.client()
    messages = CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    for tools in ([WEATHER], None):
        out = client.chat.completions.create(model=_model(tiny_server), messages=messages, tools=tools, max_tokens=4,
                                             temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


BAD = [
    # (endpoint, body, param, words in the message)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "response_format.json_schema.schema is not a valid JSON schema"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", "response_format.type must be"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema must be an object"),
    ("completions", {"guided_regex": "(ab"}, "guided_regex", "guided_regex is not a valid regular expression"),
    ("completions", {"guided_grammar": "root ::= nothing"}, "guided_grammar", "not a valid EBNF grammar"),
    ("completions", {"guided_json": "{oops"}, "guided_json", "not valid JSON"),
    ("completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown field(s) pattern"),
    ("completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one field may constrain"),
    ("chat", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one field"),
    ("completions", {"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "must be 'xgrammar'"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "keys must be token ids"),
    ("completions", {"logit_bias": {"5": 300}}, "logit_bias", "[-100, 100]"),
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias", "outside the vocabulary"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among the tools"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools", "used by more than one tool"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "function.name must be"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools", "tools[0].function.parameters is not a valid JSON schema"),
    ("chat", {"tools": [{"type": "retrieval"}]}, "tools", "tools.0"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined with tool_choice"),
    ("chat", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "must not set tools"),
    ("chat", {"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ("chat", {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     "messages", "arguments is not valid JSON"),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "use tools"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities", "not supported"),
    ("completions", {"use_beam_search": True}, "use_beam_search", "not supported"),
    ("completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids", "not supported"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
    ("completions", {"length_penalty": 0.5}, "length_penalty", "not supported"),
]


@pytest.mark.parametrize("endpoint, body, param, words", BAD, ids=[b[3] for b in BAD])
def test_bad_requests_name_their_field(tiny_server, endpoint, body, param, words):
    base = {"prompt": "hi"} if endpoint == "completions" else {"messages": CHAT}
    r = httpx.post(f"{tiny_server.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}",
                   json={**base, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert "Traceback" not in r.text and "/project/cpp" not in r.text


def test_neutral_values_of_unimplemented_fields_are_fine_and_the_server_stays_healthy(tiny_server):
    body = {"prompt": "hi", "max_tokens": 2, "use_beam_search": False, "length_penalty": 1, "modalities": None,
            "guided_decoding_backend": "xgrammar", "response_format": {"type": "text"}, "logit_bias": {"5": 0.5}}
    assert httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(tiny_server.url + "/health", timeout=10).status_code == 200


def test_the_embedded_model_fills_a_schema_and_calls_a_tool(smol_server):
    client = smol_server.client()
    model = _model(smol_server)

    class City(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)
    parsed = client.chat.completions.parse(model=model, response_format=City, temperature=0, max_tokens=60, messages=[
        {"role": "user", "content": "Name the capital of France and its country, as JSON."}]).choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.city
    obj = client.chat.completions.create(model=model, response_format={"type": "json_object"}, temperature=0,
                                         max_tokens=150, messages=[{"role": "user", "content":
                                                                    "Give a JSON object with a cat's name and color."}])
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    # (Left to parallel calls, this model calls get_weather again and again.)
    call = client.chat.completions.create(model=model, messages=CHAT, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=80).choices[0]
    assert call.finish_reason == "tool_calls" and len(call.message.tool_calls) == 1
    _arguments_valid(call.message.tool_calls[0], WEATHER)
