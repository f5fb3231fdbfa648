"""A real `python -m nanovllm serve` process on 127.0.0.1 and the official openai client against it."""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_ARGS = ["--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "64"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    def __init__(self, args: list[str], api_key: str | None = None, startup_timeout: float = 180.0):
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        # Output to a file, not a pipe: a full pipe would block the server.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="nanovllm-serve-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("NANOVLLM_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm", "serve", *args, "--host", "127.0.0.1",
                                      "--port", str(self.port), "--log-level", "warning"],
                                     cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-5000:]

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  **kwargs)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[str, float]:
        """{'metric_name{labels}': value}, and {'metric_name': value} for label-less lookups of
        samples that carry only the model_name label."""
        text = httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
                name, _, labels = key.partition("{")
                if labels.count("=") == 1:
                    out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Metrics once nothing runs, waits or holds KV blocks (aborts land asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["nanovllm:num_requests_running"] == 0 and m["nanovllm:num_requests_waiting"] == 0
                    and m["nanovllm:kv_cache_usage_perc"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.log.name)

