"""The sampler's seeded noise on the CPU (`exponential_noise`: the hash of every (row, token) and its Exp(1)
draw), ms per call (min and median of 20; this shared machine is noisy) at decode batch sizes and vocabulary widths (49,152: SmolLM2; 151,936: Qwen3).

    python scripts/bench_cpu_noise.py
"""
import time

import torch

from nanovllm.layers.sampler import exponential_noise


def main():
    gen = torch.Generator().manual_seed(0)
    for rows, vocab in ((1, 49152), (2, 49152), (16, 49152), (7, 151936)):
        seeds = torch.randint(0, 2**62, (rows,), generator=gen)
        offsets = torch.randint(0, 4096, (rows,), generator=gen)
        times = []
        for _ in range(21):
            start = time.perf_counter()
            exponential_noise(seeds, offsets, vocab)
            times.append((time.perf_counter() - start) * 1e3)
        times = sorted(times[1:])  # the first call warms up
        print(f"{rows:3d} rows x {vocab} tokens: min {times[0]:.2f} ms, median {times[len(times) // 2]:.2f} ms")


if __name__ == "__main__":
    main()
