#!/usr/bin/env python
"""GPU check of the fused elementwise kernels (nanovllm/kernels/fused_ops.py) against the
plain-torch layers they replace: full-size bf16 correctness, then timings.

    python scripts/gpu_fused_ops.py                 # correctness + timings (~1 minute on an H200)
    python scripts/gpu_fused_ops.py --skip-bench

Shapes: Qwen3-0.6B (hidden 1024, 16 q / 8 kv heads of 128, intermediate 3072) at T=256 (a
CUDA-graph decode batch) and T=16384 (a long prefill chunk). Timings are medians: "eager" with
triton.testing.do_bench (includes launch overhead: the torch layers issue several kernels each),
"graph" with do_bench_cudagraph (what a captured decode step pays). GB/s = bytes the op must
move / fused graph time. Without CUDA it dry-runs the correctness cases on tiny shapes under the
Triton interpreter (to test this script itself).
Exit code: 1 if a correctness case failed, 2 if only a benchmark errored, else 0.
"""

import argparse
import os
import sys
import time
import traceback

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the @triton.jit definitions

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402


def torch_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm.kernels.fused_ops import fused_add_rms_norm, qk_norm_rope, rms_norm, silu_and_mul  # noqa: E402
from nanovllm.layers.layernorm import RMSNorm  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding  # noqa: E402

DEV = torch.device("cuda" if ON_GPU else "cpu")
HIDDEN, HQ, HKV, HEAD_DIM, INTER, LAYERS, EPS = 1024, 16, 8, 128, 3072, 28, 1e-6
if not ON_GPU:  # dry run: tiny shapes
    HIDDEN, HQ, HKV, HEAD_DIM, INTER = 96, 4, 2, 64, 96
MAX_POS = 40960
TOKENS = (256, 16384) if ON_GPU else (3, 17)
MANTISSA = {torch.float16: 10, torch.bfloat16: 7}
FAILS, BENCH_ERRORS, ROWS = [], [], []


def ulp_check(out, expect, scale=None, max_ulp=2, max_inexact=0.01):
    """<= max_ulp ulp everywhere, at most max_inexact of elements not bit-exact (see
    tests/kernels/test_fused_ops.py for why 2 ulp); fp32: 1e-5 relative."""
    assert out.shape == expect.shape and out.dtype == expect.dtype, (out.shape, out.dtype, expect.dtype)
    assert not out.isnan().any(), "NaN in output (unwritten element or bad masking)"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
        return f"max_abs_err={(out - expect).abs().max().item():.1e}"
    o, e = out.float(), expect.float()
    mag = torch.maximum(o.abs(), e.abs())
    if scale is not None:
        mag = torch.maximum(mag, scale.float())
    _, ex = torch.frexp(mag)
    lo = -24 if out.dtype == torch.float16 else -133
    err = (o - e).abs() / torch.ldexp(torch.ones_like(o), (ex - 1 - MANTISSA[out.dtype]).clamp(min=lo))
    worst, inexact = err.max().item(), (err > 0).float().mean().item()
    if ON_GPU:  # the interpreter's bf16 casts truncate: only the GPU is held to the bound
        assert worst <= max_ulp and inexact <= max_inexact, f"{worst:.1f} ulp, {inexact:.3%} inexact"
    return f"max {worst:.0f} ulp, {inexact:.3%} inexact"


def rope_scale(x):
    x1, x2 = x.float().abs().chunk(2, dim=-1)
    return (x1 + x2).repeat(*([1] * (x.dim() - 1)), 2)


def run_case(name, fn):
    try:
        print(f"PASS  {name}  {fn() or ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - report and keep going
        FAILS.append(name)
        print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:500]}", flush=True)
        traceback.print_exc(limit=3)


def make_norm(n, dtype):
    norm = RMSNorm(n, EPS).to(DEV)
    norm.weight.data = (1.0 + 0.5 * torch.randn(n, device=DEV)).to(dtype)
    return norm


