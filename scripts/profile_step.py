"""Where a decode step's time goes on the GPU: wall time per step and the top kernels.

    python scripts/profile_step.py [--batch 256] [--config benchmarks/configs/qwen3-0.6b.json] [--trace DIR]
"""
import argparse
import os
import random
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from steady_decode import DEFAULT_CONFIG, end_decode_batch, random_weight_llm, start_decode_batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 128, 32, 8, 1])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--trace", help="directory for a chrome trace of the profiled steps per batch size "
                                    "(scripts/trace_gaps.py reads them)")
    args = ap.parse_args()
    llm = random_weight_llm(args.config)
    engine = llm.engine
    rng = random.Random(0)
    for batch in args.batch:
        start_decode_batch(engine, batch, rng, args.temperature)
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
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"decode_b{batch}.json"))
        busy = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == DeviceType.CUDA) / 10 / 1e3
        print(f"\n===== batch {batch}: {per_step * 1e3:.2f} ms/step wall ({batch / per_step:,.0f} tok/s), "
              f"device busy {busy:.2f} ms/step under the profiler")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))
        end_decode_batch(engine, batch)


if __name__ == "__main__":
    main()
