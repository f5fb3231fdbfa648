"""GPU check of the FP8 kernels at full size: correctness against the torch reference, then timings.

    python scripts/gpu_kernels.py fp8            # ~1-2 minutes on an H200
    python scripts/gpu_kernels.py fp8 --quick    # correctness only
    python scripts/gpu_kernels.py fp8 --sweep    # the tile tables' candidates on Qwen3-8B's shapes

GEMMs: Qwen3-8B's projections (and Qwen3-0.6B's) at decode and prefill row counts, our Triton W8A8
kernel (the form the engine runs: dense qkv, gated gate_up writing block-FP8, split-K o/down) against
the block-scaled torch._scaled_mm and the bf16 cuBLAS product, weights rotating over copies larger
than L2 (as the layers of a model); "table" marks what the engine picks (kernels/fp8_gemm.py).
Attention: decode over an FP8 against a bf16 cache. Quantization: the fused RMSNorm + quant against
the plain RMSNorm. A failing case prints FAIL and the script goes on; exit 1 if any check failed.
"""
import argparse
import sys
import traceback

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from nanovllm.kernels import paged_decode_attention
from nanovllm.kernels import reference as ref
from nanovllm.kernels.fp8_gemm import (LIBRARY_MIN_M, MAX_TRITON_M, Fp8GemmConfig, fp8_dense_config, fp8_gated_config, fp8_gated_linear,
                                       fp8_linear, fp8_partial_linear, fp8_splitk_config, library_available,
                                       library_scaled_mm)
from nanovllm.kernels.fp8_quant import fused_add_rms_norm_quant, per_token_group_quant, silu_and_mul_quant
from nanovllm.kernels.fused_ops import fused_add_rms_norm
from nanovllm.layers.quantization.fp8 import quantize_weight_blocks

DEV = torch.device("cuda")
FAILS = []
# name: (N, K) of the [N, K] weight; gate_up's N counts gate and up.
SHAPES_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
SHAPES_06B = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
COPIES = 4  # > L2 for every 8B projection but o's smallest; decode timings per call


