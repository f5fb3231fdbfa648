"""Would a persistent decode-layer kernel beat one kernel per projection? The go/no-go number for the
structural lever BENCHMARKS.md names (fewer dependent kernels per layer).

A decode step runs ~8 dependent kernels per layer; each boundary costs its drain, the wait for the
previous kernel's writes and the next one's first loads, even with programmatic dependent launch.
A persistent kernel replaces each boundary with a grid-wide barrier (an atomic arrival and a spin on
a counter in L2), and can issue the next stage's weight loads before it waits. Here both run the same
chain of R dependent "projections" at decode size (each: every program streams its slice of an
[N, K] bf16 weight, one dot with a [BM, K-slice] activation it reads after the previous stage, and
stores an fp32 partial), with the weights rotating over copies that exceed L2, as in a model:

  kernels        one launch per stage (CUDA graph, PDL), weights loaded after the wait
  kernels+pre    the same, weights loaded before the wait (GemmConfig.preload's idea)
  persistent     one launch for all R stages, a grid barrier between stages
  persistent+pre the same, each stage's weights loaded before the barrier that precedes it
  persistent+ld  persistent+pre, the barrier polled with plain acquire loads (`ld.acquire.gpu`)
                 instead of atomic read-modify-writes, which serialise on the counter's L2 slice

With --sync-only, the synchronisation alone: R empty kernels chained by PDL in a CUDA graph against
one kernel passing R grid barriers (atomic or acquire-load polling), at 132 and 264 programs.

    python scripts/bench_grid_barrier.py [--rounds 112] [--rows 16] [--sync-only]   (GPU; all programs must be resident)
"""
import argparse
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue  # noqa: E402

