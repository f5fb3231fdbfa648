"""The LM head and the default sampling draw in one kernel, against cuBLAS's LM head + `sample_rows`.

    python scripts/bench_lm_head_sample.py [--rows 1 16 64 128 256]     (GPU machine)

At 256 decode rows the step's LM head (cuBLAS, compute-bound, ~117 us on the H200) writes 78 MB of
bf16 logits that the sampling pass (`kernels/sample.py`, bound by its noise arithmetic, ~78 us) reads
back. Here each program of a GEMM (our TMA `mainloop`, Qwen3's [151936, 1024] embedding as weights)
draws in its epilogue: the Gumbel-max score of every logit of its [BM, BN] tile with the sampler's
own noise (same key, hash and logs), the best per row written as one partial, and
`_sample_merge_kernel` picks each row's winner over the tiles. No logits reach memory, and while one
program's epilogue computes noise another's MMA can run. The logits are rounded to bf16 before the
draw, as the LM head's output would be, so the draws equal the two-kernel path's wherever the two
GEMMs round every logit alike (they accumulate in another order: a rare logit may differ by one bf16
step, which can change a draw only where two scores tie to that step).

Prints, per row count, us per step of both paths (CUDA graphs, the weights streaming from HBM as in
a model) for a few tile shapes, how many rows draw differently, and two diagnostics: cuBLAS's LM head
alone and the fused kernel with an argmax instead of the draw (our GEMM with a cheap epilogue). Nothing here is used by the
engine; the numbers decide whether the engine's sampling graph should take this path.
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.gemm import mainloop  # noqa: E402
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue  # noqa: E402
from nanovllm.kernels.sample import (_row_key, _sample_merge_kernel, fast_logf, gumbel_max_scores,  # noqa: E402
                                     sample_rows)

VOCAB, HIDDEN = 151936, 1024
# (BM, BN, BK, warps, stages) by row count. Register counts compiled for sm_90 (scripts/kernel_ir.py's
# compile): 64 x 64 tiles with 4 warps 96 per thread (3 programs per SM), 128 x 64 with 8 warps 102 (2 per
# SM), 128 x 128 with 8 warps 237 (1 per SM: no other program's MMA to overlap the epilogue with).
CONFIGS = {
    1: [(16, 128, 128, 4, 3), (16, 256, 64, 4, 4), (16, 64, 128, 4, 4)],
    16: [(16, 128, 128, 4, 3), (16, 256, 64, 4, 4), (16, 64, 128, 4, 4)],
    64: [(64, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3)],
    128: [(128, 64, 64, 8, 4), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3)],
    256: [(128, 64, 64, 8, 4), (128, 64, 64, 8, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3)],
}


@triton.jit(do_not_specialize=["M"])
def lm_head_sample_kernel(a_desc, w_desc, temps_ptr, seeds_ptr, offsets_ptr, part_score_ptr, part_idx_ptr,
                          M, V, num_tiles, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          FAST_LOG: tl.constexpr, NOISE: tl.constexpr = True):
    """grid (cdiv(M, BM), cdiv(V, BN)): the [BM, BN] logits tile of hidden @ embedding^T, and per row
    its best Gumbel-max score and token (`kernels/sample.py`'s seeded draw) into the partials. The row
    blocks of one vocabulary tile are neighbours in launch order: its weights come from HBM once."""
    pdl_prologue()
    pid_n = tl.program_id(1)
    m0 = tl.program_id(0) * BM
    n0 = pid_n * BN
    rows = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    row_ok = rows < M
    temp = tl.load(temps_ptr + rows, mask=row_ok, other=0.0)
    key = _row_key(tl.load(seeds_ptr + rows, mask=row_ok, other=0), tl.load(offsets_ptr + rows, mask=row_ok, other=0))
    acc, _ = mainloop(a_desc, w_desc, m0, n0, 0, 0, K, BM, BN, BK, False)
    x = acc.to(a_desc.dtype).to(tl.float32)  # the logits as the LM head writes them
    greedy = (temp <= 0.0)[:, None]
    inv_t = (1.0 / tl.where(temp <= 0.0, 1.0, temp))[:, None]
    if NOISE:
        score = gumbel_max_scores(x, key[:, None], (key >> 7)[:, None], cols[None, :], greedy, inv_t, FAST_LOG)
    else:  # the argmax alone (a diagnostic: the GEMM and a cheap epilogue, no draw)
        score = x
    score = tl.where((cols < V)[None, :], score, float("-inf"))
    top = tl.max(score, axis=1)
    # The lowest token among a row's equal maxima (torch.argmax's rule, as in sample_rows).
    idx = tl.min(tl.where(score == top[:, None], cols[None, :], V), axis=1)
    tl.store(part_score_ptr + rows * num_tiles + pid_n, top, mask=row_ok)
    tl.store(part_idx_ptr + rows * num_tiles + pid_n, idx, mask=row_ok)


def fused_draw(hidden, weight, temps, seeds, offsets, out, config, parts=None, noise=True):
    """Tokens [M] drawn from softmax(hidden @ weight^T / T) (greedy rows: the argmax) in two launches;
    noise=False: every row's argmax (timing the GEMM with a cheap epilogue)."""
    bm, bn, bk, warps, stages = config
    m, k = hidden.shape
    v = weight.shape[0]
    tiles = triton.cdiv(v, bn)
    if parts is None:
        parts = (torch.empty(m, tiles, dtype=torch.float32, device=hidden.device),
                 torch.empty(m, tiles, dtype=torch.int32, device=hidden.device))
    fast_log = hidden.is_cuda and fast_logf is not None
    lm_head_sample_kernel[(triton.cdiv(m, bm), tiles)](
        TensorDescriptor.from_tensor(hidden, [bm, bk]), TensorDescriptor.from_tensor(weight, [bn, bk]),
        temps, seeds, offsets, parts[0], parts[1], m, v, tiles, K=k, BM=bm, BN=bn, BK=bk, FAST_LOG=fast_log, NOISE=noise,
        num_warps=warps, num_stages=stages, **PDL_LAUNCH)
    _sample_merge_kernel[(m,)](parts[0], parts[1], out, tiles, v, BLOCK_S=triton.next_power_of_2(tiles),
                               num_warps=4, **PDL_LAUNCH)
    return out


def two_kernel_draw(hidden, weight, temps, seeds, offsets, out, logits):
    """The engine's sampling graph today: cuBLAS's LM head into `logits`, then `sample_rows`."""
    torch.mm(hidden, weight.t(), out=logits)
    return sample_rows(logits, temps, None, out=out, seeds=seeds, offsets=offsets)


def graph_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, device=dev, generator=g) * 0.05).to(dt)  # 311 MB: streams from HBM
    for m in args.rows:
        hidden = torch.randn(m, HIDDEN, device=dev, generator=g).to(dt)
        temps = torch.full((m,), 0.6, device=dev)
        temps[::5] = 0.0  # some greedy rows
        seeds = torch.randint(0, 2**62, (m,), device=dev, generator=g)
        offsets = torch.randint(0, 1024, (m,), device=dev, generator=g)
        logits = torch.empty(m, VOCAB, dtype=dt, device=dev)
        ref = torch.empty(m, dtype=torch.int64, device=dev)
        t_ref = graph_us(lambda: two_kernel_draw(hidden, weight, temps, seeds, offsets, ref, logits))
        t_mm = graph_us(lambda: torch.mm(hidden, weight.t(), out=logits))
        line = [f"rows {m:3d}: cuBLAS LM head + sample_rows {t_ref:6.1f} us (the LM head alone {t_mm:6.1f})"]
        for config in CONFIGS.get(m, CONFIGS[min(CONFIGS, key=lambda r: abs(r - m))]):
            out = torch.empty(m, dtype=torch.int64, device=dev)
            try:
                t = graph_us(lambda: fused_draw(hidden, weight, temps, seeds, offsets, out, config))
            except Exception as e:  # noqa: BLE001 (a tile shape the compiler or shared memory rejects)
                line.append(f"{config}: {type(e).__name__}")
                continue
            differ = (out != ref).sum().item()
            t_argmax = graph_us(lambda: fused_draw(hidden, weight, temps, seeds, offsets, out, config, noise=False))
            line.append(f"{config} {t:6.1f} us ({differ} rows draw otherwise; argmax only {t_argmax:6.1f} us)")
        print("\n  ".join(line), flush=True)


if __name__ == "__main__":
    main()
