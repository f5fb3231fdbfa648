"""An engine core of a `--data-parallel-size 2` server killed with SIGKILL mid-load (issue 42): its
requests end at once with an error naming the failure (HTTP 500, or a final SSE error event), the
other core's requests finish, new requests all succeed on the survivor, /health says 200 "degraded"
and which core is down, /ready stays 200, the log says which core died and why; then the server
itself killed with SIGKILL while the survivor is busy leaves no process behind."""
import json
import os
import signal
import threading
import time

import httpx

from helpers import descendants, long_context_copy, running
from openai_server_utils import RemoteServer, engine_samples


def _engine_pids(server_pid: int) -> list[int]:
    """The server's engine processes (multiprocessing's resource tracker is a child too)."""
    pids = []
    for pid in descendants(server_pid):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            pids.append(pid)
    return pids


def _request(url: str, body: dict, out: dict, started: threading.Event):
    """One request to its end: status, SSE events (lines split at LF only), or the JSON body."""
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        out["status"] = r.status_code
        if not body.get("stream"):
            out["body"] = json.loads(r.read())
            return
        events, buffer = [], b""
        for data in r.iter_bytes():
            *lines, buffer = (buffer + data).split(b"\n")
            for line in lines:
                if line.startswith(b"data: "):
                    events.append(line[6:].decode())
                    if len(events) == 2:  # the first chunk with text came
                        started.set()
        out["events"] = events


LOAD = 2000  # tokens of each request of the load: still running when the metrics are read, on any machine


def test_a_killed_core_fails_only_its_requests_and_nothing_outlives_the_server(model_factory, tmp_path):
    model_dir = long_context_copy(model_factory("qwen3"), str(tmp_path / "qwen3-4k"), 4096)
    server = RemoteServer([model_dir, "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "16",
                           "--kv-cache-memory-bytes", str(16 << 20), "--data-parallel-size", "2"])
    try:
        model = server.client().models.list().data[0].id
        url = server.url + "/v1/completions"
        base = {"model": model, "max_tokens": LOAD, "ignore_eos": True}
        bodies = [{**base, "prompt": [3 + i, 4, 5], "stream": i % 3 != 2} for i in range(8)]
        outs = [{} for _ in bodies]
        starts = [threading.Event() for _ in bodies]
        threads = [threading.Thread(target=_request, args=(url, b, o, s)) for b, o, s in zip(bodies, outs, starts)]
        for t in threads:
            t.start()
        assert all(s.wait(60) for b, s in zip(bodies, starts) if b["stream"])
        deadline = time.monotonic() + 30
        while True:  # every request is generating, on both cores
            text = server.metrics_text()
            running_now = [engine_samples(text, e)["vllm:num_requests_running"] for e in ("0", "1")]
            if sum(running_now) == len(bodies) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert min(running_now) > 0 and sum(running_now) == len(bodies), running_now
        engines = _engine_pids(server.proc.pid)
        assert len(engines) == 2
        os.kill(engines[0], signal.SIGKILL)
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)

        failed = ok = 0
        for body, out in zip(bodies, outs):
            if body["stream"]:
                assert out["status"] == 200 and out["events"][-1] == "[DONE]", out
                last = json.loads(out["events"][-2])
                if "error" in last:  # on the killed core: its final chunks, then the error
                    failed += 1
                    assert "killed by signal SIGKILL" in last["error"]["message"], last
                else:
                    ok += 1
                    reasons = [c["finish_reason"] for e in out["events"][:-1] for c in json.loads(e)["choices"]
                               if c.get("finish_reason")]
                    assert reasons == ["length"]
            elif out["status"] == 500:
                failed += 1
                assert "killed by signal SIGKILL" in out["body"]["error"]["message"], out
            else:
                ok += 1
                assert out["status"] == 200 and out["body"]["usage"]["completion_tokens"] == LOAD
        assert failed >= 1 and ok >= 1 and failed + ok == len(bodies), (failed, ok)

        # The survivor serves every new request; the probes say what happened.
        client = server.client(timeout=60)
        for i in range(6):
            out = client.completions.create(model=model, prompt=[7, 8, i], max_tokens=3, extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 3
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        down = [e for e in health.json()["engines"] if e["status"] == "down"]
        assert len(down) == 1 and "killed by signal SIGKILL" in down[0]["reason"]
        assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
        dead = engine_samples(server.metrics_text(), down[0]["engine"])
        assert dead["vllm:num_requests_running"] == 0 and dead["vllm:kv_cache_usage_perc"] == 0
        log = server.log_text()
        assert f"engine core {down[0]['engine']} stopped serving" in log and "SIGKILL" in log, log[-2000:]

        # The server killed outright while the survivor generates: nothing it started lives on.
        more = [threading.Thread(target=_request, args=(url, {**base, "prompt": [9, i], "max_tokens": 2000,
                                                              "stream": True}, {}, threading.Event()))
                for i in range(3)]
        for t in more:
            t.start()
        time.sleep(1.0)
        left = descendants(server.proc.pid)
        assert left
        server.proc.kill()
        server.proc.wait(10)
        deadline = time.monotonic() + 10
        while (alive := [pid for pid in left if running(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive, [open(f"/proc/{pid}/cmdline").read() for pid in alive]
        for t in more:
            t.join(30)
    finally:
        server.stop()
