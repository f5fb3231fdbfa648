"""The qkv projection with rotary + K/V store in its epilogue (kernels/qkv_rope.py) against the pair it
replaces (our dense GEMM or cuBLAS, then the rotary kernel), Qwen3-0.6B shapes, per batch size, over a
small tile sweep. Weights rotate over 8 copies (they come from HBM, as in a model); CUDA graphs.

    python scripts/bench_qkv_rope.py [--m 16,32,64,128]   (GPU)
"""
import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.fused_ops import qk_norm_rope_store_kv  # noqa: E402
from nanovllm.kernels.gemm import GemmConfig, dense_config, dense_linear  # noqa: E402
from nanovllm.kernels.qkv_rope import QkvRopeConfig, qkv_rope_config, qkv_rope_store_kv  # noqa: E402
from nanovllm.layers.rotary import RotaryEmbedding  # noqa: E402
from bench_gemm_tiles import COPIES, per_call_us  # noqa: E402  (scripts/ is sys.path[0])

HQ, HKV, D, HIDDEN = 16, 8, 128, 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="16,32,64,128")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    ws = [torch.randn((HQ + 2 * HKV) * D, HIDDEN, dtype=dt, device=dev) * 0.03 for _ in range(COPIES)]
    rope = RotaryEmbedding(D, 4096, 1e6).to(dev)
    qn, kn = torch.ones(D, dtype=dt, device=dev), torch.ones(D, dtype=dt, device=dev)
    cache = torch.zeros(2, 512, 256, HKV, D, dtype=dt, device=dev)
    for m in [int(v) for v in args.m.split(",")]:
        x = torch.randn(m, HIDDEN, dtype=dt, device=dev)
        pos = torch.randint(0, 4000, (m,), device=dev)
        slots = torch.randperm(512 * 256, device=dev)[:m]

        def pair(i, gemm):
            qkv = gemm(i)
            q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
            return qk_norm_rope_store_kv(q.unflatten(-1, (HQ, D)), k.unflatten(-1, (HKV, D)), v.unflatten(-1, (HKV, D)),
                                         pos, rope.cos_sin_cache, cache[0], cache[1], slots, qn, kn)

        table = dense_config(m, (HQ + 2 * HKV) * D, HIDDEN) or GemmConfig(1, 64, 64, 128, 4, 4)
        line = f"M={m:3d}: cuBLAS+rope {per_call_us(lambda i: pair(i, lambda j: F.linear(x, ws[j]))):5.1f} us"
        line += f" | ours {tuple(table)}+rope {per_call_us(lambda i: pair(i, lambda j: dense_linear(x, ws[j], table))):5.1f}"
        expect = pair(0, lambda j: dense_linear(x, ws[j], table))
        results = []
        for bm, warps, stages in itertools.product((16, 32, 64, 128), (4, 8), (3, 4)):
            if bm > max(64, m) or (bm == 128 and warps == 4):
                continue
            cfg = QkvRopeConfig(bm, 128, warps, stages)
            try:
                fn = lambda i, cfg=cfg: qkv_rope_store_kv(x, ws[i], HQ, HKV, pos, rope.cos_sin_cache,  # noqa: E731
                                                          cache[0], cache[1], slots, qn, kn, config=cfg)
                err = (fn(0).float() - expect.float()).abs().max().item()
                results.append((per_call_us(fn), cfg, err))
            except Exception as e:
                print(f"  {cfg}: {type(e).__name__} {str(e)[:80]}")
        results.sort(key=lambda r: r[0])
        table_cfg = qkv_rope_config(m, HIDDEN, D)
        line += " | fused best " + ", ".join(f"{t:5.1f} {tuple(c)} err {e:.2g}" for t, c, e in results[:3])
        line += f" | table {tuple(table_cfg) if table_cfg else None}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
