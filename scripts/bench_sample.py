"""The sampling pass (`kernels/sample.py`) at decode batch sizes over a Qwen3-sized vocabulary.

    python scripts/bench_sample.py      (GPU machine)

Times `sample_rows` (split pass + merge, CUDA graph, median) on bf16 logits for B in 1..256, with the
bytes it must read as a fraction of the copy bandwidth, for the precise logs (the default) and the
approximate ones (`_fast_log`), and counts the rows where the two draw differently.
"""
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench import measure_device  # noqa: E402
from nanovllm.kernels.sample import sample_rows  # noqa: E402

VOCAB = 151936


def main():
    bw = measure_device(torch.device("cuda"))[0]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    for batch in (1, 16, 64, 128, 256):
        g = torch.Generator(device="cuda").manual_seed(batch)
        logits = (torch.randn(batch, VOCAB, device="cuda", generator=g) * 3).to(torch.bfloat16)
        temps = torch.full((batch,), 0.6, device="cuda")
        seeds = torch.randint(0, 2**62, (batch,), device="cuda", generator=g)
        offsets = torch.randint(0, 1024, (batch,), device="cuda", generator=g)
        out = torch.empty(batch, dtype=torch.int64, device="cuda")
        ideal_us = logits.numel() * logits.element_size() / bw * 1e6
        tokens, line = {}, f"B={batch:3d}: read-bound {ideal_us:6.1f} us"
        for name, fast in (("precise logs", False), ("fast logs", True)):
            fn = lambda: sample_rows(logits, temps, None, out=out, seeds=seeds, offsets=offsets,  # noqa: E731
                                     _fast_log=fast)
            t = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            tokens[name] = fn().clone()
            line += f" | {name} {t:6.1f} us ({ideal_us / t:4.0%})"
        line += f" | rows drawing differently: {(tokens['precise logs'] != tokens['fast logs']).sum().item()}/{batch}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
