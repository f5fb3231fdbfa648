"""Host time per engine step, by stage, without a profiler (which inflates launch costs).

When the host needs longer per step than the device, the device idles between steps (overlap
only hides host work shorter than a step). This wraps the stages of `LLMEngine.step` with timers
and runs steady-state decode batches of the given sizes:

    python scripts/host_timing.py [--batch 1 16 64 256] [--steps 200]

`wait` is the time spent blocked on the device (fetching the previous step's tokens): near zero
means the host is the bottleneck.
"""
import argparse
import random
import time
from collections import defaultdict

import torch

from steady_decode import DEFAULT_CONFIG, end_decode_batch, random_weight_llm, start_decode_batch
import nanovllm.worker.model_runner as model_runner_mod

TOTALS: dict[str, float] = defaultdict(float)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t
    return wrapper


def instrument(engine):
    runner = engine.model_runner
    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine._process = timed("process (incl. wait)", engine._process)
    model_runner_mod.build_host_inputs = timed("build_host_inputs", model_runner_mod.build_host_inputs)
    model_runner_mod.to_device = timed("to_device", model_runner_mod.to_device)
    model_runner_mod.build_sampling_metadata = timed("sampling_metadata", model_runner_mod.build_sampling_metadata)
    runner.execute = timed("execute (all)", runner.execute)
    if runner.graph_runner is not None:
        runner.graph_runner.run = timed("graph run (copies + replay)", runner.graph_runner.run)
        torch.cuda.CUDAGraph.replay = timed("graph replay", torch.cuda.CUDAGraph.replay)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    runner.sampler.sample = timed("sample", runner.sampler.sample)
    model_runner_mod.StepOutput.__init__ = timed("StepOutput (D2H)", model_runner_mod.StepOutput.__init__)
    model_runner_mod.StepOutput.token_ids = timed("wait (token_ids)", model_runner_mod.StepOutput.token_ids)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    llm = random_weight_llm(args.config)
    engine = llm.engine
    instrument(engine)
    rng = random.Random(0)
    for batch in args.batch:
        start_decode_batch(engine, batch, rng)
        for _ in range(10):
            engine.step()
        sync()
        TOTALS.clear()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        wall = (time.perf_counter() - t) / args.steps
        print(f"\n===== batch {batch}: {wall * 1e3:.3f} ms/step wall")
        for name, total in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
            print(f"  {name:>28}: {total / args.steps * 1e6:8.1f} us/step")
        end_decode_batch(engine, batch)
    llm.shutdown()


if __name__ == "__main__":
    main()
