"""Where a decode step's time goes on the GPU: wall time per step and the top kernels.

    python scripts/profile_step.py [--batch 256] [--config benchmarks/configs/qwen3-0.6b.json] [--quantization fp8]
                                   [--trace DIR] [--replay]
    python scripts/profile_step.py --prefill   (bench.py's prefill and mixed steps, each profiled alone)

With --prefill the benchmark's requests (its prompts and max_tokens, on other prompt tokens after a
warm-up round, so nothing hits the prefix cache) run step by step with a device synchronisation after
each, so every step's kernels are its own: device time per step and its top kernels. Run it with
NANOVLLM_PDL=0, or an early-launched kernel's wait counts as its own time.
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

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks/configs/qwen3-0.6b.json")


def random_weight_llm(config: str = DEFAULT_CONFIG, quantization: str | None = None) -> LLM:
    tmp = tempfile.mkdtemp()
    shutil.copy(config, os.path.join(tmp, "config.json"))
    return LLM(tmp, load_format="dummy", max_model_len=4096, quantization=quantization)


def start_decode_batch(engine, batch: int, rng: random.Random, temperature: float = 0.6):
    """Add `batch` requests with the benchmark's prompt lengths and step until all are decoding."""
    for i in range(batch):
        prompt = [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"{batch}-{i}", prompt, SamplingParams(temperature=temperature, ignore_eos=True,
                                                                  max_tokens=3000))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()


def end_decode_batch(engine, batch: int):
    for i in range(batch):
        engine.abort_request(f"{batch}-{i}")
    engine.drain()


def profile_prefill_steps(llm, top: int):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench import workload
    from benchmarks.diagnostics import device_rows
    from nanovllm import SamplingParams
    prompts, max_tokens = workload(256, 1024, 1024)
    engine = llm.engine
    for r in range(2):  # the first round warms up
        for i, (p, n) in enumerate(zip(prompts, max_tokens)):
            engine.add_request(f"{r}-{i}", [(t + r + 1) % 10000 for t in p],
                               SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n))
        step = 0
        while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                              for s in engine.scheduler.running):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t = time.perf_counter()
                _, num_prefill, num_decode = engine.step()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
            if r == 1:
                rows = device_rows(prof)
                busy = sum(us for _, _, us in rows) / 1e3
                print(f"step {step} ({num_prefill} prompt + {num_decode} decode tokens): wall {wall * 1e3:.2f} ms "
                      f"(synchronised), device busy {busy:.2f} ms")
                for name, calls, us in rows[:top]:
                    print(f"   {us / 1e3:7.3f} ms {calls:5d}x  {name[:110]}")
            step += 1
        for i in range(len(prompts)):
            engine.abort_request(f"{r}-{i}")
        engine.drain()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", action="store_true", help="profile bench.py's prefill and mixed steps, one by one")
    ap.add_argument("--top", type=int, default=12, help="with --prefill: kernels listed per step")
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 128, 32, 8, 1])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--quantization", choices=["fp8"], help="block-FP8 weights, quantized at load")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--replay", action="store_true", help="also the step's CUDA graphs replayed back to back")
    ap.add_argument("--trace", help="directory for a chrome trace of the profiled steps per batch size")
    args = ap.parse_args()
    llm = random_weight_llm(args.config, args.quantization)
    if args.prefill:
        profile_prefill_steps(llm, args.top)
        llm.shutdown()
        return
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
        if args.replay:  # the step's CUDA graphs alone, back to back on the device: the rest is between graphs
            g = engine.model_runner.graph_runner
            bs = g.padded_size(batch)
            for name, fns in (("forward graph", [g.forward_graphs[bs].replay]),
                              ("forward + sampling graphs", [g.forward_graphs[bs].replay, g.sample_graphs[bs].replay])):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.steps):
                    for fn in fns:
                        fn()
                end.record()
                end.synchronize()
                print(f"batch {batch}: {name} replayed back to back {start.elapsed_time(end) / args.steps:.3f} ms "
                      f"(engine step {per_step * 1e3:.3f} ms)")
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
