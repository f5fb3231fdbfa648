"""Where a decode step's time goes on the GPU: wall time per step and the top kernels.

    python scripts/profile_step.py [--batch 256] [--config benchmarks/configs/qwen3-0.6b.json]
"""
import argparse
import os
import random
import shutil
import sys
import tempfile
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm import LLM, SamplingParams  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 128, 32, 8, 1])
    ap.add_argument("--config", default=os.path.join(HERE, "..", "benchmarks/configs/qwen3-0.6b.json"))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.6)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    shutil.copy(args.config, os.path.join(tmp, "config.json"))
    llm = LLM(tmp, load_format="dummy", max_model_len=4096)
    engine = llm.engine
    rng = random.Random(0)
    for batch in args.batch:
        for i in range(batch):
            prompt = [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
            engine.add_request(f"{batch}-{i}", prompt, SamplingParams(temperature=args.temperature, ignore_eos=True,
                                                                      max_tokens=2000))
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        per_step = (time.perf_counter() - t) / args.steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                engine.step()
            torch.cuda.synchronize()
        busy = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA) / 10 / 1e3
        print(f"\n===== batch {batch}: {per_step * 1e3:.2f} ms/step wall ({batch / per_step:,.0f} tok/s), "
              f"device busy {busy:.2f} ms/step under the profiler")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
        for i in range(batch):
            engine.abort_request(f"{batch}-{i}")
        engine.drain()


if __name__ == "__main__":
    main()
