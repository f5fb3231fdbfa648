"""The sampling pass (`kernels/sample.py`) at decode batch sizes over a Qwen3-sized vocabulary.

    python scripts/bench_sample.py      (GPU machine)

Times `sample_rows` (split pass + merge, CUDA graph, median) on bf16 logits for B in 1..256 for a
few `SampleConfig`s (programs per SM, tile, warps, prefetch of the next tile, approximate logs),
with the bytes it must read as a fraction of the copy bandwidth, and counts the rows where a
config draws differently from the default. Each call reads logits the previous one did not touch
(several copies beyond the L2 cache), as in the engine, where the logits are fresh every step.
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import measure_device  # noqa: E402
from nanovllm.kernels.sample import DEFAULT_SAMPLE_CONFIG, SampleConfig, sample_rows  # noqa: E402

VOCAB = 151936
CONFIGS = [DEFAULT_SAMPLE_CONFIG] + [SampleConfig(*c) for c in (
    (4, 1024, 4, True, False), (8, 1024, 4, False, False), (8, 1024, 4, True, False), (16, 1024, 4, True, False),
    (8, 2048, 8, True, False), (4, 1024, 4, False, True), (8, 1024, 4, True, True), (16, 1024, 4, True, True),
    (8, 2048, 8, True, True))]


def main():
    bw = measure_device(torch.device("cuda"))[0]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for batch in (1, 16, 64, 128, 256):
        g = torch.Generator(device="cuda").manual_seed(batch)
        copies = max(1, -(-120_000_000 // (batch * VOCAB * 2)))  # > the 50 MB L2, several times
        logits = [(torch.randn(batch, VOCAB, device="cuda", generator=g) * 3).to(torch.bfloat16)
                  for _ in range(copies)]
        temps = torch.full((batch,), 0.6, device="cuda")
        seeds = torch.randint(0, 2**62, (batch,), device="cuda", generator=g)
        offsets = torch.randint(0, 1024, (batch,), device="cuda", generator=g)
        out = torch.empty(batch, dtype=torch.int64, device="cuda")
        ideal_us = batch * VOCAB * 2 / bw * 1e6
        print(f"B={batch:3d}: read-bound {ideal_us:6.1f} us", flush=True)
        reference = None
        for config in CONFIGS:
            def fn():
                for x in logits:
                    sample_rows(x, temps, None, out=out, seeds=seeds, offsets=offsets, _config=config)
            t = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3 / copies
            tokens = sample_rows(logits[0], temps, None, seeds=seeds, offsets=offsets, _config=config)
            reference = tokens if reference is None else reference
            print(f"  {t:6.1f} us ({ideal_us / t:4.0%})  {config}  rows drawing unlike the default: "
                  f"{(tokens != reference).sum().item()}/{batch}", flush=True)


if __name__ == "__main__":
    main()
