"""Pipeline depths and tiles of the decode projections with the weights in HBM, as in a model.

The engine's tile tables (kernels/gemm.py, kernels/qkv_rope.py) come from this sweep. A sweep that
reuses one weight tensor would measure L2, not HBM: at Qwen3-0.6B's sizes (4-13 MB) a projection's
weights fit in L2. Here the weights rotate over COPIES copies (a projection's copies exceed L2), and each table
entry is timed at other depths (num_stages) and tile depths (BK); split-K also at other widths and
twice the slices, gate_up and qkv at other row (and column) tiles. Each call runs behind the kernel
that precedes it in a layer (programmatic dependent launch), whose own time is subtracted ("net").

    python scripts/tune.py gemm [--m 1,16,32,64,128,192,256] [--only o,down,gate_up,qkv] [--jobs 14]

cuBLAS: the projection with the op our kernel fuses (SiLU-and-mul, the residual-add RMSNorm);
cuBLAS* (qkv): the projection alone, without the rotary kernel. table: the engine's entry (nan where
cuBLAS runs). The variants are compiled first in --jobs processes (Triton's cache then serves the timing process).
"""
import argparse
import concurrent.futures as futures
import multiprocessing

import torch
import torch.nn.functional as F
import triton.testing

from nanovllm.kernels.fused_ops import fused_add_rms_norm, silu_and_mul
from nanovllm.kernels.gemm import (GemmConfig, dense_config, gated_linear, partial_linear,
                                   splitk_config)
from nanovllm.kernels.qkv_rope import qkv_rope_config, qkv_rope_store_kv

COPIES = 8  # weight copies a timed call rotates over: more than L2 holds, as the layers of a model


def per_call_us(fn, copies: int = COPIES):
    """fn(i) for each weight copy i, captured in one graph; microseconds per call."""
    return triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=20) * 1e3 / copies


HIDDEN, INTER, HQ, HKV, D = 1024, 3072, 16, 8, 128
SHAPES = {"qkv": ((HQ + 2 * HKV) * D, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "o": (HIDDEN, HQ * D),
          "down": (HIDDEN, INTER)}
STAGES = (3, 4, 6, 8)


def table_config(name: str, m: int):
    n, k = SHAPES[name]
    if name == "qkv":
        return qkv_rope_config(m, k, D)
    if name == "gate_up":
        return dense_config(m, n, k, gated=True)
    return splitk_config(m, n, k)


def variants(name: str, m: int):
    """The table's entry first (for gate_up past its table's rows, where cuBLAS runs, the 17-128-row
    tiles), then its tiles at other depths and, for split-K, other widths."""
    base = table_config(name, m)
    if base is None and name == "gate_up" and m <= 256:
        base = GemmConfig(1, 64, 64, 128, 4, 4)
    if base is None:
        return []
    k = SHAPES[name][1]
    out = [base]
    if name in ("o", "down"):
        out += [base._replace(bn=bn, num_stages=stages) for bn in (32, 64, 128) for stages in (3, 4, 6)]
    if name == "gate_up":
        out += [base._replace(bm=bm, bn=bn, num_stages=stages) for bm in (16, 32, 64) for bn in (32, 64)
                for stages in (3, 4) if bm <= max(16, m)]
        if m > 128:  # where cuBLAS + SiLU-and-mul runs today: wider tiles, two warpgroups
            out += [GemmConfig(1, bm, bn, bk, warps, stages) for bm in (64, 128) for bn in (64, 128)
                    for bk, stages in ((64, 3), (64, 4), (128, 2), (128, 3)) for warps in (4, 8)
                    if not (bm == 128 and bn == 128 and warps == 4)]
    if name == "qkv":
        out += [base._replace(bm=bm, num_stages=stages) for bm in (16, 32, 64) for stages in (3, 4) if bm <= max(16, m)]
    for bk in (64, 128):
        for stages in STAGES:
            if name == "qkv":
                out.append(base._replace(bk=bk, num_stages=stages))
                continue
            splits = (base.splits,) if name == "gate_up" else (base.splits, 2 * base.splits)
            for s in splits:
                if k % (s * bk) == 0:
                    out.append(base._replace(splits=s, bk=bk, num_stages=stages))
    return list(dict.fromkeys(out))


class Case:
    """Tensors of one projection at m rows; `run(cfg, i)` is the predecessor + the projection on
    weight copy i (+ the residual-add RMSNorm that consumes split-K partials)."""

    def __init__(self, name: str, m: int, copies: int):
        dt, dev = torch.bfloat16, "cuda"
        n, k = SHAPES[name]
        self.name = name
        self.ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(copies)]
        self.h = torch.randn(m, HIDDEN, dtype=dt, device=dev)
        self.res = torch.randn(m, HIDDEN, dtype=dt, device=dev)
        self.nw = torch.ones(HIDDEN, dtype=dt, device=dev)
        self.act = torch.randn(m, 2 * INTER, dtype=dt, device=dev)
        self.x_o = torch.randn(m, HQ * D, dtype=dt, device=dev)
        self.cache = torch.zeros(2, 64, 256, HKV, D, dtype=dt, device=dev)
        self.pos = torch.randint(0, 4000, (m,), device=dev)
        self.slots = torch.randperm(64 * 256, device=dev)[:m]
        self.qn = torch.ones(D, dtype=dt, device=dev)
        from nanovllm.layers.rotary import RotaryEmbedding
        self.cos_sin = RotaryEmbedding(D, 4096, 1e6).to(dev).cos_sin_cache

    def pred(self):
        if self.name in ("qkv", "gate_up"):
            return fused_add_rms_norm(self.h, self.res, self.nw)[0]
        return silu_and_mul(self.act)

    def run(self, cfg, i):
        x = self.pred()
        w = self.ws[i]
        if self.name == "qkv":
            if cfg is None:
                return F.linear(x, w)
            return qkv_rope_store_kv(x, w, HQ, HKV, self.pos, self.cos_sin, self.cache[0], self.cache[1],
                                     self.slots, self.qn, self.qn, config=cfg)
        if self.name == "gate_up":
            return silu_and_mul(F.linear(x, w)) if cfg is None else gated_linear(x, w, cfg)
        a = self.x_o if self.name == "o" else x
        y = F.linear(a, w) if cfg is None else partial_linear(a, w, cfg)
        return fused_add_rms_norm(y, self.res, self.nw)


