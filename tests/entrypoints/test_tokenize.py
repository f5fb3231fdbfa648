"""vLLM's POST /tokenize and /detokenize (entrypoints/openai/tokenization.py): the ids the server runs
for a completion prompt and for a chat conversation, and back; bad requests are 400s naming the field."""
import asyncio

import httpx
import pytest

from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.engine.tokenizer import load_tokenizer
from nanovllm.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def served(model_factory):
    path = model_factory("qwen3")
    engine = AsyncLLMEngine(Config(path, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20,
                                   max_model_len=256), separate_process=False)
    engine.start()
    yield build_app(engine, ["tiny"]), load_tokenizer(path)
    engine.shutdown()


def _post(app, *requests):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=30) as c:
            return [await c.post(path, json=body) for path, body in requests]
    return asyncio.run(main())


def test_tokenize_gives_the_ids_the_server_runs(served):
    app, tokenizer = served
    text = "hello world, hello"
    messages = [{"role": "user", "content": "hello"}]
    prompt, prompt_strs, chat, completion, usage = _post(
        app, ("/tokenize", {"model": "tiny", "prompt": text}),
        ("/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}),
        ("/tokenize", {"messages": messages}),
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 1}))
    body = prompt.json()
    assert prompt.status_code == 200 and body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) == completion.json()["usage"]["prompt_tokens"]
    assert body["max_model_len"] == 256 and body["token_strs"] is None
    strs = prompt_strs.json()
    assert strs["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(strs["tokens"])
    template = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.json()["tokens"] == tokenizer.encode(template, add_special_tokens=False)
    assert chat.json()["count"] == usage.json()["usage"]["prompt_tokens"]
    (back,) = _post(app, ("/detokenize", {"tokens": body["tokens"]}))
    assert back.status_code == 200 and back.json() == {"prompt": tokenizer.decode(body["tokens"])}


@pytest.mark.parametrize("path,body,field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_requests_name_the_field(served, path, body, field):
    (response,) = _post(served[0], (path, body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field, response.json()
