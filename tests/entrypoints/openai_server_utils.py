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
from prometheus_client.parser import text_string_to_metric_families

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
        return self.log_text()[-5000:]

    def log_text(self) -> str:
        """Everything the server wrote (stdout and stderr)."""
        self.log.flush()
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def rss_bytes(self) -> int:
        """Resident memory of the API process (the engine runs in a child of its own)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0,
                                  **kwargs)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics_text(self) -> str:
        return httpx.get(self.url + "/metrics", headers=self.headers(), timeout=10).text

    def metrics(self, engine: str = "0") -> dict[str, float]:
        """/metrics through prometheus_client's parser: {sample name: value} for the samples of
        one engine core, keyed with their other labels where they have some, e.g.
        'vllm:request_success_total{finished_reason="abort"}'."""
        return engine_samples(self.metrics_text(), engine)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """Engine 0's metrics once nothing runs, waits or holds KV blocks (aborts land asynchronously)."""
        return self.wait_all_idle(("0",), timeout)["0"]

    def wait_all_idle(self, engines=("0",), timeout: float = 10.0) -> dict[str, dict[str, float]]:
        """{engine: its metrics} once no engine core runs, queues or holds KV blocks."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.metrics_text()
            ms = {e: engine_samples(text, e) for e in engines}
            idle = all(m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
                       and m["vllm:kv_cache_usage_perc"] == 0 for m in ms.values())
            if idle or time.monotonic() > deadline:
                return ms
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the server (a drain, for SIGTERM) and return its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)
        return self.proc.returncode


def engine_samples(text: str, engine: str = "0") -> dict[str, float]:
    """One engine's samples of a /metrics text (see RemoteServer.metrics)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if labels.pop("engine", None) != engine:
                continue
            labels.pop("model_name", None)
            extra = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[f"{sample.name}{{{extra}}}" if extra else sample.name] = sample.value
    return out
