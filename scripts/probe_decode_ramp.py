"""Does decode attention lose bandwidth per program (its start and end) rather than per byte? The same
KV bytes (every sequence one length, no raggedness) cut into programs of different lengths: B sequences
of L tokens, S splits, B x L fixed. If shorter programs read slower, the loss is the per-program ramp.

    python scripts/probe_decode_ramp.py [--tokens 262144]   (GPU)
"""
import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.paged_decode import alloc_decode_workspace, choose_num_splits, paged_decode_attention  # noqa: E402

HQ, HKV, D, PAGE = 16, 8, 128, 256


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=262144, help="B x L, the same for every shape")
    args = ap.parse_args()
    dev = torch.device("cuda")
    blocks = args.tokens // PAGE
    k_cache = torch.randn(blocks, PAGE, HKV, D, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(blocks, device=dev).to(torch.int32)
    kv_bytes = 2 * args.tokens * HKV * D * 2
    print(f"{args.tokens} cached tokens per layer ({kv_bytes / 1e9:.2f} GB of K/V), us and TB/s:")
    for length in (512, 1024, 2048, 4096, 8192):
        batch = args.tokens // length
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
        tables = perm.view(batch, length // PAGE)
        lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
        engine = choose_num_splits(batch, HQ, HKV, D, dev, length)
        row = []
        for splits in sorted({1, 2, 4, engine}):
            ws = alloc_decode_workspace(batch, HQ, D, splits, dev)
            fn = lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5, num_splits=splits,
                                                workspace=ws)
            us = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median") * 1e3
            programs = batch * HKV * splits
            row.append(f"S={splits}{'*' if splits == engine else ''}: {us:6.1f} us {kv_bytes / us / 1e6:4.2f} "
                       f"({programs} programs of {length // splits} keys)")
        print(f"  B={batch:4d} L={length:5d}  " + "   ".join(row), flush=True)


if __name__ == "__main__":
    main()