def qkv_inputs(t, dtype):
    """Strided q/k views of a fused qkv output, random positions, Qwen3 norms and rope."""
    qkv = torch.randn(t, (HQ + 2 * HKV) * HEAD_DIM, device=DEV).mul_(2).to(dtype)
    q, k, _ = qkv.split([HQ * HEAD_DIM, HKV * HEAD_DIM, HKV * HEAD_DIM], dim=-1)
    q, k = q.unflatten(-1, (HQ, HEAD_DIM)), k.unflatten(-1, (HKV, HEAD_DIM))
    pos = torch.randint(0, MAX_POS, (t,), device=DEV)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POS, 1e6).to(DEV)
    return q, k, pos, rope, make_norm(HEAD_DIM, dtype), make_norm(HEAD_DIM, dtype)


def correctness(dtype=torch.bfloat16):
    for t in TOKENS:
        def norm_case():
            norm = make_norm(HIDDEN, dtype)
            x = torch.randn(t, HIDDEN, device=DEV).mul_(3).to(dtype)
            out = torch.full_like(x, float("nan"))
            return ulp_check(rms_norm(x, norm.weight, EPS, out=out), norm(x))

        def add_norm_case():
            norm = make_norm(HIDDEN, dtype)
            x = torch.randn(t, HIDDEN, device=DEV).mul_(2).to(dtype)
            res = torch.randn(t, HIDDEN, device=DEV).mul_(4).to(dtype)
            expect, expect_res = norm(x, res)
            y, r = fused_add_rms_norm(x, res, norm.weight, EPS, out=x, residual_out=res)  # in place
            msg = ulp_check(y, expect)
            if ON_GPU:
                assert torch.equal(r, expect_res), "new residual not bit-exact"
            return msg

        def silu_case():
            x = torch.randn(t, 2 * INTER, device=DEV).mul_(4).to(dtype)
            out = torch.full((t, INTER), float("nan"), device=DEV, dtype=dtype)
            return ulp_check(silu_and_mul(x, out=out), torch_silu_and_mul(x))

        def qk_case(with_norm):
            def fn():
                q, k, pos, rope, qn, kn = qkv_inputs(t, dtype)
                qi, ki = (qn(q), kn(k)) if with_norm else (q, k)
                eq, ek = rope(pos, qi, ki)
                w = dict(q_weight=qn.weight, k_weight=kn.weight) if with_norm else {}
                gq, gk = qk_norm_rope(q, k, pos, rope.cos_sin_cache, eps=EPS, **w)
                sq, sk = (rope_scale(qi), rope_scale(ki)) if with_norm else (None, None)
                return f"q: {ulp_check(gq, eq, sq)}; k: {ulp_check(gk, ek, sk)}"
            return fn

        run_case(f"rms_norm T={t} {dtype}", norm_case)
        run_case(f"fused_add_rms_norm(in place) T={t} {dtype}", add_norm_case)
        run_case(f"silu_and_mul T={t} {dtype}", silu_case)
        run_case(f"qk_norm_rope(norm) T={t} {dtype}", qk_case(True))
        run_case(f"rope only T={t} {dtype}", qk_case(False))
    if ON_GPU:
        run_case("qk_norm_rope + fused_add_rms_norm under CUDA-graph replay", graph_case)


def graph_case(dtype=torch.bfloat16):
    """Captured with fixed buffers, replayed on new inputs (the decode-step usage)."""
    t = 256
    q, k, pos, rope, qn, kn = qkv_inputs(t, dtype)
    x = torch.randn(t, HIDDEN, device=DEV, dtype=dtype)
    res = torch.randn_like(x)
    norm = make_norm(HIDDEN, dtype)
    call = lambda: (qk_norm_rope(q, k, pos, rope.cos_sin_cache, qn.weight, kn.weight, EPS),  # noqa: E731
                    fused_add_rms_norm(x, res, norm.weight, EPS))
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (gq, gk), (gy, gr) = call()
    for _ in range(2):
        q.copy_(torch.randn_like(q))
        pos.copy_(torch.randint(0, MAX_POS, (t,), device=DEV))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eq, _ = rope(pos, qn(q), kn(k))
        ulp_check(gq, eq, rope_scale(qn(q)))
        ulp_check(gy, norm(x, res)[0])
    return "ok"


