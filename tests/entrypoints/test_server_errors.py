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
