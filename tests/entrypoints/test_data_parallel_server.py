"""`nanovllm serve --data-parallel-size 2` on the CPU, through the official openai client (issue 42):
both cores serve, repeated prefixes land on one core, per-core metrics (prometheus_client's parser)
add up, streams cancelled on both cores leak no KV blocks, both cores publish KV-cache events to a
ZMQ subscriber in vLLM's format, and SIGTERM drains streams in flight on both cores (exit 0).

One server for the module; the drain ends it, so it comes last."""
import asyncio
import json
import random
import signal
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import descendants, running
from openai_server_utils import RemoteServer, free_port

try:
    import msgspec
    import zmq
except ImportError:  # the server runs without KV events then, and their test skips
    zmq = msgspec = None

BLOCK = 16
SUCCESS = 'vllm:request_success_total{finished_reason="%s"}'
ENGINES = ("0", "1")


class Subscribers:
    """A ZMQ SUB socket bound per core (the server's cores connect: tcp://127.0.0.1:PORT+rank), each
    read on a thread of its own. It must keep polling: a ZMQ socket takes in a new connection (and
    sends it its subscription) only when its thread calls into it, and a PUB drops what it publishes
    to a peer whose subscription has not arrived."""

    def __init__(self):
        self.context = zmq.Context()
        self.received = {0: [], 1: []}
        self._stop = threading.Event()
        for _ in range(20):
            port = free_port()
            socks = []
            try:
                for rank in range(2):
                    sock = self.context.socket(zmq.SUB)
                    socks.append(sock)
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                    sock.bind(f"tcp://127.0.0.1:{port + rank}")
            except zmq.ZMQError:
                for sock in socks:
                    sock.close(0)
                continue
            self.port = port
            self._threads = [threading.Thread(target=self._read, args=(rank, sock), daemon=True)
                             for rank, sock in enumerate(socks)]
            for t in self._threads:
                t.start()
            return
        raise RuntimeError("no two free ports in a row")

    def _read(self, rank: int, sock):
        while not self._stop.is_set():
            if sock.poll(50):
                topic, seq, payload = sock.recv_multipart()
                self.received[rank].append((topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
        sock.close(0)

    def close(self):
        self._stop.set()
        for t in self._threads:
            t.join(5)
        self.context.term()


@pytest.fixture(scope="module")
def subscribers():
    if zmq is None:
        yield None
        return
    subs = Subscribers()
    yield subs
    subs.close()


@pytest.fixture(scope="module")
def dp_server(model_factory, subscribers):
    # A small KV cache (2048 tokens per core, blocks of 16), so that the KV-events test sees evictions.
    args = [model_factory("qwen3"), "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "32",
            "--data-parallel-size", "2", "--kvcache-block-size", str(BLOCK), "--kv-cache-memory-bytes", str(2 << 20),
            "--shutdown-timeout", "60"]
    if subscribers is not None:
        args += ["--kv-events-endpoint", f"tcp://127.0.0.1:{subscribers.port}", "--kv-events-topic", "kv@test"]
    server = RemoteServer(args)
    server.model = server.client().models.list().data[0].id
    yield server
    server.stop()


def _all_metrics(server) -> dict[str, dict[str, float]]:
    return server.wait_all_idle(ENGINES, timeout=30)


def _delta(after, before, engine, key):
    return after[engine].get(key, 0.0) - before[engine].get(key, 0.0)


def test_health_lists_both_cores(dp_server):
    r = httpx.get(dp_server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "engines": [{"engine": "0", "status": "ok"},
                                                                            {"engine": "1", "status": "ok"}]}
    assert httpx.get(dp_server.url + "/ready").json() == {"status": "ready"}


def test_both_cores_serve_and_the_metrics_add_up(dp_server):
    before = _all_metrics(dp_server)

    async def main():
        client = dp_server.async_client(timeout=120)
        try:
            return await asyncio.gather(*(client.completions.create(
                model=dp_server.model, prompt=[10 + i, 20, 30 + i], max_tokens=5, extra_body={"ignore_eos": True})
                for i in range(8)))
        finally:
            await client.close()
    outs = asyncio.run(main())
    assert all(o.usage.completion_tokens == 5 for o in outs)
    after = _all_metrics(dp_server)
    served = [_delta(after, before, e, SUCCESS % "length") for e in ENGINES]
    assert min(served) >= 2 and sum(served) == 8, served  # balanced by load: both take a share
    assert sum(_delta(after, before, e, "vllm:generation_tokens_total") for e in ENGINES) == 8 * 5
    assert sum(_delta(after, before, e, "vllm:prompt_tokens_total") for e in ENGINES) == 8 * 3
    assert sum(_delta(after, before, e, "vllm:e2e_request_latency_seconds_count") for e in ENGINES) == 8
    # Every series of every family exists once per core, with both labels.
    for family in text_string_to_metric_families(dp_server.metrics_text()):
        if family.name.startswith("vllm:"):
            engines = {s.labels["engine"] for s in family.samples}
            assert engines == set(ENGINES), family.name
            assert {s.labels["model_name"] for s in family.samples} == {dp_server.model}


def test_repeated_prefixes_land_on_one_core(dp_server):
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(300)]
    before = _all_metrics(dp_server)
    client = dp_server.client()
    for i in range(5):
        suffix = [rng.randrange(3, 500) for _ in range(20)]
        client.completions.create(model=dp_server.model, prompt=system + suffix, max_tokens=2,
                                  extra_body={"ignore_eos": True})
    after = _all_metrics(dp_server)
    served = {e: _delta(after, before, e, SUCCESS % "length") for e in ENGINES}
    assert sorted(served.values()) == [0, 5], served
    core = max(served, key=served.get)
    # The four later requests found the prefix's full blocks (18 of 16 tokens) in that core's cache.
    assert _delta(after, before, core, "vllm:prefix_cache_hits_total") >= 4 * (300 // BLOCK) * BLOCK


def test_streams_cancelled_on_both_cores_leak_no_blocks(dp_server):
    before = _all_metrics(dp_server)

    async def one(client, i: int, cancel: bool):
        stream = await client.completions.create(model=dp_server.model, prompt=[5 + i, 6, 7], stream=True,
                                                 max_tokens=400 if cancel else 12, extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True})
        chunks, usage = 0, None
        async for chunk in stream:
            chunks += 1
            usage = chunk.usage or usage
            if cancel and chunks == 3:
                await stream.close()  # the client goes away mid-generation
                return "cancelled"
        return usage.completion_tokens

    async def main():
        client = dp_server.async_client(timeout=120)
        try:
            return await asyncio.gather(*(one(client, i, i % 4 < 2) for i in range(16)))
        finally:
            await client.close()
    results = asyncio.run(main())
    assert results.count("cancelled") == 8 and all(r == 12 for r in results if r != "cancelled")
    after = _all_metrics(dp_server)
    for e in ENGINES:  # idle, and no KV block held on either core
        assert after[e]["vllm:kv_cache_usage_perc"] == 0 and after[e]["vllm:num_requests_running"] == 0
    aborted = [_delta(after, before, e, SUCCESS % "abort") for e in ENGINES]
    assert sum(aborted) == 8 and min(aborted) >= 1, aborted  # both cores had streams cancelled
    assert sum(_delta(after, before, e, SUCCESS % "length") for e in ENGINES) == 8


def test_both_cores_publish_kv_events(dp_server, subscribers):
    if subscribers is None:
        pytest.skip("KV events need pyzmq and msgspec (pip install 'nanovllm[kv_events]')")
    # Distinct prompts, more than both caches hold together: blocks are stored, then evicted.
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(400)] for _ in range(24)]

    async def main():
        client = dp_server.async_client(timeout=120)
        try:
            # Two tokens: a block is shared once the step that computed it has its results in, and a
            # sequence that ends at its first token is gone by then.
            await asyncio.gather(*(client.completions.create(model=dp_server.model, prompt=p, max_tokens=2)
                                   for p in prompts))
        finally:
            await client.close()
    asyncio.run(main())
    _all_metrics(dp_server)
    deadline = time.monotonic() + 10
    received = subscribers.received
    stored_blocks = {}  # hash -> tokens, over both cores
    while time.monotonic() < deadline:
        kinds = {rank: {e[0] for _, _, (_, events, _) in list(msgs) for e in events}
                 for rank, msgs in received.items()}
        if all({"BlockStored", "BlockRemoved"} <= k for k in kinds.values()):
            break
        time.sleep(0.1)
    for rank, msgs in received.items():
        assert msgs, f"nothing from core {rank}"
        seqs = [seq for _, seq, _ in msgs]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # in order, none lost
        for topic, _, batch in msgs:
            ts, events, dp_rank = batch
            assert topic == b"kv@test" and dp_rank == rank and abs(ts - time.time()) < 600
            for event in events:
                if event[0] == "BlockStored":
                    _, hashes, parent, tokens, block_size, lora_id, medium = event
                    assert block_size == BLOCK and len(tokens) == BLOCK * len(hashes) and lora_id is None
                    assert medium == "CPU" and (parent is None or isinstance(parent, int))
                    for i, h in enumerate(hashes):
                        stored_blocks[h] = tokens[i * BLOCK:(i + 1) * BLOCK]
                elif event[0] == "BlockRemoved":
                    assert event[2] == "CPU" and event[1]
                else:
                    assert event == ["AllBlocksCleared"]
        assert {"BlockStored", "BlockRemoved"} <= kinds[rank], kinds
    # The blocks of each prompt were announced with its tokens.
    announced = {tuple(t) for t in stored_blocks.values()}
    assert sum(tuple(p[:BLOCK]) in announced for p in prompts) == len(prompts)


