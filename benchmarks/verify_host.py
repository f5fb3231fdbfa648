"""Host time of one n-gram verification step on the CPU: requests that copy their prompt (every
draft accepted, each step k + 1 tokens a sequence), through the real LLMEngine and ModelRunner with
the GPU path's device work replaced by stand-ins: the verification graph's replay is its input fill
(`fill_verify_inputs` into numpy views, as into the pinned buffer), the sampler's launch returns the
tokens the prompt continues with. What a step costs then is the host's work between reading the
previous step's tokens and launching the next (a verification step does not overlap the device),
less the CUDA API calls and the pinned copy, which need a GPU.

    python -m benchmarks.verify_host [--batch-sizes 1,4,16] [-k 5] [--parts] [--profile 16]

--parts: the median microseconds of the step's parts too (each wrapper adds ~0.2 us to its part).
"""
import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time

import numpy as np
import torch

from benchmarks import load_config
from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.layers.sampler import SamplerOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.worker import model_runner
from nanovllm.worker.cuda_graph import batch_size_ladder
from nanovllm.worker.verify_graph import fill_verify_inputs, verify_step_fits

# bench_frontend.py's tiny Qwen3: its start-up costs nothing, and only prefill steps run it.
TINY_QWEN3 = load_config("tiny-qwen3.json")


class StandInDevice:
    """The verification graphs and the sampler of a ModelRunner on the CPU. Every sequence's tokens
    are `stream` (its prompt is a prefix of it): each draw returns the stream's next tokens. The time
    spent making up those tokens (`stand_in_ns`) is no host work of the engine's."""

    def __init__(self, runner, k: int, max_bs: int, stream: np.ndarray):
        self.query_len, self.max_bs, self.stream = k + 1, max_bs, stream
        self.batch_sizes = batch_size_ladder(max_bs)
        rows = max_bs * self.query_len
        self.views = {"input_ids": np.zeros(rows, np.int64), "positions": np.zeros(rows, np.int64),
                      "slot_mapping": np.zeros(rows, np.int64), "logits_rows": np.zeros(rows, np.int64),
                      "seq_lens": np.zeros(max_bs, np.int32), "decode_order": np.zeros(max_bs, np.int32),
                      "block_tables": np.zeros((max_bs, runner.max_blocks_per_seq), np.int32)}
        self.fill = fill_verify_inputs  # the host's work of a replay
        self.stand_in_ns = 0
        self.last_spec = None  # the drafts of the last step launched
        self._verified = None  # the tokens of the verification step being drawn
        self._drawing = []
        runner.verify_graphs = self
        runner.sampler.sample = self._sample
        execute, draw = runner.execute, runner._draw

        def recording_execute(batch, defer_sampling=False):
            self.last_spec = batch.spec
            return execute(batch, defer_sampling)

        def recording_draw(seqs, logits, meta, verifies=False):
            self._drawing = seqs
            return draw(seqs, logits, meta, verifies)
        runner.execute, runner._draw = recording_execute, recording_draw

    def fits(self, batch) -> bool:
        return verify_step_fits(batch, self.query_len, self.max_bs)

    def run(self, batch, block_size: int) -> torch.Tensor:
        bs = next(b for b in self.batch_sizes if b >= len(batch.seqs))
        num_rows = self.fill(self.views, batch, bs, self.query_len, block_size)
        start = time.perf_counter_ns()
        tokens = []
        for seq, draft in zip(batch.seqs, batch.spec):
            tokens += self.stream[seq.num_tokens:seq.num_tokens + len(draft) + 1].tolist()
        self._verified = torch.tensor(tokens, dtype=torch.int64)
        logits = torch.empty(num_rows, 1)
        self.stand_in_ns += time.perf_counter_ns() - start
        return logits

    def _sample(self, logits, meta) -> SamplerOutput:
        if self._verified is None:  # a plain step (the prefill): each sequence's next token
            return SamplerOutput(torch.tensor([int(self.stream[s.num_tokens]) for s in self._drawing]))
        tokens, self._verified = self._verified, None
        return SamplerOutput(tokens)


