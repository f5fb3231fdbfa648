"""docs/scale-out.md's recipe on loopback (issue 42): two `nanovllm serve` replicas behind vllm-router
with its cache-aware policy, traffic through the router with the openai client; both replicas serve,
a repeated prefix stays on one replica, and after one replica is killed mid-run (SIGKILL) every new
request succeeds through the router. The replicas require an API key, which the router passes on."""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from openai_server_utils import TINY_ARGS, RemoteServer, engine_samples, free_port


def _router_missing() -> str | None:
    """Why vllm-router cannot run here, or None. Without its compiled core, vllm_router falls back to
    a debugging-only Python balancer, which is not what the recipe uses."""
    try:
        import vllm_router_rs  # noqa: F401
    except ImportError as e:
        return f"vllm-router is not installed or its wheel does not load here ({e}); it ships wheels for " \
               "Linux x86_64: pip install 'nanovllm[router]'"
    return None


_MISSING = _router_missing()
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))

SUCCESS = 'vllm:request_success_total{finished_reason="length"}'
KEY = "router-recipe-key"


class Router:
    def __init__(self, workers: list[str], policy: tuple[str, ...] = ("--policy", "cache_aware")):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-router-", suffix=".log", delete=False)
        # As docs/scale-out.md runs it, with readiness checks every second and a worker out after one
        # failure (the recipe: every 5 s, out after 2); its Prometheus exporter on a free loopback port
        # (its default port may be taken).
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", *workers, *policy, "--health-check-endpoint", "/ready",
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                output = self.output()
                self.stop()
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n{output}")
            try:
                # Up once it forwards to a worker (the key goes through to the replicas).
                if httpx.get(self.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                             timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        output = self.output()
        self.stop()
        raise RuntimeError(f"the router did not come up:\n{output}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()[-5000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)


def _start_replicas(argss: list[list[str]], api_key: str | None = None) -> list[RemoteServer]:
    """One `nanovllm serve` per argument list, loading together; all stopped if one fails to start."""
    with ThreadPoolExecutor(len(argss)) as pool:
        starting = [pool.submit(RemoteServer, args, api_key) for args in argss]
    if any(f.exception() for f in starting):
        for f in starting:
            if f.exception() is None:
                f.result().stop()
        raise next(f.exception() for f in starting if f.exception())
    return [f.result() for f in starting]


def test_two_replicas_behind_vllm_router_survive_losing_one(model_factory):
    # The replicas want an API key: the router forwards the client's, and polls /ready without one.
    args = [model_factory("qwen3"), *TINY_ARGS, "--served-model-name", "tiny", "--api-key", KEY]
    replicas = _start_replicas([args, args], KEY)
    router = None
    try:
        router = Router([r.url for r in replicas])
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0,
                                             timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="wrong").completions.create(model="tiny", prompt="hi", max_tokens=1)
        before = [r.metrics() for r in replicas]

        # Distinct prompts at once (nothing shared at their starts, which the policy would keep together):
        # it balances them over both replicas.
        words = ["apple", "zebra", "quartz", "mango", "violet", "kernel", "harbor", "jungle"]

        def ask(i: int):
            return client.completions.create(model="tiny", prompt=f"{words[i]} {i} says hello", max_tokens=4,
                                             extra_body={"ignore_eos": True})
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        served = [r.metrics()[SUCCESS] - b[SUCCESS] for r, b in zip(replicas, before)]
        assert sum(served) == 8 and min(served) >= 1, served

        # A long shared prefix, one request at a time: the cache-aware policy keeps it on one replica.
        prefix = "The quick brown fox jumps over the lazy dog. " * 12
        middle = [r.metrics() for r in replicas]
        for i in range(4):
            client.completions.create(model="tiny", prompt=prefix + f"Question {i}?", max_tokens=2)
        served = sorted(r.metrics()[SUCCESS] - m[SUCCESS] for r, m in zip(replicas, middle))
        assert served == [0, 4], served

        # Traffic runs while one replica is killed: requests in flight on it may fail; none hangs.
        results, stop = [], threading.Event()

        def traffic():
            while not stop.is_set() and len(results) < 200:
                try:
                    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                            max_tokens=8, stream=True)
                    results.append(sum(1 for _ in stream) > 0)
                except Exception:  # noqa: BLE001 - a request caught by the kill
                    results.append(False)
        runners = [threading.Thread(target=traffic) for _ in range(3)]
        for t in runners:
            t.start()
        while len(results) < 6:
            time.sleep(0.05)
        replicas[1].proc.send_signal(signal.SIGKILL)
        replicas[1].proc.wait(10)
        time.sleep(2.0)  # the router's health check (every second) takes the replica out
        stop.set()
        for t in runners:
            t.join(60)
        assert not any(t.is_alive() for t in runners)

        # Afterwards every new request succeeds through the router, on the survivor.
        survivor_before = replicas[0].metrics()[SUCCESS]
        for i in range(10):
            if i % 2:
                out = client.completions.create(model="tiny", prompt=f"after the loss {i}", max_tokens=3,
                                                extra_body={"ignore_eos": True})
                assert out.usage.completion_tokens == 3
            else:
                chunks = list(client.chat.completions.create(model="tiny", max_tokens=3, stream=True,
                                                             messages=[{"role": "user", "content": f"again {i}"}],
                                                             extra_body={"ignore_eos": True}))
                assert chunks[-1].choices[0].finish_reason == "length"
        assert engine_samples(replicas[0].metrics_text())[SUCCESS] - survivor_before == 10
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()