def bench_row(name, t, nbytes, torch_fn, fused_fn):
    try:
        times = []
        for fn in (torch_fn, fused_fn):
            times.append(do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3)
            times.append(do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3)
        te, tg, fe, fg = times
        ROWS.append((name, t, te, fe, tg, fg, nbytes / (fg * 1e-6) / 1e9))
        print(f"  {name:<22} T={t:<6} eager torch {te:8.1f} fused {fe:7.1f} | graph torch {tg:8.1f} "
              f"fused {fg:7.1f} us | {ROWS[-1][-1]:6.0f} GB/s", flush=True)
    except Exception as e:  # noqa: BLE001
        BENCH_ERRORS.append(f"{name} T={t}")
        print(f"FAIL  bench {name} T={t}: {type(e).__name__}: {str(e)[:500]}", flush=True)


def bench(dtype=torch.bfloat16):
    es = torch.finfo(dtype).bits // 8
    for t in TOKENS:
        norm = make_norm(HIDDEN, dtype)
        x = torch.randn(t, HIDDEN, device=DEV, dtype=dtype)
        res = torch.randn_like(x)
        bench_row("rms_norm", t, 2 * t * HIDDEN * es, lambda: norm(x), lambda: rms_norm(x, norm.weight, EPS))
        bench_row("fused_add_rms_norm", t, 4 * t * HIDDEN * es, lambda: norm(x, res),
                  lambda: fused_add_rms_norm(x, res, norm.weight, EPS))
        gu = torch.randn(t, 2 * INTER, device=DEV, dtype=dtype)
        bench_row("silu_and_mul", t, 3 * t * INTER * es, lambda: torch_silu_and_mul(gu), lambda: silu_and_mul(gu))
        q, k, pos, rope, qn, kn = qkv_inputs(t, dtype)
        qk_bytes = 2 * t * (HQ + HKV) * HEAD_DIM * es + t * HEAD_DIM * 4 + t * 8
        bench_row("qk_norm_rope", t, qk_bytes, lambda: rope(pos, qn(q), kn(k)),
                  lambda: qk_norm_rope(q, k, pos, rope.cos_sin_cache, qn.weight, kn.weight, EPS))
        bench_row("rope only", t, qk_bytes, lambda: rope(pos, q, k),
                  lambda: qk_norm_rope(q, k, pos, rope.cos_sin_cache))


def print_summary():
    if not ROWS:
        return
    print("\n==== summary (bf16, median us) ====")
    print(f"{'op':<20}{'T':>7}{'torch':>9}{'fused':>8}{'torch(g)':>10}{'fused(g)':>10}{'speedup(g)':>11}{'GB/s':>7}")
    for op, t, te, fe, tg, fg, gbs in ROWS:
        print(f"{op:<20}{t:>7}{te:>9.1f}{fe:>8.1f}{tg:>10.1f}{fg:>10.1f}{tg / fg:>10.1f}x{gbs:>7.0f}")
    # Per decode step (T=256, graph): every layer has 2 add+norms, 1 qk_norm_rope, 1 silu.
    per = {op: tg - fg for op, t, _, _, tg, fg, _ in ROWS if t == TOKENS[0]}
    save = LAYERS * (2 * per.get("fused_add_rms_norm", 0) + per.get("qk_norm_rope", 0)
                     + per.get("silu_and_mul", 0))
    print(f"estimated saving per {LAYERS}-layer decode step at T={TOKENS[0]} (graph): {save:.0f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if ON_GPU else "CPU (interpreter dry run)"
    print(f"{name} | torch {torch.__version__} | triton {triton.__version__}", flush=True)
    torch.manual_seed(0)
    t0 = time.time()
    correctness()
    print(f"correctness: {len(FAILS)} failed ({time.time() - t0:.0f}s)", flush=True)
    if ON_GPU and not args.skip_bench:
        bench()
    print_summary()
    for n in FAILS:
        print(f"FAILED correctness: {n}")
    for n in BENCH_ERRORS:
        print(f"FAILED benchmark: {n}")
    print(f"total {time.time() - t0:.0f}s; correctness failures {len(FAILS)}; benchmark errors {len(BENCH_ERRORS)}")
    sys.exit(1 if FAILS else 2 if BENCH_ERRORS else 0)


if __name__ == "__main__":
    main()
