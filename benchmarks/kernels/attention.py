"""GPU check of the paged-attention kernels: full-size correctness (bf16/fp16) and timings.

    python scripts/gpu_kernels.py [attention]            # everything (~3-5 minutes on an H200)
    python scripts/gpu_kernels.py [attention] --quick    # correctness + default-config timings only

Every case is isolated: a failure prints FAIL with the error and the script goes on.
Exit code: 1 if any correctness case failed, 2 if only a benchmark errored, else 0.
(A CUDA illegal-address error poisons the context: later cases then fail as well.)
"""

import argparse
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from nanovllm.kernels import (alloc_decode_workspace, choose_num_splits,
                              paged_decode_attention, paged_prefill_attention, store_kv_cache)
from nanovllm.kernels import reference as ref

DEV = torch.device("cuda")
FAILS, BENCH_ERRORS, ROWS = [], [], []
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def run_case(name, fn):
    try:
        msg = fn()
        print(f"PASS  {name}  {msg or ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - report and keep going
        FAILS.append(name)
        print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:500]}", flush=True)
        traceback.print_exc(limit=3)


def bench(name, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        BENCH_ERRORS.append(name)
        print(f"FAIL  bench {name}: {type(e).__name__}: {str(e)[:500]}", flush=True)


def check(out, expect, dtype):
    assert not out.isnan().any(), "NaN in output (unwritten element or bad masking)"
    err = (out.float() - expect.float()).abs().max().item()
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return f"max_abs_err={err:.2e}"


def cu_from(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)


# ----------------------------------------------------------------------------- correctness
def correct_decode(dtype, hq, hkv, d, bs, seq_lens, num_splits=None):
    def fn():
        g = torch.Generator().manual_seed(0)
        kc, vc, bt = ref.random_paged_kv(seq_lens, hkv, d, bs, dtype, DEV, generator=g)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        q = torch.randn(len(seq_lens), hq, d, device=DEV, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        paged_decode_attention(q, kc, vc, bt, sl, d ** -0.5, out=out, num_splits=num_splits)
        return check(out, ref.paged_decode_attention(q, kc, vc, bt, sl, d ** -0.5), dtype)
    return fn


def correct_prefill(dtype, hq, hkv, d, bs, q_lens, seq_lens):
    def fn():
        g = torch.Generator().manual_seed(0)
        kc, vc, bt = ref.random_paged_kv(seq_lens, hkv, d, bs, dtype, DEV, generator=g)
        sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        cu = cu_from(q_lens)
        q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=dtype)
        out = torch.full_like(q, float("nan"))
        args = (q, kc, vc, cu, sl, bt, max(q_lens), d ** -0.5)
        paged_prefill_attention(*args, out=out)
        return check(out, ref.paged_prefill_attention(*args), dtype)
    return fn


def correct_store(dtype, n, hkv, d, bs):
    def fn():
        nblk = n // bs + 8
        kc = torch.randn(nblk, bs, hkv, d, device=DEV, dtype=dtype)
        vc = torch.randn_like(kc)
        kr, vr = kc.clone(), vc.clone()
        qkv = torch.randn(n, 3 * hkv, d, device=DEV, dtype=dtype)
        slots = torch.randperm(nblk * bs, device=DEV)[:n]
        slots[::5] = -1
        store_kv_cache(qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:], kc, vc, slots)
        ref.store_kv_cache(qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:], kr, vr, slots)
        assert torch.equal(kc, kr) and torch.equal(vc, vr), "cache mismatch"
    return fn


def correct_decode_cuda_graph(dtype=torch.bfloat16):
    """Capture with a fixed batch, split count and workspace; replay on new lengths/tables."""
    def fn():
        b, hq, hkv, d, bs, max_len = 16, 16, 8, 128, 16, 4096
        blocks_per_seq = max_len // bs
        kc = torch.randn(b * blocks_per_seq + 4, bs, hkv, d, device=DEV, dtype=dtype)
        vc = torch.randn_like(kc)
        bt = torch.zeros(b, blocks_per_seq, dtype=torch.int32, device=DEV)
        sl = torch.zeros(b, dtype=torch.int32, device=DEV)
        q = torch.randn(b, hq, d, device=DEV, dtype=dtype)
        out = torch.empty_like(q)
        splits = choose_num_splits(b, hq, hkv, d, DEV, max_seq_len_hint=max_len)
        ws = alloc_decode_workspace(b, hq, d, splits, DEV)
        call = lambda: paged_decode_attention(q, kc, vc, bt, sl, d ** -0.5, out=out,  # noqa
                                              num_splits=splits, workspace=ws)
        call()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        msgs = []
        for trial in range(3):
            lens = torch.randint(0, max_len + 1, (b,)).tolist()
            lens[0] = 0
            bt.copy_(torch.randperm(b * blocks_per_seq, device=DEV)[: b * blocks_per_seq]
                     .view(b, -1).int())
            sl.copy_(torch.tensor(lens, dtype=torch.int32))
            q.copy_(torch.randn_like(q))
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            msgs.append(check(out, ref.paged_decode_attention(q, kc, vc, bt, sl, d ** -0.5), dtype))
        return f"splits={splits} " + " ".join(msgs)
    return fn


