"""Host time per engine step, by stage, without a profiler (which inflates launch costs).

When the host needs longer per step than the device, the device idles between steps (overlap
only hides host work shorter than a step). This wraps the stages of `LLMEngine.step` with timers
and runs steady-state decode batches of the given sizes:

    python scripts/host_timing.py [--batch 1 16 64 256] [--steps 200]
    python scripts/host_timing.py --prefill   (the benchmark's prefill steps, one line per step)

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
# The stages every other timer runs inside: together they are the engine's part of a step's wall.
SCHEDULE, EXECUTE, PROCESS = "schedule", "execute (all)", "process (incl. wait)"
TOP_LEVEL = (SCHEDULE, EXECUTE, PROCESS)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - t
    return wrapper


def format_stages(totals: dict[str, float]) -> str:
    """The stages' times in ms, longest first."""
    return " ".join(f"{name} {1e3 * t:.2f}" for name, t in sorted(totals.items(), key=lambda kv: -kv[1]))


def instrument(engine):
    runner = engine.model_runner
    engine.scheduler.schedule = timed(SCHEDULE, engine.scheduler.schedule)
    engine._process = timed(PROCESS, engine._process)
    model_runner_mod.build_host_inputs = timed("build_host_inputs", model_runner_mod.build_host_inputs)
    model_runner_mod.to_device = timed("to_device", model_runner_mod.to_device)
    model_runner_mod.build_sampling_metadata = timed("sampling_metadata", model_runner_mod.build_sampling_metadata)
    runner.execute = timed(EXECUTE, runner.execute)
    if runner.graph_runner is not None:
        runner.graph_runner.run = timed("graph run (copies + replay)", runner.graph_runner.run)
        torch.cuda.CUDAGraph.replay = timed("graph replay", torch.cuda.CUDAGraph.replay)
    runner.model.forward = timed("model forward (eager launch)", runner.model.forward)
    runner.model.compute_logits = timed("logits", runner.model.compute_logits)
    runner.sampler.sample = timed("sample", runner.sampler.sample)
    model_runner_mod.StepOutput.__init__ = timed("StepOutput (D2H)", model_runner_mod.StepOutput.__init__)
    model_runner_mod.StepOutput.token_ids = timed("wait (token_ids)", model_runner_mod.StepOutput.token_ids)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_prefill_steps(llm, rounds: int = 2, cprofile: int = 0):
    """Host time per stage in each step of bench.py's prompts (prefill and mixed steps). A step's
    `wait` near zero with a long `execute` means the device finished before the host launched more."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from bench import workload
    from nanovllm import SamplingParams
    prompts, _ = workload(256, 1024, 1024)
    for r in range(rounds):  # the first round warms the allocator and the kernels
        prompts = [[(t + r) % 10000 for t in p] for p in prompts]  # no prefix-cache hits
        for i, p in enumerate(prompts):
            llm.engine.add_request(f"{r}-{i}", p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=2))
        sync()
        print(f"\n===== round {r}")
        step = 0
        profiler = None
        if cprofile and r == rounds - 1:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        while llm.engine.has_unfinished():
            TOTALS.clear()
            t = time.perf_counter()
            _, num_prefill, num_decode = llm.engine.step()
            wall = time.perf_counter() - t
            print(f"step {step:2d} ({num_prefill:5d} prefill + {num_decode:3d} decode tokens): {wall * 1e3:6.2f} ms | "
                  + format_stages(TOTALS))
            step += 1
        if profiler is not None:
            import pstats
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(cprofile)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--config", default=DEFAULT_CONFIG)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prefill", action="store_true", help="time the steps of bench.py's prompts (2 new tokens each)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="with --prefill: the N Python functions with the most own time in the second round (cProfile)")
    args = ap.parse_args()
    llm = random_weight_llm(args.config)
    engine = llm.engine
    instrument(engine)
    if args.prefill:
        time_prefill_steps(llm, cprofile=args.cprofile)
        llm.shutdown()
        return
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