def _compile(job):
    name, m, cfg = job
    try:
        Case(name, m, 1).run(cfg, 0)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # shared memory, or a tile the compiler rejects
        return f"{name} m={m} {tuple(cfg)}: {type(e).__name__} {str(e)[:60]}"


def main(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,16,32,64,128,192,256")
    ap.add_argument("--only", default="o,down,gate_up,qkv")
    ap.add_argument("--jobs", type=int, default=14, help="processes compiling the variants first (0: none)")
    ap.add_argument("--copies", type=int, default=COPIES, help="weight copies (1: weights stay in L2)")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    names = args.only.split(",")
    jobs = [(name, m, cfg) for m in ms for name in names for cfg in variants(name, m)]
    if args.jobs:
        ctx = multiprocessing.get_context("spawn")
        with futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            for err in pool.map(_compile, jobs):
                if err:
                    print("  skip", err)
    torch.manual_seed(0)
    for m in ms:
        for name in names:
            configs = variants(name, m)
            if not configs:
                continue
            case = Case(name, m, args.copies)
            t_pred = per_call_us(lambda i: case.pred(), args.copies)
            t_cublas = per_call_us(lambda i: case.run(None, i), args.copies) - t_pred
            timed = []
            for cfg in configs:
                try:
                    timed.append((per_call_us(lambda i, c=cfg: case.run(c, i), args.copies) - t_pred, cfg))
                except Exception:
                    continue
            table = (float("nan"), configs[0])
            if timed and timed[0][1] == configs[0] and table_config(name, m) is not None:
                table = timed[0]
            best = sorted(timed, key=lambda t: t[0])[:3]
            weights = SHAPES[name][0] * SHAPES[name][1] * 2 / 4.3e12 * 1e6
            print(f"M={m:3d} {name:>7}: cuBLAS{'*' if name == 'qkv' else ''} {t_cublas:5.1f} | table {table[0]:5.1f} {tuple(table[1])} | best "
                  + ", ".join(f"{t:5.1f} {tuple(c)}" for t, c in best) + f" | weights at 4.3 TB/s {weights:4.1f} us (net us)",
                  flush=True)
