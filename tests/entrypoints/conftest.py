"""Server processes shared per session: starting one costs seconds (imports, model load)."""
import pytest

from openai_server_utils import TINY_ARGS, RemoteServer


@pytest.fixture(scope="session")
def tiny_server(model_factory):
    server = RemoteServer([model_factory("qwen3"), *TINY_ARGS])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def smol_server():
    """The embedded default model (no MODEL argument), with a small KV cache."""
    server = RemoteServer(["--device", "cpu", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(128 << 20)])
    yield server
    server.stop()