def test_kv_aware_routing_by_the_replicas_kv_events(model_factory):
    """vllm-router's kv_aware policy fed by the replicas' KV events (`--kv-events-endpoint`, vLLM's map
    format) and their /tokenize: a prompt whose prefix one replica holds goes to that replica, whatever
    the load says."""
    pytest.importorskip("zmq", reason="KV events need pyzmq: pip install 'nanovllm[kv_events]'")
    pytest.importorskip("msgspec", reason="KV events need msgspec: pip install 'nanovllm[kv_events]'")
    ports = [free_port(), free_port()]
    args = [model_factory("qwen3"), *TINY_ARGS, "--served-model-name", "tiny", "--kvcache-block-size", "16",
            "--kv-events-format", "map"]
    replicas = _start_replicas([[*args, "--kv-events-endpoint", f"tcp://*:{p}"] for p in ports])
    router = None
    try:
        sources = [arg for r, p in zip(replicas, ports) for arg in ("--kv-event-source", f"{r.url}=tcp://127.0.0.1:{p}")]
        router = Router([r.url for r in replicas], ("--policy", "kv_aware", *sources, "--kv-event-block-size", "16",
                                                    "--kv-event-model", "tiny"))
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        prompts = ["The quick brown fox jumps over the lazy dog. " * 12,
                   "Pack my box with five dozen liquor jugs, said the sphinx. " * 10]
        # Each replica primed with one prefix, straight (prompt i on replica 1 - i: not where load would go).
        for i, prompt in enumerate(prompts):
            replicas[1 - i].client().completions.create(model="tiny", prompt=prompt + "Primer?", max_tokens=1)
        time.sleep(1.0)  # the events reach the router
        # Each prompt twice in a row: neither alternation nor a constant choice would pass.
        for i, attempt in ((0, 0), (0, 1), (1, 0), (1, 1)):
            before = [r.metrics() for r in replicas]
            client.completions.create(model="tiny", prompt=prompts[i] + f"Routed {attempt}?", max_tokens=1)
            served = [r.metrics()[SUCCESS] - b[SUCCESS] for r, b in zip(replicas, before)]
            assert served[1 - i] == 1, (i, attempt, served, router.output())
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
