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


@pytest.mark.parametrize("args, message", [
    ([], "the following arguments are required"),
    (["generate"], "the following arguments are required: prompt"),
    (["generate", "hi", "--max-tokens", "many"], "invalid int value"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be a number in [0, 100]"),
    (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
    (["generate", "hi", "-tp", "0"], "tensor_parallel_size must be an integer >= 1"),
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
