"""Tensor parallelism on the CPU (gloo): parity with one rank, failures that raise instead of
hanging, and a lifecycle that leaves no process or shared-memory segment behind."""
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from transformers import AutoConfig

from helpers import children, running
from nanovllm import LLM, SamplingParams

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small blocks and a small token budget: the 50-token prompt is prefilled in two chunks, and
# prompts of 16+ tokens leave full blocks for the prefix cache to hit on the second pass (and
# every prompt a partial one).
KW = dict(dtype="float32", max_model_len=256, kvcache_block_size=16, max_num_batched_tokens=32)
PROMPTS = [[1, 2, 3], list(range(10, 60)), list(range(100, 130)), [7] * 17 + [8, 9]]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 8, 16, 5)]
QUICK = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
BOUND_S = 20  # a failure must surface well within this


def _child_pids() -> set[int]:
    """Live children of this process, other than multiprocessing's resource tracker."""
    from multiprocessing import resource_tracker
    return set(children(os.getpid())) - {getattr(resource_tracker._resource_tracker, "_pid", None)}


def _worker_pids(llm) -> list[int]:
    return llm.engine.model_runner.worker_pids


@pytest.fixture(autouse=True)
def no_leftovers():
    shm_before = set(os.listdir("/dev/shm"))
    children_before = _child_pids()
    yield
    assert not multiprocessing.active_children()
    assert _child_pids() <= children_before
    assert not set(os.listdir("/dev/shm")) - shm_before


def _run(llm, prompts=PROMPTS, params=PARAMS):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o["token_ids"] for o in outs], [o["num_cached_tokens"] for o in outs]


# ---- parity ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama", "qwen3_moe", "qwen2_moe"])
def test_two_ranks_match_one(model_factory, arch):
    """qwen3: GQA with tied embeddings; qwen2: 6 heads / 2 KV heads, qkv bias, untied head;
    llama: a single KV head, so both ranks hold a replica of it; qwen3_moe: every expert's
    intermediate dimension split over the ranks (and a dense layer); qwen2_moe: the shared expert's
    partial summed in the same all-reduce as the routed experts'."""
    path = model_factory(arch)
    with LLM(path, **KW) as ref:
        expected, _ = _run(ref)
    with LLM(path, tensor_parallel_size=2, **KW) as llm:
        executor = llm.engine.model_runner
        pids = _worker_pids(llm)
        assert len(pids) == 1 and all(running(p) for p in pids)
        hf = llm.config.hf_config
        assert executor.num_kv_heads == max(1, hf.num_key_value_heads // 2)  # the KV cache is per rank
        assert executor.num_blocks == llm.config.num_kvcache_blocks
        first, cached = _run(llm)
        assert first == expected and cached == [0, 0, 0, 0]
        copies = []
        runner = executor.runner
        copy = runner.copy_kv_prefixes
        runner.copy_kv_prefixes = lambda c: copies.append(c.shape[1]) or copy(c)
        # Same prompts: all but their last token now come from the prefix cache, full blocks
        # shared and the rest copied on every rank from the first pass's partial blocks (a rank
        # that skipped its copy would change the output).
        again, cached = _run(llm)
        assert again == expected and cached == [len(p) - 1 for p in PROMPTS] and sum(copies) == 4
    assert not any(running(p) for p in pids)


# Seeded draws with the sampler's optional stages: penalties read the pending tokens too.
MIXED = [SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True, top_k=20),
         SamplingParams(temperature=0.7, seed=2, max_tokens=8, ignore_eos=True, logprobs=2, presence_penalty=0.5),
         SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
         SamplingParams(temperature=1.0, seed=4, max_tokens=5, min_tokens=3, top_p=0.9)]


def test_two_ranks_overlapped_steps_match_one(model_factory):
    """Steps launched before the previous step's tokens are read, as on a GPU: the decode inputs
    still pending on the host reach every rank from rank 0's samples through a broadcast."""
    path = model_factory("qwen3")
    with LLM(path, **KW) as ref:
        expected = [_run(ref)[0], _run(ref, params=MIXED)[0]]
    with LLM(path, tensor_parallel_size=2, **KW) as llm:
        llm.engine.overlap = True  # what a CUDA device turns on
        broadcasts = []
        runner = llm.engine.model_runner.runner
        pending_tokens = runner._pending_tokens
        runner._pending_tokens = lambda: broadcasts.append(1) or pending_tokens()
        assert [_run(llm)[0], _run(llm, params=MIXED)[0]] == expected
        assert broadcasts  # pending inputs were resolved on the devices