def correctness():
    rnd = torch.Generator().manual_seed(42)

    def lens(n, lo, hi):
        return torch.randint(lo, hi + 1, (n,), generator=rnd).tolist()

    for dtype in (torch.bfloat16, torch.float16):
        dn = str(dtype).split(".")[-1]
        for n, hkv, d, bs in ((4096, 8, 128, 16), (300, 2, 64, 256), (77, 3, 80, 64)):
            run_case(f"store_kv {dn} N={n} Hkv={hkv} D={d} bs={bs}", correct_store(dtype, n, hkv, d, bs))
        for hq, hkv, d, bs in ((16, 8, 128, 256), (16, 8, 128, 16), (32, 4, 128, 64),
                               (8, 8, 64, 16), (32, 8, 64, 256), (8, 1, 128, 16)):
            sl = lens(48, 1, 4096)
            sl[:4] = [0, 1, 4096, 17]
            for splits in (None, 1, 7):
                run_case(f"decode {dn} Hq={hq} Hkv={hkv} D={d} bs={bs} splits={splits}",
                         correct_decode(dtype, hq, hkv, d, bs, sl, splits))
        for hq, hkv, d in ((16, 8, 256), (12, 4, 96), (64, 4, 128)):
            run_case(f"decode {dn} Hq={hq} Hkv={hkv} D={d} bs=16",
                     correct_decode(dtype, hq, hkv, d, 16, lens(20, 0, 3000)))
        for hq, hkv, d, bs in ((16, 8, 128, 256), (16, 8, 128, 16), (32, 4, 128, 64),
                               (8, 8, 64, 16), (16, 2, 64, 256), (16, 16, 128, 64)):
            # plain prefill, prefix hits / chunked prefill, decode rows, an empty row
            q_lens = [2048, 1, 513, 0, 1000, 64, 1, 3000]
            seq_lens = [2048, 4000, 4096, 0, 1000, 130, 1, 3100]
            run_case(f"prefill {dn} Hq={hq} Hkv={hkv} D={d} bs={bs} mixed",
                     correct_prefill(dtype, hq, hkv, d, bs, q_lens, seq_lens))
            q_lens = lens(16, 1, 700)
            seq_lens = [q + p for q, p in zip(q_lens, lens(16, 0, 3000))]
            run_case(f"prefill {dn} Hq={hq} Hkv={hkv} D={d} bs={bs} random-chunks",
                     correct_prefill(dtype, hq, hkv, d, bs, q_lens, seq_lens))
        run_case(f"prefill {dn} decode-only rows", correct_prefill(
            dtype, 16, 8, 128, 16, [1] * 9, [1, 63, 64, 65, 127, 128, 129, 1000, 4096]))
        for hq, hkv, d in ((16, 8, 256), (12, 4, 96)):
            run_case(f"prefill {dn} Hq={hq} Hkv={hkv} D={d} bs=16", correct_prefill(
                dtype, hq, hkv, d, 16, [1000, 7, 1], [1000, 2000, 50]))
    run_case("decode fp32 Hq=16 Hkv=8 D=128 bs=16",
             correct_decode(torch.float32, 16, 8, 128, 16, lens(8, 1, 2000)))
    run_case("prefill fp32 Hq=16 Hkv=8 D=128 bs=16",
             correct_prefill(torch.float32, 16, 8, 128, 16, [300, 1, 40], [300, 900, 100]))
    run_case("decode bf16 CUDA-graph replay", correct_decode_cuda_graph())