def _stream(url: str, body: dict, out: dict, started: threading.Event):
    """Reads one stream to its end. Lines split at LF only (SSE's rule): the text of a random model
    holds characters (U+2028, U+0085) that str.splitlines, and so httpx's iter_lines, break at."""
    chunks, done, buffer = [], False, b""
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        out["status"] = r.status_code
        for data in r.iter_bytes():
            *lines, buffer = (buffer + data).split(b"\n")
            for line in lines:
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    chunks.append(json.loads(line[6:]))
                    if any(c.get("text") for c in chunks[-1].get("choices", [])):
                        started.set()
    out["chunks"], out["done"] = chunks, done


def test_sigterm_drains_streams_on_both_cores_then_exits_0(dp_server):
    """Last: it ends the module's server."""
    url = dp_server.url + "/v1/completions"
    bodies = [{"model": dp_server.model, "prompt": [40 + i, 41], "max_tokens": 300, "stream": True,
               "ignore_eos": True} for i in range(6)]
    outs = [{} for _ in bodies]
    starts = [threading.Event() for _ in bodies]
    threads = [threading.Thread(target=_stream, args=(url, b, o, s)) for b, o, s in zip(bodies, outs, starts)]
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in starts)
    text = dp_server.metrics_text()
    from openai_server_utils import engine_samples
    assert all(engine_samples(text, e)["vllm:num_requests_running"] > 0 for e in ENGINES)  # both cores busy
    children = descendants(dp_server.proc.pid)
    assert len(children) >= 2
    dp_server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(url, json={"model": dp_server.model, "prompt": [1], "max_tokens": 1}, timeout=10)
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
    assert httpx.get(dp_server.url + "/ready", timeout=10).status_code == 503
    for t in threads:
        t.join(90)
    for out in outs:  # every stream finished as it would have: all its tokens, then [DONE]
        assert out["status"] == 200 and out["done"], out
        reasons = [c["finish_reason"] for chunk in out["chunks"] for c in chunk["choices"] if c.get("finish_reason")]
        assert reasons == ["length"], out["chunks"][-2:]
    assert dp_server.proc.wait(30) == 0
    assert "Traceback" not in dp_server.log_text()
    deadline = time.monotonic() + 5
    while (alive := [pid for pid in children if running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive
