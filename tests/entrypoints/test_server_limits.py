"""API key, body-size bound, waiting-queue bound and SIGTERM, on one server of their own (one
sequence at a time, one waiting). The tests run in file order; the last one stops the server."""
import signal
import threading
import time

import httpx
import openai
import pytest

from helpers import descendants, running
from openai_server_utils import TINY_ARGS, RemoteServer

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(model_factory):
    args = [model_factory("qwen3"), *TINY_ARGS, "--api-key", KEY, "--max-body-bytes", "20000",
            "--max-num-seqs", "1", "--max-waiting", "1"]
    s = RemoteServer(args, api_key=KEY)
    yield s
    s.stop()


def test_api_key(server):
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(server.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + "/metrics", headers=headers).status_code == 401
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = server.client()
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


def test_oversized_body(server):
    body = {"prompt": "x" * 30000, "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the bound is enforced while reading
        for _ in range(30):
            yield b"x" * 1000
    r = httpx.post(server.url + "/v1/completions", content=chunked(), headers=server.headers())
    assert r.status_code == 413
    with pytest.raises(openai.APIStatusError) as e:
        server.client().completions.create(model="any", prompt="y" * 30000)
    assert e.value.status_code == 413


def test_waiting_queue_bound(server):
    client = server.client()
    model = client.models.list().data[0].id
    long = dict(model=model, prompt=[1, 2, 3], max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    running = client.completions.create(**long)
    next(iter(running))  # it is generating: it holds the only batch slot
    waiting = client.completions.create(**long)  # headers arrive once the engine has queued it
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
    assert e.value.status_code == 503 and "overloaded" in str(e.value)
    assert server.metrics()["nanovllm:num_requests_waiting"] == 1
    running.close()
    waiting.close()
    after = server.wait_idle()
    assert after["nanovllm:num_requests_running"] == 0 and after["nanovllm:kv_cache_usage_perc"] == 0
    out = client.completions.create(model=model, prompt="hi", max_tokens=1)
    assert out.usage.completion_tokens == 1


def test_sigterm_stops_the_server_promptly(server):
    client = server.client()
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    ended = {}

    def drain():
        try:
            for _ in stream:
                pass
            ended["how"] = "done"
        except Exception as e:  # the error event the server sends as it aborts the request
            ended["how"] = repr(e)
    reader = threading.Thread(target=drain)
    reader.start()
    children = descendants(server.proc.pid)
    assert children  # the engine runs in a process of its own
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(timeout=10)
    assert time.monotonic() - start < 5
    reader.join(5)
    assert "shutting down" in ended["how"]
    deadline = time.monotonic() + 2  # multiprocessing's resource tracker leaves as its pipe closes
    while (alive := [pid for pid in children if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, [open(f"/proc/{pid}/cmdline").read() for pid in alive]

