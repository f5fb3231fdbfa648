"""What the prefix cache's partial-block copies cost a prefill step (GPU, Qwen3-0.6B, random weights).

A step that admits requests whose prefix hits end inside a block first copies those blocks' leading
tokens, every layer, in one kernel launch (kernels/copy_kv.py). This times that launch for C copies
of the worst case (a block less one token each) against the step it precedes: a prefill of
--tokens tokens, over one sequence and over C sequences (each request with its own copy).

  python scripts/gpu_kernels.py kvcopy [--tokens 16384] [--copies 1,16,64]
"""
import argparse
import json
import os
import shutil
import tempfile

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from nanovllm import LLM, SamplingParams
from nanovllm.engine.scheduler import ScheduledBatch
from nanovllm.engine.sequence import Sequence


def device_ms(fn, reps: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def prefill_step(runner, num_tokens: int, num_seqs: int):
    """A step computing the whole prompts of num_seqs sequences of num_tokens // num_seqs tokens
    each (greedy), launched without waiting for its tokens."""
    per_seq = num_tokens // num_seqs
    blocks = -(-per_seq // runner.block_size)
    seqs = [Sequence([0] * per_seq, SamplingParams(temperature=0.0), seed=i) for i in range(num_seqs)]
    for i, seq in enumerate(seqs):
        seq.block_table = [(i * blocks + b) % runner.num_blocks for b in range(blocks)]
    batch = ScheduledBatch(seqs, [per_seq] * num_seqs, 0)
    return lambda: runner.execute(batch)


def main(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the prefill step")
    p.add_argument("--copies", default="1,16,64", help="copies per launch (comma-separated)")
    p.add_argument("--config", default=os.path.join(ROOT, "benchmarks", "configs", "qwen3-0.6b.json"))
    args = p.parse_args(argv)
    model = tempfile.mkdtemp(prefix="nanovllm-kvcopy-")
    shutil.copy(args.config, os.path.join(model, "config.json"))
    llm = LLM(model, load_format="dummy", max_model_len=args.tokens + 256, max_num_batched_tokens=args.tokens)
    runner = llm.engine.model_runner
    block_size = runner.block_size
    kv = runner.kv_cache
    print(f"KV cache {tuple(kv.shape)} {kv.dtype}, {runner.num_blocks} blocks of {block_size}")
    results = {}
    with torch.inference_mode():
        for num_copies in map(int, args.copies.split(",")):
            assert 2 * num_copies <= runner.num_blocks
            copies = np.array([np.arange(num_copies), np.arange(num_copies, 2 * num_copies),
                               np.full(num_copies, block_size - 1)], dtype=np.int64)
            copy_ms = device_ms(lambda: runner.copy_kv_prefixes(copies), 50)
            moved = 2 * num_copies * (block_size - 1) * runner.block_bytes / block_size  # read + write
            step_one = device_ms(prefill_step(runner, args.tokens, 1), 5)
            step_many = device_ms(prefill_step(runner, args.tokens, num_copies), 5)
            results[num_copies] = dict(copy_ms=copy_ms, copy_tb_s=moved / copy_ms / 1e9, step_1_seq_ms=step_one,
                                       step_n_seqs_ms=step_many, share_of_step=copy_ms / step_many)
            print(f"{num_copies:3d} copies of {block_size - 1} tokens: {copy_ms * 1e3:8.1f} us "
                  f"({moved / copy_ms / 1e9:.2f} TB/s); prefill of {args.tokens} tokens: {step_one:.2f} ms "
                  f"(1 sequence), {step_many:.2f} ms ({num_copies} sequences): copy = {copy_ms / step_many:.2%} of the step")
    print(json.dumps(results))
    llm.shutdown()
    shutil.rmtree(model, ignore_errors=True)