# ----------------------------------------------------------------------------- benchmarks
def ms(fn, graph=False):
    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def device_rates():
    n = 1 << 30  # 1 Gi bf16 = 2 GiB each way
    src = torch.empty(n, dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    copy_gbs = 2 * n * 2 / t / 1e6
    del src, dst
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    t = ms(lambda: a @ b)
    mm_tflops = 2 * 8192 ** 3 / t / 1e9
    print(f"device copy bandwidth {copy_gbs:.0f} GB/s (read+write); bf16 matmul {mm_tflops:.0f} TFLOP/s")
    return copy_gbs, mm_tflops


def sdpa_ms(q, k, v, causal):
    """Dense torch SDPA time for the same problem (q/k/v as [B, H, L, D])."""
    try:
        return ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
    except TypeError:  # older torch: no enable_gqa
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        return ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))


# Benchmark shapes (module-level so they are easy to change).
DECODE_SHAPE = dict(hq=16, hkv=8, d=128)
DECODE_BATCHES, DECODE_CTXS, BLOCK_SIZES = (1, 32, 256), (512, 1024, 4096), (256, 16)
DECODE_SWEEP_CASES = ((256, 1024, 16), (32, 4096, 16), (256, 4096, 256))  # (B, ctx, bs)
PREFILL_CASES = [("8x2048", [2048] * 8, [2048] * 8), ("1x8192", [8192], [8192]),
                 ("4x512 chunk on 3584 prefix", [512] * 4, [4096] * 4)]
STORE_TOKENS = (256, 8192)
# Config sweeps (G/M rows, N keys per tile, warps, stages) reported next to the defaults.
# (the decode tuples end with PREFETCH_BLOCKS: block ids carried one tile ahead)
DECODE_CONFIGS = [(16, bn, w, s, pf) for bn in (32, 64, 128) for w, s in ((4, 2), (4, 3), (4, 5), (8, 3))
                  for pf in (False, True)]
PREFILL_CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
                   (128, 128, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4),
                   (128, 64, 4, 3), (64, 128, 4, 3)]


def bench_decode(copy_gbs, sweep):
    hq, hkv, d, dtype = DECODE_SHAPE["hq"], DECODE_SHAPE["hkv"], DECODE_SHAPE["d"], torch.bfloat16
    for bs in BLOCK_SIZES:
        for b in DECODE_BATCHES:
            for ctx in DECODE_CTXS:
                def fn(b=b, ctx=ctx, bs=bs):
                    kc, vc, bt = ref.random_paged_kv([ctx] * b, hkv, d, bs, dtype, DEV, poison=False)
                    sl = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
                    q = torch.randn(b, hq, d, device=DEV, dtype=dtype)
                    out = torch.empty_like(q)
                    splits = choose_num_splits(b, hq, hkv, d, DEV, max_seq_len_hint=ctx)
                    ws = alloc_decode_workspace(b, hq, d, 64, DEV)
                    run = lambda s=splits, c=None: paged_decode_attention(  # noqa: E731
                        q, kc, vc, bt, sl, d ** -0.5, out=out, num_splits=s, workspace=ws, _config=c)
                    t = ms(run)
                    tg = ms(run, graph=True)
                    nbytes = 2 * b * ctx * hkv * d * 2 + 2 * q.numel() * 2
                    gbs = nbytes / t / 1e6
                    best = ""
                    if sweep:
                        times = {s: ms(lambda s=s: run(s)) for s in (1, 2, 4, 8, 16, 32, 64)}
                        s_best = min(times, key=times.get)
                        best = f"best_splits={s_best}:{times[s_best] * 1e3:.1f}us"
                        if (b, ctx, bs) in DECODE_SWEEP_CASES:
                            ct = {c: ms(lambda c=c: run(splits, c)) for c in DECODE_CONFIGS}
                            c_best = min(ct, key=ct.get)
                            best += f" best_cfg(G,N,warps,stages)={c_best}:{ct[c_best] * 1e3:.1f}us"
                    qd = q.view(b, hq, 1, d)
                    kd = torch.randn(b, hkv, ctx, d, device=DEV, dtype=dtype)
                    t_sdpa = sdpa_ms(qd, kd, kd, causal=False)
                    ROWS.append((f"decode B={b} ctx={ctx} bs={bs}", f"splits={splits}",
                                 f"{t * 1e3:.1f}us", f"graph {tg * 1e3:.1f}us",
                                 f"{gbs:.0f} GB/s ({100 * gbs / copy_gbs:.0f}% copy)",
                                 f"sdpa-dense {t_sdpa * 1e3:.1f}us", best))
                    print("  ", *ROWS[-1], flush=True)
                bench(f"decode B={b} ctx={ctx} bs={bs}", fn)


