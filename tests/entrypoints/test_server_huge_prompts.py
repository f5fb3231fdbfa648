"""Huge prompts (issue 38): refused from their length alone, tokenization and chat templates off the
event loop, /health answering meanwhile, and the memory given back afterwards."""
import asyncio
import functools
import json
import threading
import time

import httpx

from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.entrypoints.openai.api_server import build_app
from nanovllm.entrypoints.openai.tokenize_pool import max_chars_per_token

HUGE = 7 << 20  # characters, under the default 8 MiB body bound


@functools.cache
def _huge_bodies() -> list[tuple[str, bytes, str]]:
    """(path, JSON body, what the 400 says), encoded beforehand: a client thread encoding 7 MiB
    would hold this process's interpreter lock and delay the /health probes it times."""
    text = "lorem ipsum dolor sit amet " * (HUGE // 27)
    too_long = "maximum context length (1024 tokens)"
    bodies = [("/v1/completions", {"prompt": text, "max_tokens": 1}, too_long),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, too_long),
              ("/v1/completions", {"prompt": ["hi", "東京" * (1 << 20)], "max_tokens": 1}, too_long)]
    return [(path, json.dumps(body, ensure_ascii=False).encode(), says) for path, body, says in bodies]


@functools.cache
def _token_ids_body() -> bytes:
    """Two million token ids (6 MiB): refused without being sent to the engine. Parsing and
    validating them holds the event loop ~0.3 s on a CPU core; no prompt of text does."""
    return json.dumps({"prompt": [3 + i % 7 for i in range(2 << 20)], "max_tokens": 1}).encode()


def _post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)


def test_health_answers_while_huge_prompts_are_refused(tiny_server):
    """Each huge prompt is refused while /health keeps answering in under 0.5 s, and a small chat
    request sent meanwhile is served at once (issue 38: /health froze 7.5 s, the chat took 13.7 s)."""
    url = tiny_server.url
    health, refused, small = [], [], {}
    done = threading.Event()

    def probe():
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            health.append(time.monotonic() - start)
            time.sleep(0.02)

    def chat():
        start = time.monotonic()
        small["response"] = _post(url + "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode())
        small["seconds"] = time.monotonic() - start

    prober = threading.Thread(target=probe)
    prober.start()
    chatter = threading.Thread(target=chat)
    for i, (path, body, says) in enumerate(_huge_bodies()):
        if i == 1:
            chatter.start()
        r = _post(url + path, body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        refused.append(r.json()["error"]["param"])
    chatter.join(60)
    done.set()
    prober.join(10)
    assert refused == ["prompt", "messages", "prompt"]
    # However fast the refusals go (a fast machine ends them within a few probes), every probe
    # taken meanwhile answered at once.
    assert health and max(health) < 0.5, health
    assert small["response"].status_code == 200 and small["seconds"] < 5


def test_memory_is_given_back_after_huge_prompts(tiny_server):
    httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    start = tiny_server.rss_bytes()
    for _ in range(3):
        for path, body, _ in _huge_bodies():
            assert _post(tiny_server.url + path, body).status_code == 400
        r = _post(tiny_server.url + "/v1/completions", _token_ids_body())
        assert r.status_code == 400 and "prompt has 2097152 tokens but max_model_len is 1024" in r.text
    time.sleep(0.5)  # the heap is trimmed on a worker thread after each
    grown = tiny_server.rss_bytes() - start
    assert grown < 100 << 20, f"the API process grew by {grown / 2**20:.0f} MiB"


def test_the_length_bound_is_kept_only_where_it_holds(smollm_dir):
    from transformers import AutoTokenizer
    smol = AutoTokenizer.from_pretrained(smollm_dir)  # byte-level BPE
    assert max_chars_per_token(smol) == 4 * max(map(len, smol.get_vocab()))
    assert max_chars_per_token(object()) is None  # a tokenizer we cannot see into: no bound


class _SlowTokenizer:
    """A tokenizer whose encode takes a second, as a long prompt's would."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, *args, **kwargs):
        time.sleep(1.0)
        return self._tokenizer.encode(*args, **kwargs)


def _tiny_server(model_factory):
    """An in-process engine on a tiny model and the app serving it (the caller shuts the engine down)."""
    config = Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    engine = AsyncLLMEngine(config, separate_process=False)
    engine.start()
    return engine, build_app(engine, ["tiny"])


def test_tokenization_runs_off_the_event_loop(model_factory, monkeypatch):
    from nanovllm.engine import tokenizer as tokenizer_module
    load = tokenizer_module.load_tokenizer
    monkeypatch.setattr(tokenizer_module, "load_tokenizer", lambda path: _SlowTokenizer(load(path)))
    engine, app = _tiny_server(model_factory)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=30) as c:
            slow = [asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})),
                    asyncio.ensure_future(c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}))]
            await asyncio.sleep(0.2)  # both are tokenizing now
            start = time.monotonic()
            assert (await c.get("/health")).status_code == 200
            health = time.monotonic() - start
            responses = await asyncio.gather(*slow)
            return health, responses
    try:
        health, responses = asyncio.run(main())
    finally:
        engine.shutdown()
    assert health < 0.5 and [r.status_code for r in responses] == [200, 200]


def test_token_id_prompts_skip_the_tokenize_pool(model_factory, monkeypatch):
    """Token ids need no tokenizer: they are checked on the event loop, without a round trip through
    a worker thread (a hop each way, each waiting its turn on a busy loop: part of every TTFT)."""
    from nanovllm.entrypoints.openai.tokenize_pool import TokenizePool
    pooled = []
    run = TokenizePool.run

    async def counting_run(self, fn, *args):
        pooled.append(args[0])
        return await run(self, fn, *args)
    monkeypatch.setattr(TokenizePool, "run", counting_run)
    engine, app = _tiny_server(model_factory)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=30) as c:
            ids = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
            batch = await c.post("/v1/completions", json={"prompt": [[5, 6], [7]], "max_tokens": 1})
            text = await c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
            return ids, batch, text
    try:
        ids, batch, text = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [r.status_code for r in (ids, batch, text)] == [200, 200, 200]
    assert (ids.json()["usage"]["prompt_tokens"], batch.json()["usage"]["prompt_tokens"]) == (3, 3)
    assert pooled == ["hello"]
