"""The top-k / top-p draw at decode batch sizes over a Qwen3-sized vocabulary: the torch path
(`_sample_top_k` through `Sampler.sample`, eager) against the kernels' draw (`kernels/sample_top_k.py`,
the default configuration and others) and, for scale, the plain sampling pass; then top-p alone
(`_top_k_top_p`'s full sort, then the draw) against `kernels/sample_top_p.py`.

    python scripts/bench_sample_top_k.py      (GPU machine; STAGES=sampletopk bash scripts/gpu_check.sh)
    python scripts/bench_sample_top_k.py --wide   (top_k 200 and 1,000 with top_p 0.9 only)

bf16 logits, temperature 0.6, top_k 50, top_p 0.9 on every row (the benchmark's `--top-k 50 --top-p
0.9`). Each call reads logits the previous one did not touch (copies beyond the L2 cache). Prints us
per call and the rows where the kernel draws unlike the torch path (allowed only where two scores tie
to ~1e-5, or at the top-p boundary's rounding).
"""
import contextlib
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.engine.sequence import Sequence  # noqa: E402
from nanovllm.kernels.sample import sample_rows  # noqa: E402
from nanovllm.kernels.sample_top_p import sample_top_p_rows  # noqa: E402
from nanovllm.kernels.sample_top_k import DEFAULT_TOP_K_CONFIG, TopKConfig, sample_top_k_rows  # noqa: E402
from nanovllm.layers import sampler as sampler_module  # noqa: E402
from nanovllm.layers.sampler import Sampler  # noqa: E402
from nanovllm.sampling_params import SamplingParams  # noqa: E402
from nanovllm.worker.sampling_inputs import build_sampling_metadata  # noqa: E402

VOCAB = 151936
# (programs per SM, block, warps) besides the default.
VARIANTS = [TopKConfig(8, 1024, 4), TopKConfig(32, 512, 4)]


def _eager_us(fn, reps: int = 20) -> float:
    """Wall time per call of an eager (host-launched) function, device included."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


@contextlib.contextmanager
def _kernels_off():
    """The sampler's torch path for top-k batches, as before the kernels."""
    pick = sampler_module.filter_kernel_draw
    sampler_module.filter_kernel_draw = lambda *args: None
    try:
        yield
    finally:
        sampler_module.filter_kernel_draw = pick


def _batch(batch: int, **filters):
    """Enough copies of [batch, VOCAB] bf16 logits to exceed the L2 cache, and the metadata of a batch
    of requests at temperature 0.6 with the given filters."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    copies = max(1, -(-120_000_000 // (batch * VOCAB * 2)))
    logits = [(torch.randn(batch, VOCAB, device="cuda", generator=g) * 3).to(torch.bfloat16) for _ in range(copies)]
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=0.6, **filters), seed=1000 + i) for i in range(batch)]
    return copies, logits, build_sampling_metadata(seqs, torch.device("cuda"), frozenset(), VOCAB)


def main(k: int = 50, variants=VARIANTS):
    sampler = Sampler()
    for batch in (1, 16, 64, 128, 256):
        copies, logits, meta = _batch(batch, top_k=k, top_p=0.9)
        top_k = torch.full((batch,), k, device="cuda")
        top_p = torch.full((batch,), 0.9, device="cuda")
        out = torch.empty(batch, dtype=torch.int64, device="cuda")

        def torch_path():
            for x in logits:
                sampler.sample(x, meta)

        def torch_path_without_kernels():
            with _kernels_off():
                torch_path()

        def fused():
            for x in logits:
                sample_top_k_rows(x, meta.temperatures, top_k, top_p, meta.row_keys, k, out=out)

        def plain():
            for x in logits:
                sample_rows(x, meta.temperatures, meta.row_keys, out=out)

        t_torch = _eager_us(torch_path_without_kernels) / copies
        t_sampler = _eager_us(torch_path) / copies
        t_fused = triton.testing.do_bench_cudagraph(fused, rep=50) * 1e3 / copies
        t_plain = triton.testing.do_bench_cudagraph(plain, rep=50) * 1e3 / copies
        with _kernels_off():
            expected = sampler.sample(logits[0], meta).token_ids
        got = sample_top_k_rows(logits[0], meta.temperatures, top_k, top_p, meta.row_keys, k)
        print(f"k={k}, B={batch:3d}: torch path {t_torch:7.1f} us, kernels {t_fused:6.1f} us (graph; {t_sampler:6.1f} us "
              f"eager through Sampler.sample), plain draw {t_plain:6.1f} us; rows drawing unlike the torch path: "
              f"{(got != expected).sum().item()}/{batch}", flush=True)
        for config in variants:
            def variant():
                for x in logits:
                    sample_top_k_rows(x, meta.temperatures, top_k, top_p, meta.row_keys, k, out=out, config=config)
            us = triton.testing.do_bench_cudagraph(variant, rep=50) * 1e3 / copies
            print(f"         {tuple(config)}: {us:6.1f} us (default {tuple(DEFAULT_TOP_K_CONFIG)})", flush=True)


def main_top_p():
    sampler = Sampler()
    for batch in (1, 16, 64, 128, 256):
        copies, logits, meta = _batch(batch, top_p=0.9)
        out = torch.empty(batch, dtype=torch.int64, device="cuda")

        def torch_path():
            with _kernels_off():
                for x in logits:
                    sampler.sample(x, meta)

        def kernel():
            for x in logits:
                sample_top_p_rows(x, meta.temperatures, meta.top_p, meta.row_keys, out=out)

        t_torch = _eager_us(torch_path) / copies
        t_kernel = triton.testing.do_bench_cudagraph(kernel, rep=50) * 1e3 / copies
        with _kernels_off():
            expected = sampler.sample(logits[0], meta).token_ids
        got = sample_top_p_rows(logits[0], meta.temperatures, meta.top_p, meta.row_keys)
        print(f"top-p alone, B={batch:3d}: torch path {t_torch:7.1f} us, kernel {t_kernel:6.1f} us; rows drawing "
              f"unlike the torch path: {(got != expected).sum().item()}/{batch}", flush=True)
        for test_first in (True, False):
            def variant():
                for x in logits:
                    sample_top_p_rows(x, meta.temperatures, meta.top_p, meta.row_keys, out=out, test_first=test_first)
            us = triton.testing.do_bench_cudagraph(variant, rep=50) * 1e3 / copies
            print(f"         test_first={test_first}: {us:6.1f} us", flush=True)


if __name__ == "__main__":
    if "--wide" in sys.argv:  # only top_k past 128 (the finish ranks the nucleus by bisection)
        for k in (200, 1000):
            main(k, variants=[])
    else:
        main()
        main_top_p()
