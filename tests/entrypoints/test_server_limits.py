"""API key, body-size bound, waiting-queue bound, timeouts and the connection cap, on one server of
their own (one sequence at a time, three waiting, one-second timeouts)."""
import asyncio
import socket
import time

import httpx
import openai
import pytest

from openai_server_utils import TINY_ARGS, RemoteServer

KEY = "s3cret-key"
MAX_WAITING = 3
TIMEOUT_S = 1.0
LIMIT_CONCURRENCY = 12


@pytest.fixture(scope="module")
def server(model_factory):
    args = [model_factory("qwen3"), *TINY_ARGS, "--api-key", KEY, "--max-body-bytes", "20000",
            "--max-num-seqs", "1", "--max-waiting", str(MAX_WAITING), "--timeout-header", str(TIMEOUT_S),
            "--timeout-body", str(TIMEOUT_S), "--timeout-keep-alive", str(TIMEOUT_S),
            "--limit-concurrency", str(LIMIT_CONCURRENCY)]
    s = RemoteServer(args, api_key=KEY)
    yield s
    log = s.log_text()
    start = time.monotonic()
    assert s.stop() == 0 and time.monotonic() - start < 5  # SIGTERM, nothing in flight: at once, status 0
    assert "Traceback" not in log, log[-3000:]  # not for any of the client errors below


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


def test_bursts_up_to_the_waiting_bound_are_all_served(server):
    """With at most MAX_WAITING requests in existence none may be refused, however they arrive
    (issue 38: the check counted requests twice, engine-side and as not yet acknowledged)."""
    model = server.client().models.list().data[0].id

    async def burst(client):
        return await asyncio.gather(*(client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2)
                                      for _ in range(MAX_WAITING)), return_exceptions=True)

    async def main():
        client = server.async_client(timeout=60)
        try:
            return [r for _ in range(6) for r in await burst(client)]
        finally:
            await client.close()
    results = asyncio.run(main())
    assert [r for r in results if isinstance(r, BaseException)] == []


def test_waiting_queue_bound(server):
    client = server.client()
    model = client.models.list().data[0].id
    long = dict(model=model, prompt=[1, 2, 3], max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    running = client.completions.create(**long)
    next(iter(running))  # it is generating: it holds the only batch slot
    waiting = [client.completions.create(**long) for _ in range(MAX_WAITING)]  # headers come once queued
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
    # The count is true: exactly the ones waiting.
    assert e.value.status_code == 503 and f"{MAX_WAITING} requests are already waiting" in str(e.value)
    assert int(e.value.response.headers["retry-after"]) > 0
    assert server.metrics()["vllm:num_requests_waiting"] == MAX_WAITING
    running.close()
    for w in waiting:
        w.close()
    after = server.wait_idle()
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    out = client.completions.create(model=model, prompt="hi", max_tokens=1)
    assert out.usage.completion_tokens == 1


def test_a_request_that_can_never_be_queued_is_a_400(server):
    """More prompts in one request than the server ever queues: 400 naming the limit (a 503 would
    have the OpenAI client retry it for nothing)."""
    client = server.client()
    model = client.models.list().data[0].id
    for prompts in ([[1, 2]] * (MAX_WAITING + 1), ["hi"] * 2000):
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=prompts, max_tokens=1)
        assert f"the limit is {MAX_WAITING}, --max-waiting" in str(e.value) and e.value.body["param"] == "prompt"
        assert time.monotonic() - start < 5


def _wait_for_idle_connections_to_close(server):
    """Earlier tests' clients leave keep-alive connections that count against --limit-concurrency
    until the server closes them, --timeout-keep-alive after their last request: wait for /health."""
    deadline = time.monotonic() + TIMEOUT_S + 5
    while (r := httpx.get(server.url + "/health", timeout=5, headers={"Connection": "close"})).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)
    time.sleep(TIMEOUT_S + 0.2)


def _connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed the connection within `seconds`, what it sent first)."""
    sock.settimeout(0.1)
    deadline, received = time.monotonic() + seconds, b""
    while time.monotonic() < deadline:
        try:
            data = sock.recv(4096)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return True, received
        if not data:
            return True, received
        received += data
    return False, received


def test_slow_request_heads_are_cut_off(server):
    """slowloris: request heads sent a byte at a time, and connections that send nothing, are closed
    once the header timeout has passed; meanwhile the server answers others."""
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
    _wait_for_idle_connections_to_close(server)
    silent = [_connect(server) for _ in range(3)]
    dribbling = [_connect(server) for _ in range(5)]
    start = time.monotonic()
    for i in range(10):  # half the timeout; then nothing (bytes sent after it would meet a reset)
        for sock in dribbling:
            sock.send(head[i:i + 1])
        time.sleep(TIMEOUT_S / 20)
    r = httpx.get(server.url + "/health", timeout=2)
    assert r.status_code == 200, r.text
    for sock in dribbling + silent:
        closed, received = _closed_within(sock, TIMEOUT_S + 2 - (time.monotonic() - start))
        assert closed, "a connection outlived the header timeout"
        if sock in dribbling:
            assert received.startswith(b"HTTP/1.1 408"), received
        sock.close()
    assert time.monotonic() - start < TIMEOUT_S + 2.5


def test_a_body_shorter_than_its_length_gets_408(server):
    sock = _connect(server)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                 "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ".encode())
    start = time.monotonic()
    closed, received = _closed_within(sock, TIMEOUT_S + 3)
    sock.close()
    assert closed and time.monotonic() - start < TIMEOUT_S + 2
    assert received.startswith(b"HTTP/1.1 408") and b"request_timeout" in received, received


def test_connections_beyond_the_limit_get_503_until_some_close(server):
    _wait_for_idle_connections_to_close(server)
    idle = [_connect(server) for _ in range(LIMIT_CONCURRENCY)]
    time.sleep(0.2)
    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 503
    for sock in idle:
        sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(server.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
