"""SIGTERM drains the server (issues 38 and 42): new requests get 503 with Retry-After and /health
turns 503, requests in flight finish; what still runs after --shutdown-timeout ends with its final
chunks (finish_reason "abort", usage when asked) and [DONE]; the process exits 0, its engine with it.

The long requests (8000 tokens, on a copy of the tiny model that allows 8192 positions) cannot
finish within the timeout on a CPU: the tiny model takes well over 1 ms a step there (1000 tokens
once did finish in time on a fast CI machine)."""
import json
import signal
import threading
import time

import httpx

from helpers import descendants, long_context_copy, running
from openai_server_utils import TINY_ARGS, RemoteServer

SHUTDOWN_TIMEOUT_S = 4.0
LONG = 8000  # tokens of each long request


def _sse(url: str, body: dict, out: dict, started: threading.Event):
    """Reads one stream to its end: the parsed chunks, whether it ended with [DONE], its status."""
    chunks, done = [], False
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[len("data: "):]))
            if any(c.get("text") or (c.get("delta") or {}).get("content") for c in chunks[-1].get("choices", [])):
                started.set()
    out["chunks"], out["done"] = chunks, done


def _finish_reasons(chunks: list[dict]) -> dict[int, str]:
    return {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")}


def test_sigterm_drains_then_exits_0(model_factory, tmp_path):
    model_dir = long_context_copy(model_factory("qwen3"), str(tmp_path / "qwen3-8k"))
    server = RemoteServer([model_dir, *TINY_ARGS, "--max-num-seqs", "8", "--max-model-len", "8192",
                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    try:
        model = server.client().models.list().data[0].id
        base = {"model": model, "temperature": 0.0, "ignore_eos": True}
        cmpl, chat = server.url + "/v1/completions", server.url + "/v1/chat/completions"
        long_requests = [
            (cmpl, {**base, "prompt": [1, 2, 3], "max_tokens": LONG, "stream": True,
                    "stream_options": {"include_usage": True}}),
            (chat, {**base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG, "stream": True,
                    "stream_options": {"include_usage": True}}),
            (cmpl, {**base, "prompt": [4, 5, 6], "max_tokens": LONG, "n": 2, "stream": True}),
        ]
        outs = [{} for _ in long_requests]
        starts = [threading.Event() for _ in long_requests]
        readers = [threading.Thread(target=_sse, args=(url, body, out, started))
                   for (url, body), out, started in zip(long_requests, outs, starts)]
        whole = {}
        readers.append(threading.Thread(target=lambda: whole.update(response=httpx.post(
            cmpl, json={**base, "prompt": [7, 8], "max_tokens": LONG}, timeout=60))))
        for t in readers:
            t.start()
        assert all(s.wait(60) for s in starts)  # all are generating
        short_out, short_started = {}, threading.Event()
        short = threading.Thread(target=_sse, args=(cmpl, {**base, "prompt": [9], "max_tokens": 4, "stream": True},
                                                    short_out, short_started))
        short.start()
        assert short_started.wait(60)  # in flight
        children = descendants(server.proc.pid)
        assert children  # the engine runs in a process of its own
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Draining: new requests are refused with a hint to retry, probes say so, metrics still answer.
        refused = httpx.post(cmpl, json={**base, "prompt": [1], "max_tokens": 1}, timeout=10)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
        # The short request in flight finishes as usual.
        short.join(30)
        assert short_out["done"] and _finish_reasons(short_out["chunks"]) == {0: "length"}, short_out
        for t in readers:
            t.join(SHUTDOWN_TIMEOUT_S + 30)
        ended = time.monotonic() - start
        # The long ones were cut at the timeout: final chunks, usage where asked, [DONE].
        for (_, body), out in zip(long_requests, outs):
            assert out["status"] == 200 and out["done"], out
            n = body.get("n", 1)
            assert _finish_reasons(out["chunks"]) == {i: "abort" for i in range(n)}
            assert not any("error" in chunk for chunk in out["chunks"])
            if body.get("stream_options"):
                usage = out["chunks"][-1]["usage"]
                assert out["chunks"][-1]["choices"] == [] and 0 < usage["completion_tokens"] < LONG
        r = whole["response"]
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort"
        assert 0 < r.json()["usage"]["completion_tokens"] < LONG and r.json()["choices"][0]["text"]
        assert SHUTDOWN_TIMEOUT_S - 0.5 < ended < SHUTDOWN_TIMEOUT_S + 10
        assert server.proc.wait(15) == 0
        log = server.log_text()
        assert "Traceback" not in log, log[-3000:]
        deadline = time.monotonic() + 5  # multiprocessing's resource tracker leaves as its pipe closes
        while (alive := [pid for pid in children if running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, [open(f"/proc/{pid}/cmdline").read() for pid in alive]
    finally:
        server.stop()