def bench_prefill(mm_tflops, sweep):
    hq, hkv, d, dtype = DECODE_SHAPE["hq"], DECODE_SHAPE["hkv"], DECODE_SHAPE["d"], torch.bfloat16
    for bs in BLOCK_SIZES:
        for name, q_lens, seq_lens in PREFILL_CASES:
            def fn(q_lens=q_lens, seq_lens=seq_lens, bs=bs, name=name):
                kc, vc, bt = ref.random_paged_kv(seq_lens, hkv, d, bs, dtype, DEV, poison=False)
                sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
                cu = cu_from(q_lens)
                q = torch.randn(sum(q_lens), hq, d, device=DEV, dtype=dtype)
                out = torch.empty_like(q)
                run = lambda c=None: paged_prefill_attention(  # noqa: E731
                    q, kc, vc, cu, sl, bt, max(q_lens), d ** -0.5, out=out, _config=c)
                t = ms(run)
                # causal with prefix: query at position p attends p + 1 keys
                flops = sum(4 * hq * d * (qn * (s - qn) + qn * (qn + 1) / 2)
                            for qn, s in zip(q_lens, seq_lens))
                tf = flops / t / 1e9
                best = ""
                if sweep and name == PREFILL_CASES[0][0]:
                    ct = {c: ms(lambda c=c: run(c)) for c in PREFILL_CONFIGS}
                    c_best = min(ct, key=ct.get)
                    best = f"best_cfg(M,N,warps,stages)={c_best}:{flops / ct[c_best] / 1e9:.0f}TF/s"
                t_sdpa = float("nan")
                if len(set(q_lens)) == 1 and q_lens == seq_lens:
                    qd = torch.randn(len(q_lens), hq, q_lens[0], d, device=DEV, dtype=dtype)
                    kd = torch.randn(len(q_lens), hkv, q_lens[0], d, device=DEV, dtype=dtype)
                    t_sdpa = sdpa_ms(qd, kd, kd, causal=True)
                ROWS.append((f"prefill {name} bs={bs}", f"{t * 1e3:.0f}us",
                             f"{tf:.0f} TFLOP/s ({100 * tf / mm_tflops:.0f}% mm)",
                             f"sdpa-dense {t_sdpa * 1e3:.0f}us" if t_sdpa == t_sdpa else "", best))
                print("  ", *ROWS[-1], flush=True)
            bench(f"prefill {name} bs={bs}", fn)


def bench_store(copy_gbs):
    hkv, d, bs, dtype = 8, 128, 16, torch.bfloat16
    for n in STORE_TOKENS:
        def fn(n=n):
            kc = torch.empty(n // bs + 64, bs, hkv, d, device=DEV, dtype=dtype)
            vc = torch.empty_like(kc)
            qkv = torch.randn(n, 32, d, device=DEV, dtype=dtype)
            slots = torch.randperm(kc.shape[0] * bs, device=DEV)[:n]
            run = lambda: store_kv_cache(qkv[:, 16:24], qkv[:, 24:], kc, vc, slots)  # noqa
            t, tg = ms(run), ms(run, graph=True)
            gbs = 2 * 2 * n * hkv * d * 2 / t / 1e6
            ROWS.append((f"store_kv N={n}", f"{t * 1e3:.1f}us", f"graph {tg * 1e3:.1f}us",
                         f"{gbs:.0f} GB/s ({100 * gbs / copy_gbs:.0f}% copy)"))
            print("  ", *ROWS[-1], flush=True)
        bench(f"store_kv N={n}", fn)


def main(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="no config / split sweeps")
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | triton {triton.__version__}"
          f" | SMs {torch.cuda.get_device_properties(0).multi_processor_count}", flush=True)
    t0 = time.time()
    if not args.skip_correctness:
        correctness()
        print(f"correctness: {len(FAILS)} failed ({time.time() - t0:.0f}s)", flush=True)
    if not args.skip_bench:
        copy_gbs, mm_tflops = device_rates()
        bench_decode(copy_gbs, sweep=not args.quick)
        print(f"decode benchmarks done ({time.time() - t0:.0f}s)", flush=True)
        bench_prefill(mm_tflops, sweep=not args.quick)
        print(f"prefill benchmarks done ({time.time() - t0:.0f}s)", flush=True)
        bench_store(copy_gbs)
    print("\n==== summary ====")
    for row in ROWS:
        print(" | ".join(row))
    for name in FAILS:
        print(f"FAILED correctness: {name}")
    for name in BENCH_ERRORS:
        print(f"FAILED benchmark: {name}")
    print(f"total {time.time() - t0:.0f}s; correctness failures {len(FAILS)}; "
          f"benchmark errors {len(BENCH_ERRORS)}")
    sys.exit(1 if FAILS else 2 if BENCH_ERRORS else 0)
