"""Bad requests get an OpenAI-style 400 naming the problem; the server keeps serving."""
import httpx
import openai
import pytest

BAD_COMPLETIONS = [
    # (body, param, words in the message)
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "max_tokens must be"),
    ({"prompt": "hi", "temperature": -1}, "temperature", "temperature must be"),
    ({"prompt": "hi", "top_p": 2}, "top_p", "top_p must be"),
    ({"prompt": "hi", "n": 0}, "n", "n must be"),
    ({"prompt": "hi", "min_p": 1.5}, "min_p", "min_p must be"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "presence_penalty must be"),
    ({"prompt": "hi", "max_tokens": "lots"}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "stop": [""]}, "stop", "stop must not"),
    ({"prompt": [1, 2, 100000]}, "prompt", "outside the vocabulary"),
    ({"prompt": [-1]}, "prompt", "outside the vocabulary"),
    ({"prompt": [5] * 1024}, "prompt", "max_model_len"),
    ({"prompt": [5] * 1000, "max_tokens": 100}, "max_tokens", "maximum context length"),
    ({"prompt": []}, "prompt", "must not be empty"),
    ({"prompt": ""}, "prompt", "must not be an empty string"),
    ({"max_tokens": 5}, "prompt", "Field required"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"prompt": "hi", "echo": True}, "echo", "not supported"),
]

BAD_CHAT = [
    ({}, "messages", "Field required"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"content": "hi"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_tokens", "max_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "only text"),
]


def _check_error(response: httpx.Response, status: int, param, words: str):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]
    assert "Traceback" not in response.text


@pytest.mark.parametrize("body, param, words", BAD_COMPLETIONS, ids=[b[2] for b in BAD_COMPLETIONS])
def test_bad_completion_requests(tiny_server, body, param, words):
    _check_error(httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30), 400, param, words)


@pytest.mark.parametrize("body, param, words", BAD_CHAT, ids=[b[2] for b in BAD_CHAT])
def test_bad_chat_requests(tiny_server, body, param, words):
    _check_error(httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30), 400, param, words)


def test_bad_json_and_unknown_model(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", content=b'{"messages": [', timeout=30,
                   headers={"Content-Type": "application/json"})
    _check_error(r, 400, None, "not valid JSON")
    r = httpx.post(tiny_server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"}, timeout=30)
    _check_error(r, 400, "model", "`gpt-4` does not exist")
    assert r.json()["error"]["code"] == "model_not_found"


def test_openai_client_sees_the_errors_then_a_valid_request_works(tiny_server):
    client = tiny_server.client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p must be"):
        client.completions.create(model=model, prompt="hi", top_p=2, stream=True)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi")
    out = client.completions.create(model=model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3
    assert httpx.get(tiny_server.url + "/health").status_code == 200


# ---- text that is not text: lone surrogates and bytes that are not UTF-8 (issue 38's probe) -------
_CHAT = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
NOT_TEXT = [
    # (endpoint, raw body, param, the path named in the message)
    ("chat", _CHAT.replace(b'"hi"', rb'"\ud800"'), "messages", "messages[0].content"),
    ("chat", _CHAT.replace(b'"hi"', rb'"x\udc00"'), "messages", "messages[0].content"),
    ("chat", _CHAT.replace(b'"hi"', rb'"\udc00\ud800"'), "messages", "messages[0].content"),  # a reversed pair
    ("chat", _CHAT.replace(b'"user"', rb'"\ud800"'), "messages", "messages[0].role"),
    ("chat", _CHAT.replace(b'"hi"', rb'[{"type": "text", "text": "\ud83d"}]'), "messages",
     "messages[0].content[0].text"),
    ("chat", _CHAT.replace(b'"hi"', b'"\xed\xa0\x80"'), "messages", "messages[0].content"),  # CESU-8 bytes
    ("cmpl", rb'{"prompt": "\ud800", "max_tokens": 1}', "prompt", "prompt"),
    ("cmpl", rb'{"prompt": ["ok", "\udfff"], "max_tokens": 1}', "prompt", "prompt[1]"),
    ("cmpl", rb'{"prompt": "hi", "model": "\ud800", "max_tokens": 1}', "model", "model"),
    ("cmpl", rb'{"prompt": "hi", "stop": ["\ud800"], "max_tokens": 1}', "stop", "stop[0]"),
    ("cmpl", b'{"prompt": "caf\xff", "max_tokens": 1}', "prompt", "prompt"),  # not UTF-8 at all
]


def _post_raw(server, endpoint: str, body: bytes):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=30)


@pytest.mark.parametrize("endpoint, body, param, path", NOT_TEXT, ids=[f"{c[3]}-{i}" for i, c in enumerate(NOT_TEXT)])
def test_strings_that_are_not_text_are_400s_naming_the_field(tiny_server, endpoint, body, param, path):
    _check_error(_post_raw(tiny_server, endpoint, body), 400, param, path)


def test_a_valid_surrogate_pair_is_text(tiny_server):
    r = _post_raw(tiny_server, "cmpl", rb'{"prompt": "\ud83d\ude80 go", "max_tokens": 1}')
    assert r.status_code == 200, r.text


# ---- numbers: seeds in range, finite floats within bounds -----------------------------------------
@pytest.mark.parametrize("seed", [2**63, 2**64, 2**64 - 1, 2**80, -2**63 - 1])
def test_seeds_outside_signed_64_bits_are_400s(tiny_server, seed):
    body = {"prompt": "hi", "max_tokens": 1, "seed": seed}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=30)
    _check_error(r, 400, "seed", "seed must be an integer in [-2**63, 2**63-1]")


def test_seeds_at_the_edges_are_accepted(tiny_server):
    for seed in (2**63 - 1, -2**63):
        r = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "seed": seed},
                       timeout=30)
        assert r.status_code == 200, r.text


def test_top_logprobs_out_of_range_names_top_logprobs(tiny_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 100}
    _check_error(httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30), 400, "top_logprobs",
                 "top_logprobs must be an integer in [0, 20], got 100")


FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e309", "1e308"])
@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_floats_that_are_not_finite_or_far_out_of_range_are_400s(tiny_server, field, literal):
    body = b'{"prompt": "hi", "max_tokens": 1, "%s": %s}' % (field.encode(), literal.encode())
    _check_error(_post_raw(tiny_server, "cmpl", body), 400, field, field)
    chat = _CHAT.replace(b"}],", b'}], "%s": %s,' % (field.encode(), literal.encode()))
    _check_error(_post_raw(tiny_server, "chat", chat), 400, field, field)


def test_the_server_logged_no_traceback_for_any_client_error(tiny_server):
    """Runs after the tests above (file order): bad requests leave no trace in the server's log."""
    log = tiny_server.log_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