# ---- validation --------------------------------------------------------------------------
def test_bad_sizes_fail_before_any_process_starts(model_factory, monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        LLM(model_factory("qwen3"), tensor_parallel_size=3)
    hf = AutoConfig.from_pretrained(model_factory("qwen2"))  # 6 heads
    hf.num_key_value_heads = 3
    with pytest.raises(ValueError, match="tensor_parallel_size=2 and num_key_value_heads=3: one must divide"):
        LLM(model_factory("qwen2"), hf_config=hf, tensor_parallel_size=2)
    hf.num_key_value_heads, hf.intermediate_size = 2, 161
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide intermediate_size=161"):
        LLM(model_factory("qwen2"), hf_config=hf, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(model_factory("qwen3"), tensor_parallel_size=0)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 1 CPU cores"):
        LLM(model_factory("qwen3"), tensor_parallel_size=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 CUDA devices from cuda:0 on, but only 1"):
        LLM(model_factory("qwen3"), tensor_parallel_size=2, device="cuda")
    assert not multiprocessing.active_children()


# ---- failures ----------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])
def test_killed_worker_makes_generate_raise(model_factory, overlap):
    """overlap: steps launched before the previous one's tokens are read, as on a GPU."""
    llm = LLM(model_factory("qwen3"), tensor_parallel_size=2, dtype="float32", max_model_len=1024)
    llm.engine.overlap = overlap
    pid, = _worker_pids(llm)
    _run(llm, [[1, 2, 3]], QUICK)
    # SIGKILL the worker from another thread, at an arbitrary point of a generate that is
    # certainly still running (its 20th step of 1000).
    running = threading.Event()
    step = llm.engine.step
    steps = iter(range(10**6))

    def counting_step():
        if next(steps) == 20:
            running.set()
        return step()

    llm.engine.step = counting_step
    killer = threading.Thread(target=lambda: running.wait(BOUND_S) and os.kill(pid, signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    long = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    with pytest.raises(RuntimeError, match="tensor-parallel worker rank 1 was killed by signal 9"):
        llm.generate([[i + 1] * 5 for i in range(16)], long, use_tqdm=False)
    killer.join()
    assert time.monotonic() - start < BOUND_S
    assert not llm.engine.has_unfinished()  # generate aborted its requests
    with pytest.raises(RuntimeError, match="group is shut down .*rank 1 was killed"):
        llm.generate([[1, 2, 3]], QUICK, use_tqdm=False)
    llm.shutdown()


def test_worker_exception_makes_generate_raise(model_factory):
    llm = LLM(model_factory("llama"), tensor_parallel_size=2, **KW)
    pid, = _worker_pids(llm)
    # A message the worker cannot decode: it reports the exception and exits.
    llm.engine.model_runner._group.conns[0].send_bytes(b"not a pickle")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)tensor-parallel worker rank 1 raised:.*UnpicklingError"):
        _run(llm)
    assert time.monotonic() - start < BOUND_S
    assert not running(pid)
    llm.shutdown()


def test_exception_in_rank0_stops_the_workers(model_factory):
    llm = LLM(model_factory("qwen2"), tensor_parallel_size=2, **KW)
    pid, = _worker_pids(llm)
    executor = llm.engine.model_runner

    def broken_run(*args, **kwargs):
        raise ValueError("boom on rank 0")

    executor.runner.run = broken_run
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on rank 0"):
        _run(llm)
    assert time.monotonic() - start < BOUND_S
    # The worker was mid-step, waiting for rank 0 in a collective: it cannot be reused.
    assert not running(pid)
    with pytest.raises(RuntimeError, match="group is shut down .*rank 0 failed"):
        _run(llm)
    llm.shutdown()


# ---- lifecycle -----------------------------------------------------------------------------
def test_workers_stop_when_llm_is_dropped_and_at_exit(model_factory):
    """In a fresh interpreter: `del llm` stops its worker; an LLM still alive when the script
    ends is stopped by the exit hooks, so the interpreter exits promptly and leaves no orphan."""
    script = textwrap.dedent(f"""
        import gc, os, sys
        sys.path.insert(0, {REPO!r})
        from nanovllm import LLM, SamplingParams
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        kw = dict(tensor_parallel_size=2, dtype="float32", max_model_len=128)
        llm = LLM({model_factory("qwen3")!r}, **kw)
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
        pid = llm.engine.model_runner.worker_pids[0]
        del llm
        gc.collect()
        print("DROPPED", pid, os.path.exists(f"/proc/{{pid}}"), flush=True)
        llm = LLM({model_factory("qwen3")!r}, **kw)
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
        print("LEFT", llm.engine.model_runner.worker_pids[0], flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("DROPPED", "LEFT")))
    dropped_pid, dropped_exists = lines["DROPPED"].split()
    assert dropped_exists == "False"
    left_pid = int(lines["LEFT"])
    deadline = time.monotonic() + 5
    while running(left_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(left_pid)


def test_workers_exit_when_rank0_is_killed(model_factory):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {REPO!r})
        from nanovllm import LLM
        llm = LLM({model_factory("qwen3")!r}, tensor_parallel_size=2, dtype="float32", max_model_len=128)
        print("WORKER", llm.engine.model_runner.worker_pids[0], flush=True)
        time.sleep(600)
    """)
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = rank0.stdout.readline()
        assert line.startswith("WORKER"), line
        worker = int(line.split()[1])
        assert running(worker)
    finally:
        rank0.kill()
        rank0.wait()
        rank0.stdout.close()
    deadline = time.monotonic() + 5
    while running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(worker)  # no orphan: it noticed its parent's death