def check(name, fn):
    try:
        print(f"PASS  {name}  {fn() or ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - report and go on
        FAILS.append(name)
        print(f"FAIL  {name}: {type(e).__name__}: {str(e)[:400]}", flush=True)
        traceback.print_exc(limit=2)


def _weights(n, k, copies):
    out = []
    for _ in range(copies):
        w, s = quantize_weight_blocks(torch.randn(n, k, device=DEV) * 0.02)
        out.append((w, s, (ref.dequantize_blocks(w, s).to(torch.bfloat16))))
    return out


def _rel_err(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def correctness(shapes):
    for name, (n, k) in shapes.items():
        (w, s, w16), = _weights(n, k, 1)
        for m in (1, 17, 100, 300, 4000):
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            xq = per_token_group_quant(x)
            q, qs = ref.per_token_group_quant_fp8(x)
            want = ref.w8a8_block_matmul(q, qs, w, s, torch.float32)

            def dense(m=m, x=x, xq=xq, want=want):
                out = fp8_linear(xq, w, s, fp8_dense_config(m, n))  # large m: the fallback's tiles
                err = _rel_err(out, want)
                assert err < 5e-3, err
                exact = _rel_err(out, x.float() @ w16.float().T)
                assert exact < 0.05, exact  # the activations' 1x128 quantization
                return f"rel err {err:.1e} (vs unquantized activations {exact:.3f})"
            check(f"{name} N={n} K={k} M={m} dense", dense)

            def library(xq=xq, want=want):
                err = _rel_err(library_scaled_mm(xq, w, s), want)
                assert err < 5e-3, err
                return f"rel err {err:.1e}"
            if library_available(DEV):
                check(f"{name} M={m} torch._scaled_mm", library)
            if name in ("o", "down") and fp8_splitk_config(m, k) is not None:
                def splitk(m=m, xq=xq, want=want):
                    err = _rel_err(fp8_partial_linear(xq, w, s, fp8_splitk_config(m, k)).parts.sum(0), want)
                    assert err < 1e-3, err  # FP8 tensor cores add a block's products at ~14 bits
                    return f"rel err {err:.1e}"
                check(f"{name} M={m} split-K", splitk)
            if name == "gate_up":
                def gated(m=m, xq=xq, want=want):
                    g = want.to(torch.bfloat16).float()
                    h = (F.silu(g[:, :n // 2]).to(torch.bfloat16).float() * g[:, n // 2:]).to(torch.bfloat16)
                    out = fp8_gated_linear(xq, w, s, fp8_gated_config(m), quantize_output=True)
                    err = _rel_err(out.dequantize(), h)
                    assert err < 0.05, err
                    return f"rel err {err:.1e} (its output in block FP8)"
                check(f"gate_up M={m} gated + quant", gated)


def _time(fn, m):
    if m <= 512:
        return do_bench_cudagraph(fn, rep=20) * 1e3 / COPIES
    return do_bench(fn, warmup=5, rep=30, return_mode="median") * 1e3 / COPIES


def timings(shapes, label, ms):
    print(f"\n{label}: us per call (weights from HBM); GB/s = FP8 weight bytes / time")
    lib = library_available(DEV)
    for name, (n, k) in shapes.items():
        ws = _weights(n, k, COPIES)
        for m in ms:
            x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
            xq = per_token_group_quant(x)
            if name == "gate_up":
                tri = lambda: [fp8_gated_linear(xq, w, s, fp8_gated_config(m), True) for w, s, _ in ws]  # noqa: E731
                libf = lambda: [silu_and_mul_quant(library_scaled_mm(xq, w, s)) for w, s, _ in ws]  # noqa: E731
            elif name in ("o", "down") and fp8_splitk_config(m, k) is not None:
                tri = lambda: [fp8_partial_linear(xq, w, s, fp8_splitk_config(m, k)) for w, s, _ in ws]  # noqa: E731
                libf = lambda: [library_scaled_mm(xq, w, s) for w, s, _ in ws]  # noqa: E731
            else:
                cfg = fp8_dense_config(m, n)
                tri = lambda: [fp8_linear(xq, w, s, cfg) for w, s, _ in ws]  # noqa: E731
                libf = lambda: [library_scaled_mm(xq, w, s) for w, s, _ in ws]  # noqa: E731
            bf16 = lambda: [F.linear(x, w16) for _, _, w16 in ws]  # noqa: E731
            try:
                t_tri = _time(tri, m)
                t_lib = _time(libf, m) if lib else float("nan")
                t_bf16 = _time(bf16, m)
            except Exception as e:  # noqa: BLE001
                FAILS.append(f"time {name} {m}")
                print(f"FAIL  time {name} M={m}: {type(e).__name__}: {str(e)[:300]}")
                continue
            splitk = name in ("o", "down") and fp8_splitk_config(m, k) is not None
            engine = "triton" if splitk or m < LIBRARY_MIN_M or not lib else "library"
            print(f"M={m:5d} {name:>7} N={n:5d} K={k:5d}: triton {t_tri:8.1f} ({n * k / t_tri / 1e3:6.0f} GB/s)"
                  f" | torch._scaled_mm {t_lib:8.1f} | bf16 cuBLAS {t_bf16:8.1f} | table: {engine}", flush=True)


def _candidates(form, m):
    """Tiles worth timing for one form at m rows (the kernels' constraints: gated output in one group
    per tile, split counts dividing K's blocks)."""
    out = []
    if m <= MAX_TRITON_M:  # weights-bound: one row of tiles; the column width, splits and stages matter
        bm = 16 if m <= 16 else 64
        for stages in (3, 4, 5, 6):
            if form == "gated":  # up to 16 rows also narrow tiles, quantized by a pass after them
                out += [Fp8GemmConfig(1, bm, bn, warps, stages) for warps in (2, 4, 8)
                        for bn in ((32, 64, 128) if bm == 16 else (128,))]
            for bn in (32, 64) if form == "splitk" else (16, 32, 64, 128) if form == "dense" else ():
                out += [Fp8GemmConfig(splits, bm, bn, 4, stages) for splits in ((2, 4, 8) if form == "splitk" else (1,))]
        return out
    # Prefill-sized: compute-bound; the tile and the walk over the tiles (GROUP_M) matter.
    for bm, warps_list in ((64, (4, 8)), (128, (8,))):
        for warps in warps_list:
            for stages in (3, 4):
                out += [Fp8GemmConfig(1, bm, 128, warps, stages, group) for group in (1, 8, 32)]
    return out


def sweep(ms=(1, 2048)):
    """Every candidate tile of each engine form on Qwen3-8B's projections; the table's pick and the best."""
    print("\ntile sweep, Qwen3-8B projections: us per call (weights from HBM)")
    for name, (n, k) in SHAPES_8B.items():
        ws = _weights(n, k, COPIES)
        for m in ms:
            xq = per_token_group_quant(torch.randn(m, k, device=DEV).to(torch.bfloat16))
            if name == "gate_up":
                form, table = "gated", fp8_gated_config(m)
                run = lambda c: [fp8_gated_linear(xq, w, s, c, True) for w, s, _ in ws]  # noqa: E731
            elif name in ("o", "down") and fp8_splitk_config(m, k) is not None:
                form, table = "splitk", fp8_splitk_config(m, k)
                run = lambda c: [fp8_partial_linear(xq, w, s, c) for w, s, _ in ws]  # noqa: E731
            else:
                form, table = "dense", fp8_dense_config(m, n)
                run = lambda c: [fp8_linear(xq, w, s, c) for w, s, _ in ws]  # noqa: E731
            results = []
            for c in dict.fromkeys([table, *_candidates(form, m)]):
                if triton.cdiv(k, 128) % c.splits:
                    continue
                try:
                    results.append((_time(lambda c=c: run(c), m), c))
                except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory): skip it
                    print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
            t_table = next(t for t, c in results if c == table)
            results.sort()
            print(f"M={m:5d} {name:>7} ({form}): table {t_table:8.1f} us {tuple(table)} | best {results[0][0]:8.1f} us "
                  f"{tuple(results[0][1])} ({n * k / results[0][0] / 1e3:5.0f} GB/s) | next "
                  + ", ".join(f"{t:.1f} {tuple(c)}" for t, c in results[1:4]), flush=True)


def attention_timings():
    print("\ndecode attention (Qwen3 heads 16/8, D=128, block 256): bf16 vs FP8 cache, us per call")
    for batch, ctx in ((1, 1500), (64, 1000), (256, 1000)):
        lens = [ctx] * batch
        k16, v16, tables = ref.random_paged_kv(lens, 8, 128, 256, torch.bfloat16, DEV, poison=False)
        scales = (torch.ones(8, device=DEV), torch.ones(8, device=DEV))
        k8, v8 = k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
        q = torch.randn(batch, 16, 128, device=DEV, dtype=torch.bfloat16)
        seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
        t16 = do_bench_cudagraph(lambda: paged_decode_attention(q, k16, v16, tables, seq, 0.088), rep=20) * 1e3
        t8 = do_bench_cudagraph(lambda: paged_decode_attention(q, k8, v8, tables, seq, 0.088, kv_scales=scales),
                                rep=20) * 1e3
        # The FP8 tiles hold half the bytes of the bf16 ones: twice the keys per tile, for comparison.
        config = (16, 128, 4, 3, True)
        t8_wide = do_bench_cudagraph(lambda: paged_decode_attention(q, k8, v8, tables, seq, 0.088, kv_scales=scales,
                                                                    _config=config), rep=20) * 1e3
        got = paged_decode_attention(q, k8, v8, tables, seq, 0.088, kv_scales=scales)
        want = ref.paged_decode_attention(q, k8.float(), v8.float(), tables, seq, 0.088)
        err = (got.float() - want.float()).abs().max().item()
        kv_bytes = 2 * batch * ctx * 8 * 128
        print(f"  batch {batch:3d} x {ctx} keys: bf16 {t16:7.1f} ({2 * kv_bytes / t16 / 1e3:5.0f} GB/s) | "
              f"FP8 {t8:7.1f} ({kv_bytes / t8 / 1e3:5.0f} GB/s) | {t16 / t8:.2f}x | FP8 with 128-key tiles {t8_wide:7.1f} | "
              f"max err vs reference {err:.1e}")
        if err > 2e-2:
            FAILS.append(f"fp8 decode attention batch {batch}")


def quant_timings():
    print("\nRMSNorm + residual (N=4096): plain vs with the block-FP8 output, us per call")
    for m in (1, 256, 8192):
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.ones(4096, device=DEV, dtype=torch.bfloat16)
        t0 = do_bench_cudagraph(lambda: fused_add_rms_norm(x, r, w), rep=20) * 1e3
        t1 = do_bench_cudagraph(lambda: fused_add_rms_norm_quant(x, r, w), rep=20) * 1e3
        print(f"  M={m:5d}: plain {t0:6.1f} | + quant {t1:6.1f}")


def main(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time the tile candidates instead of the checks")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          f"block-scaled torch._scaled_mm: {'available' if library_available(DEV) else 'NOT available'}")
    if args.sweep:
        sweep()
        return
    correctness(SHAPES_8B)
    if not args.quick:
        timings(SHAPES_8B, "Qwen3-8B projections", (1, 16, 32, 64, 128, 192, 256, 2048, 8192))
        timings(SHAPES_06B, "Qwen3-0.6B projections", (1, 64, 256))
        attention_timings()
        quant_timings()
    print(f"\n{len(FAILS)} failed: {FAILS}" if FAILS else "\nall checks passed")
    sys.exit(1 if FAILS else 0)
