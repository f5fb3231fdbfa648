"""Many concurrent requests, some cancelled mid-stream or abandoned: the rest complete with the
right usage, and afterwards nothing runs, waits or holds KV blocks."""
import asyncio
import random

import httpx
import pytest


async def _one(client, model, rng: random.Random, cancel: bool):
    """One request; returns (kind, expected usage, usage, finish reasons) or ("cancelled", ...)."""
    prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 100))]
    max_tokens = 600 if cancel else rng.randint(1, 16)
    kind = rng.choice(["stream", "plain", "chat-stream"]) if not cancel else rng.choice(["stream", "chat-stream"])
    extra = {"ignore_eos": True}  # so completion_tokens == max_tokens exactly
    if kind == "chat-stream":
        messages = [{"role": "user", "content": "word " * rng.randint(1, 40)}]
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                      stream=True, stream_options={"include_usage": True},
                                                      temperature=1.0, extra_body=extra)
    elif kind == "stream":
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                                 stream_options={"include_usage": True}, temperature=1.0,
                                                 extra_body=extra)
    else:
        out = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                                              extra_body=extra)
        return kind, (len(prompt), max_tokens), out.usage, [c.finish_reason for c in out.choices]
    chunks, usage, finish = 0, None, []
    cancel_at = rng.randint(2, 4)
    async for chunk in stream:
        chunks += 1
        if cancel and chunks == cancel_at:
            await stream.close()  # the client goes away mid-generation
            return "cancelled", None, None, None
        if chunk.usage is not None:
            usage = chunk.usage
        finish += [c.finish_reason for c in chunk.choices if c.finish_reason]
    return kind, (len(prompt) if kind == "stream" else None, max_tokens), usage, finish


def test_concurrent_requests_with_cancellations(tiny_server):
    model = tiny_server.client().models.list().data[0].id
    before = tiny_server.metrics()

    async def main():
        client = tiny_server.async_client(timeout=120)
        rng = random.Random(0)
        cancels = [i % 4 == 0 for i in range(64)]  # a quarter of them
        try:
            return await asyncio.gather(*(_one(client, model, random.Random(rng.random()), c) for c in cancels))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert sum(r[0] == "cancelled" for r in results) == 16
    for kind, expected, usage, finish in results:
        if kind == "cancelled":
            continue
        num_prompt, max_tokens = expected
        assert usage is not None, kind
        assert usage.completion_tokens == max_tokens and finish == ["length"], (kind, usage, finish)
        if num_prompt is not None:
            assert usage.prompt_tokens == num_prompt
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    after = tiny_server.wait_idle()
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0
    key = 'vllm:request_success_total{finished_reason="%s"}'
    aborted = after[key % "abort"] - before[key % "abort"]
    finished = after[key % "length"] - before[key % "length"]
    assert aborted == 16 and finished == 48


def test_abandoned_non_streaming_request_is_aborted(tiny_server):
    model = tiny_server.client().models.list().data[0].id
    key = 'vllm:request_success_total{finished_reason="abort"}'
    before = tiny_server.metrics()[key]
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(tiny_server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    after = tiny_server.wait_idle()
    assert after[key] == before + 1 and after["vllm:kv_cache_usage_perc"] == 0