def make_engine(model_dir: str, k: int, max_bs: int) -> LLMEngine:
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "disable_by_batch_size": max_bs}
    engine = LLMEngine(Config(model_dir, load_format="dummy", device="cpu", max_num_seqs=max(16, max_bs),
                              max_model_len=4096, num_kvcache_blocks=512, speculative_config=spec))
    engine.overlap = True  # as on a GPU
    return engine


def measure(engine, device: StandInDevice, batch: int, prompt: list[int], max_tokens: int, rounds: int,
            profiler=None) -> list[int]:
    """Host nanoseconds of each step in which every one of `batch` sequences verified k drafts."""
    samples, k = [], device.query_len - 1
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for r in range(rounds):
        for i in range(batch):
            engine.add_request(f"{batch}-{r}-{i}", prompt, params)
        while engine.has_unfinished():
            device.stand_in_ns, device.last_spec = 0, None
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter_ns()
            engine.step()
            took = time.perf_counter_ns() - start - device.stand_in_ns
            if profiler is not None:
                profiler.disable()
            spec = device.last_spec
            if spec is not None and len(spec) == batch and all(len(d) == k for d in spec):
                samples.append(took)
    return samples


def timed_parts(engine, device: StandInDevice) -> dict[str, list[int]]:
    """Wrap the step's parts: {name: nanoseconds of each call}."""
    parts = {}

    def wrap(owner, attr, name):
        fn = getattr(owner, attr)
        times = parts[name] = []

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            result = fn(*args, **kwargs)
            times.append(time.perf_counter_ns() - start)
            return result
        setattr(owner, attr, timed)
    wrap(engine.speculator, "wants_drafts", "wants_drafts")
    wrap(engine.speculator, "propose", "propose")
    wrap(engine.scheduler, "schedule", "schedule")
    wrap(device, "fill", "fill_verify_inputs")
    wrap(model_runner, "build_sampling_metadata", "sampling_metadata")
    wrap(engine.scheduler, "advance", "advance")
    wrap(engine, "_process_verified", "process")
    return parts


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("-k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--period", type=int, default=300, help="the prompt repeats every this many tokens")
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--rounds", type=int, default=3, help="requests run to the end, per batch size")
    p.add_argument("--parts", action="store_true")
    p.add_argument("--profile", type=int, default=0, help="cProfile the steps of this batch size instead")
    args = p.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    base = np.random.default_rng(0).integers(1, TINY_QWEN3["vocab_size"], args.period)
    stream = np.resize(base, args.prompt_len + args.max_tokens + 64)
    prompt = stream[:args.prompt_len].tolist()
    results = {}
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_QWEN3, f)
        engine = make_engine(model_dir, args.k, max(sizes + [args.profile]))
        device = StandInDevice(engine.model_runner, args.k, max(sizes + [args.profile]), stream)
        parts = timed_parts(engine, device) if args.parts else {}
        measure(engine, device, 1, prompt, 60, 1)  # warm-up
        if args.profile:
            profiler = cProfile.Profile()
            measure(engine, device, args.profile, prompt, args.max_tokens, args.rounds, profiler)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            return results
        for b in sizes:
            for times in parts.values():
                times.clear()
            us = np.asarray(measure(engine, device, b, prompt, args.max_tokens, args.rounds)) / 1e3
            results[b] = {"median_us": float(np.median(us)), "steps": int(us.size),
                          "parts_us": {name: float(np.median(t)) / 1e3 for name, t in parts.items() if t}}
            line = f"batch {b:3d}: {results[b]['median_us']:7.1f} us per verification step (median of {us.size})"
            if parts:
                line += "; " + ", ".join(f"{name} {t:.1f}" for name, t in results[b]["parts_us"].items())
            print(line)
    return results


if __name__ == "__main__":
    main()
