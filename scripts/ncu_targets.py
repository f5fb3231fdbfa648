"""Small launches of the decode step's kernels for Nsight Compute (`ncu`), which replays one launch
with the caches flushed and reads the hardware counters: where a kernel's time goes (DRAM
throughput, issue slots, stall reasons), not how long it takes in a step.

    ncu --clock-control none --kernel-name regex:_decode_split_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python scripts/ncu_targets.py decode 256
    ncu ... --kernel-name regex:_gemm_kernel ... python scripts/ncu_targets.py o 16    (GPU)

Targets: `decode B` (decode attention on B sequences with the benchmark's context lengths late in its run,
as scripts/tune_decode.py), `o M` / `down M` (the split-K projection at M rows), `gate_up M` (the gated
GEMM), `qkv M` (the fused qkv + rotary kernel). Each is launched four times.
"""
import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.gemm import dense_config, gated_linear, splitk_linear  # noqa: E402
from nanovllm.kernels.paged_decode import alloc_decode_workspace, paged_decode_attention  # noqa: E402
from nanovllm.kernels.qkv_rope import qkv_rope_store_kv  # noqa: E402
from tune_decode import D, HKV, HQ, PAGE, late_lens, make_batch  # noqa: E402

HIDDEN, INTER = 1024, 3072
LAUNCHES = 4


def decode(batch: int):
    random.seed(1)
    lens = late_lens(batch)
    num_blocks = sum(-(-n // PAGE) for n in lens) + 8
    k_cache = torch.randn(num_blocks, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q, tables, seq_lens, order = make_batch(lens, num_blocks)
    ws = alloc_decode_workspace(batch, HQ, D, 64, q.device)
    print(f"decode: {batch} sequences, mean context {sum(lens) // batch}, "
          f"{sum(lens) * HKV * D * 4 / 1e6:.1f} MB of K/V")
    return lambda: paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, D ** -0.5, workspace=ws, order=order)


def projection(name: str, rows: int):
    dt = torch.bfloat16
    if name in ("o", "down"):
        k = 2048 if name == "o" else INTER
        x, w = torch.randn(rows, k, dtype=dt, device="cuda"), torch.randn(HIDDEN, k, dtype=dt, device="cuda") * 0.02
        return lambda: splitk_linear(x, w)
    x = torch.randn(rows, HIDDEN, dtype=dt, device="cuda")
    if name == "gate_up":
        w = torch.randn(2 * INTER, HIDDEN, dtype=dt, device="cuda") * 0.02
        config = dense_config(rows, w.shape[0], HIDDEN, gated=True)
        return lambda: gated_linear(x, w, config)
    w = torch.randn((HQ + 2 * HKV) * D, HIDDEN, dtype=dt, device="cuda") * 0.02
    cache = torch.zeros(rows // PAGE + 2, PAGE, HKV, D, dtype=dt, device="cuda")
    positions = torch.arange(rows, device="cuda")
    slots = torch.arange(rows, device="cuda")
    cos_sin = torch.randn(4096, D, dtype=torch.float32, device="cuda")
    norm_w = torch.ones(D, dtype=dt, device="cuda")
    return lambda: qkv_rope_store_kv(x, w, HQ, HKV, positions, cos_sin, cache, cache.clone(), slots, norm_w, norm_w)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("target", choices=["decode", "o", "down", "gate_up", "qkv"])
    ap.add_argument("size", type=int, help="sequences (decode) or rows (projections)")
    args = ap.parse_args()
    fn = decode(args.size) if args.target == "decode" else projection(args.target, args.size)
    for _ in range(LAUNCHES):
        fn()
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