N, K, BN, KS = 1024, 2048, 32, 512  # o_proj of Qwen3-0.6B, cut as the split-K table cuts it: 128 programs
COPIES = 16  # 16 x 4 MB of weights: beyond the 50 MB L2
PROGRAMS = (N // BN) * (K // KS)  # one per (output tile, K slice)


@triton.jit
def _load_w(w_ptr, copy, n0, k0, BN: tl.constexpr, KS: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rn = n0 + tl.arange(0, BN)
    rk = k0 + tl.arange(0, KS)
    return tl.load(w_ptr + copy * (N * K) + rn[:, None] * K + rk[None, :])  # < 2^31 for COPIES x 4 MB


@triton.jit
def _stage(w, a_ptr, out_ptr, r, n0, k0, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
           K: tl.constexpr, N: tl.constexpr):
    """One projection stage of one program: its activation slice (the previous stage's output in a
    model) against its weight slice, an fp32 partial out."""
    rm = tl.arange(0, BM)
    rk = k0 + tl.arange(0, KS)
    a = tl.load(a_ptr + (r % 2) * BM * K + rm[:, None] * K + rk[None, :])
    acc = tl.dot(a, tl.trans(w))
    rn = n0 + tl.arange(0, BN)
    tl.store(out_ptr + (r % 2) * (K // KS) * BM * N + ((k0 // KS) * BM + rm)[:, None] * N + rn[None, :], acc)


@triton.jit
def _stage_kernel(w_ptr, a_ptr, out_ptr, r, COPIES: tl.constexpr, PRE: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, KS: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    p = tl.program_id(0)
    n0 = (p % (N // BN)) * BN
    k0 = (p // (N // BN)) * KS
    if PRE:  # weights are no kernel's output: they may be read before the wait
        w = _load_w(w_ptr, r % COPIES, n0, k0, BN, KS, N, K)
    pdl_prologue()
    if not PRE:
        w = _load_w(w_ptr, r % COPIES, n0, k0, BN, KS, N, K)
    _stage(w, a_ptr, out_ptr, r, n0, k0, BM, BN, KS, K, N)


@triton.jit
def _load_acquire(ptr):
    """One acquire load at GPU scope: a poll that does not occupy the counter's L2 slice the way an
    atomic read-modify-write does (every program spins on the same word)."""
    return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _grid_barrier(counter_ptr, target, POLL_LOAD: tl.constexpr):
    """Every thread's stores done (CTA barrier), arrive (release), then wait until the counter reaches
    target, i.e. all programs have arrived for this round (acquire: their stores visible after it)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")
    if POLL_LOAD:
        seen = _load_acquire(counter_ptr)
        while seen < target:
            seen = _load_acquire(counter_ptr)
    else:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def _persistent_kernel(w_ptr, a_ptr, out_ptr, counter_ptr, ROUNDS: tl.constexpr, COPIES: tl.constexpr,
                       PRE: tl.constexpr, POLL_LOAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
                       N: tl.constexpr, K: tl.constexpr):
    p = tl.program_id(0)
    programs = tl.num_programs(0)
    n0 = (p % (N // BN)) * BN
    k0 = (p // (N // BN)) * KS
    pdl_prologue()
    w = _load_w(w_ptr, 0, n0, k0, BN, KS, N, K)
    for r in range(ROUNDS):
        _stage(w, a_ptr, out_ptr, r, n0, k0, BM, BN, KS, K, N)
        if PRE:  # the next stage's weights in flight while this program waits for the others
            w = _load_w(w_ptr, (r + 1) % COPIES, n0, k0, BN, KS, N, K)
        _grid_barrier(counter_ptr, (r + 1) * programs, POLL_LOAD)
        if not PRE:
            w = _load_w(w_ptr, (r + 1) % COPIES, n0, k0, BN, KS, N, K)


@triton.jit
def _empty_kernel(counter_ptr):
    pdl_prologue()


@triton.jit
def _barriers_kernel(counter_ptr, ROUNDS: tl.constexpr, POLL_LOAD: tl.constexpr):
    programs = tl.num_programs(0)
    pdl_prologue()
    for r in range(ROUNDS):
        _grid_barrier(counter_ptr, (r + 1) * programs, POLL_LOAD)


def sync_only(rounds: int):
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"{rounds} synchronisations with no work, us each:")
    for programs in (132, 264):
        for name, fn in (
                ("empty kernels (PDL)", lambda: [_empty_kernel[(programs,)](counter, **PDL_LAUNCH) for _ in range(rounds)]),
                ("grid barrier, atomic poll", lambda: (counter.zero_(), _barriers_kernel[(programs,)](
                    counter, ROUNDS=rounds, POLL_LOAD=False, **PDL_LAUNCH))),
                ("grid barrier, acquire-load poll", lambda: (counter.zero_(), _barriers_kernel[(programs,)](
                    counter, ROUNDS=rounds, POLL_LOAD=True, **PDL_LAUNCH)))):
            fn()
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
            print(f"  {programs} programs  {name:32s} {us / rounds:6.2f} us", flush=True)


def run_kernels(ws, a, out, rounds, pre, rows):
    for r in range(rounds):
        _stage_kernel[(PROGRAMS,)](ws, a, out, r, COPIES=COPIES, PRE=pre, BM=rows, BN=BN, KS=KS,
                                                N=N, K=K, num_warps=4, **PDL_LAUNCH)


def run_persistent(ws, a, out, counter, rounds, pre, rows, poll_load=False):
    counter.zero_()
    _persistent_kernel[(PROGRAMS,)](ws, a, out, counter, ROUNDS=rounds, COPIES=COPIES, PRE=pre, POLL_LOAD=poll_load,
                                                  BM=rows, BN=BN, KS=KS, N=N, K=K, num_warps=4, **PDL_LAUNCH)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=112, help="dependent stages (28 layers x 4 projections)")
    ap.add_argument("--rows", type=int, default=16, help="decode rows (BM; 16 or more for tl.dot)")
    ap.add_argument("--sync-only", action="store_true", help="time kernel boundaries and grid barriers alone")
    args = ap.parse_args()
    if args.sync_only:
        return sync_only(args.rounds)
    dev = torch.device("cuda")
    assert PROGRAMS <= torch.cuda.get_device_properties(dev).multi_processor_count, "one program per SM"
    ws = torch.randn(COPIES, N, K, dtype=torch.bfloat16, device=dev) * 0.02
    a = torch.randn(2, args.rows, K, dtype=torch.bfloat16, device=dev)
    out = torch.empty(2, K // KS, args.rows, N, dtype=torch.float32, device=dev)
    counter = torch.zeros(1, dtype=torch.int32, device=dev)
    expect = (a[(args.rounds - 1) % 2].float() @ ws[(args.rounds - 1) % COPIES].float().T)
    weight_us = N * K * 2 / (4.3e12) * 1e6
    print(f"{args.rounds} dependent stages of [{args.rows}, {K}] x [{K}, {N}] (4 MB of weights each, "
          f"{weight_us:.2f} us at 4.3 TB/s), {PROGRAMS} programs, us per stage:")
    for name, fn in (("kernels", lambda: run_kernels(ws, a, out, args.rounds, False, args.rows)),
                     ("kernels+pre", lambda: run_kernels(ws, a, out, args.rounds, True, args.rows)),
                     ("persistent", lambda: run_persistent(ws, a, out, counter, args.rounds, False, args.rows)),
                     ("persistent+pre", lambda: run_persistent(ws, a, out, counter, args.rounds, True, args.rows)),
                     ("persistent+ld", lambda: run_persistent(ws, a, out, counter, args.rounds, True, args.rows,
                                                              poll_load=True))):
        fn()
        torch.cuda.synchronize()
        got = out[(args.rounds - 1) % 2].sum(0)
        ok = torch.allclose(got, expect, atol=2e-2, rtol=2e-2)
        us = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        print(f"  {name:15s} {us / args.rounds:6.2f} us per stage   (result {'ok' if ok else 'WRONG'})", flush=True)


if __name__ == "__main__":
    main()
