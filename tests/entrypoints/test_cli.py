"""The `nanovllm` command line, run as a real process (`python -m nanovllm`)."""
import subprocess
import sys

import pytest


def _run(args, smollm_dir, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "nanovllm", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_prints_a_completion(smollm_dir):
    r = _run(["generate", "What is the capital of France?", "--chat", "--temperature", "0", "--max-tokens", "24",
              "--dtype", "float32"], smollm_dir)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_with_an_explicit_model(smollm_dir):
    r = _run(["generate", "Once upon a time", "--model", smollm_dir, "--max-tokens", "8", "--seed", "1"], smollm_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_generate_over_two_ranks_matches_one(model_factory, smollm_dir):
    args = ["generate", "hello world", "--model", model_factory("qwen3"), "--device", "cpu", "--dtype", "float32",
            "--temperature", "0", "--max-tokens", "6"]
    one, two = _run(args, smollm_dir), _run([*args, "-tp", "2"], smollm_dir)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout


def test_generate_with_an_fp8_kv_cache(smollm_dir):
    """The flag reaches the engine (its start-up log says so). The embedded SmolLM2-135M's answer here
    changes with K/V at e4m3 precision (to the same text as an fp32 cache holding e4m3-rounded K/V):
    tests/models/test_fp8.py checks the cache's arithmetic exactly."""
    r = _run(["generate", "What is the capital of France?", "--chat", "--temperature", "0", "--max-tokens", "8",
              "--dtype", "float32", "--kv-cache-dtype", "fp8"], smollm_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "kv_cache_dtype=fp8 (torch.float8_e4m3fn: 4x the tokens" in r.stderr


def test_serve_passes_the_fp8_options_to_the_engine(model_factory):
    import argparse

    from nanovllm.entrypoints.openai.api_server import add_serve_arguments, engine_config
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    path = model_factory("qwen3")
    config = engine_config(parser.parse_args([path, "--kv-cache-dtype", "fp8", "--device", "cpu"]))
    assert config.kv_cache_dtype == "fp8" and config.quantization is None
    # Block FP8 needs projections that fill 128x128 blocks: this tiny model's do not, and says so.
    with pytest.raises(ValueError, match="is not a multiple of 128"):
        engine_config(parser.parse_args([path, "--quantization", "fp8", "--device", "cpu"]))


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required"),
    (["generate"], "the following arguments are required: prompt"),
    (["generate", "hi", "--max-tokens", "many"], "invalid int value"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be a number in [0, 100]"),
    (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
    (["generate", "hi", "-tp", "0"], "tensor_parallel_size must be an integer >= 1"),
    (["generate", "hi", "--kv-cache-dtype", "int8"], "kv_cache_dtype must be one of"),
    (["translate", "hi"], "invalid choice"),
    (["serve", "--timeout-header", "0"], "--timeout-header must be a number of seconds > 0"),
])
def test_bad_arguments_exit_nonzero_with_usage(args, message, smollm_dir):
    r = _run(args, smollm_dir, timeout=120)
    assert r.returncode == 2
    assert "usage: nanovllm" in r.stderr and message in r.stderr, r.stderr


def test_interactive_chat_keeps_the_conversation(smollm_dir):
    r = _run(["chat", "--temperature", "0", "--max-tokens", "16"], smollm_dir,
             stdin="What is the capital of France?\nAnd of Germany?\n\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(">>> ") >= 2 and "Paris" in r.stdout


def test_serve_freezes_its_startup_heap(model_factory, monkeypatch):
    """`nanovllm serve` freezes what exists once the engine and the app are up: a full collection
    under load then walks the requests' objects only, not the libraries' (a 70-80 ms event-loop
    pause each, BENCHMARKS.md)."""
    import argparse
    import gc

    from nanovllm.entrypoints.openai import api_server, http_server
    frozen = []
    monkeypatch.setattr(http_server.Server, "run", lambda self: frozen.append(gc.get_freeze_count()))
    parser = argparse.ArgumentParser()
    api_server.add_serve_arguments(parser)
    gc.unfreeze()
    try:
        assert api_server.run_server(parser.parse_args([model_factory("qwen3"), "--device", "cpu", "--port", "0"])) == 0
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000  # FastAPI, pydantic, the tokenizer...
