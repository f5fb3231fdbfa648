"""Sweep the paged-decode kernel's tile configuration on ragged batches like the benchmark's.

    python scripts/tune.py decode            (on the GPU machine)
    python scripts/tune.py decode --buckets  (default config only, batch sizes 8-256: efficiency per
                                              batch size, the engine's split count against others)
    python scripts/tune.py decode --splits 8,16,24,32   (every split count 1-12 at these batch sizes, default config)
    python scripts/tune.py decode --kv-fp8   (the tiles over a float8_e4m3fn cache: half the bytes a tile, so
                                              the best tile, warps and depth may differ; the engine's dispatch
                                              order and split count only, ~60 configs a batch)
    python scripts/tune.py decode --batches "B=256 mid,B=32 tail"   (only these of the batches below)

For each batch (context lengths drawn like the nano-vllm workload at several points of its run)
it times every (BLOCK_N, num_warps, num_stages) with and without longest-first dispatch and a few
split counts, checks each result against the default configuration, and prints the bandwidth
reached as a fraction of the device copy bandwidth measured in the same run.
"""
import argparse
import itertools
import random

import torch
import triton.testing

from bench import measure_device
from nanovllm.kernels.decode_plan import alloc_decode_workspace, choose_num_splits, decode_config, launch_config
from nanovllm.kernels.paged_decode import paged_decode_attention

HQ, HKV, D, PAGE = 16, 8, 128, 256  # Qwen3-0.6B's attention, the default block size


def make_batch(lens, num_blocks):
    max_blocks = max(-(-n // PAGE) for n in lens)
    perm = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // PAGE)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    order = torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)
    q = torch.randn(len(lens), HQ, D, dtype=torch.bfloat16, device="cuda")
    return q, tables, seq_lens, order


def buckets(bw, k_cache, v_cache, ws, num_blocks, configs):
    """Tile configurations at the batch sizes the benchmark's decode steps go through (contexts as
    late in the run, when small batches hold the longest requests): the engine's split count against
    fixed ones, as a fraction of the copy bandwidth."""
    block_g = decode_config(D, HQ // HKV)[0]
    for cfg in configs:
        print(f"BLOCK_N, warps, stages, PREFETCH_BLOCKS = {cfg}"
              + (" (default)" if cfg == decode_config(D, HQ // HKV)[1:] else ""))
        buckets_one(bw, k_cache, v_cache, ws, num_blocks, (block_g, *cfg))


def late_lens(batch: int) -> list[int]:
    """Context lengths of a decode batch of this size in the benchmark's run: the fewer sequences are
    left, the further the run has gone (prompt U(100, 1024) plus that share of U(100, 1024) outputs)."""
    late = 1.0 - batch / 256
    return [random.randint(100, 1024) + int(random.randint(100, 1024) * late) for _ in range(batch)]


def buckets_one(bw, k_cache, v_cache, ws, num_blocks, config):
    random.seed(1)
    for batch in (8, 16, 32, 48, 64, 96, 128, 192, 256):
        lens = late_lens(batch)
        q, tables, seq_lens, order = make_batch(lens, num_blocks)
        kv_bytes = sum(lens) * HKV * D * 2 * 2
        engine = choose_num_splits(batch, HQ, HKV, D, q.device, 4096)
        line = f"B={batch:3d} ctx~{sum(lens) // batch:4d} KV {kv_bytes / 1e6:6.1f} MB:"
        for splits in sorted({engine, 1, 2, 4, 8}):
            def call():
                return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, D ** -0.5, num_splits=splits,
                                              workspace=ws, order=order, _config=config)
            try:
                us = triton.testing.do_bench_cudagraph(call, rep=30, return_mode="median") * 1e3
            except Exception as e:  # shared memory
                line += f"  s={splits}: {type(e).__name__}"
                continue
            mark = "*" if splits == engine else ""
            line += f"  s={splits}{mark} {us:6.1f} us {kv_bytes / (us * 1e-6) / bw:4.0%}"
        print(line, flush=True)


def split_sweep(bw, k_cache, v_cache, ws, num_blocks, batches):
    """Every split count at each batch size (contexts as in `buckets_one`): the data behind
    `choose_num_splits`."""
    random.seed(1)
    for batch in batches:
        lens = late_lens(batch)
        q, tables, seq_lens, order = make_batch(lens, num_blocks)
        kv_bytes = sum(lens) * HKV * D * 2 * 2
        engine = choose_num_splits(batch, HQ, HKV, D, q.device, 4096)
        times = {}
        for splits in sorted(set(range(1, 13)) | {engine}):
            def call():
                return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, D ** -0.5, num_splits=splits,
                                              workspace=ws, order=order)
            times[splits] = triton.testing.do_bench_cudagraph(call, rep=30, return_mode="median") * 1e3
        best = min(times, key=times.get)
        print(f"B={batch:3d} ctx~{sum(lens) // batch:4d}: engine s={engine} {times[engine]:6.1f} us "
              f"({kv_bytes / (times[engine] * 1e-6) / bw:4.0%}), best s={best} {times[best]:6.1f} us | "
              + " ".join(f"{s}:{t:.1f}" for s, t in times.items()), flush=True)


def main(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", action="store_true", help="a few configs at batch sizes 8-256 only")
    ap.add_argument("--configs", default="64,4,3,1 64,4,3,0 64,4,4,1",
                    help="with --buckets: BLOCK_N,warps,stages,prefetch_blocks (0/1); the first is the default")
    ap.add_argument("--splits", help="comma-separated batch sizes: every split count 1-12 at each")
    ap.add_argument("--kv-fp8", action="store_true",
                    help="the tiles over an FP8 cache (per-head scales 1.0), at the engine's order and split count")
    ap.add_argument("--batches", help="comma-separated batch names (e.g. 'B=256 mid'): only these")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    random.seed(0)
    bw = measure_device(torch.device("cuda"))[0]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    num_blocks = 256 * 9
    k_cache = torch.randn(num_blocks, PAGE, HKV, D, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    ws = alloc_decode_workspace(256, HQ, D, 64, "cuda")
    if args.splits:
        return split_sweep(bw, k_cache, v_cache, ws, num_blocks, [int(v) for v in args.splits.split(",")])
    if args.buckets:
        configs = [(*(int(v) for v in c.split(",")[:3]), c.split(",")[3] == "1") for c in args.configs.split()]
        return buckets(bw, k_cache, v_cache, ws, num_blocks, configs)
    # Context lengths over the benchmark's run: prompts U(100, 1024) plus the tokens generated so far.
    batches = {
        "B=256 early": [random.randint(100, 1024) + 50 for _ in range(256)],
        "B=256 mid": [random.randint(100, 1024) + random.randint(100, 600) for _ in range(256)],
        "B=128 late": [random.randint(100, 1024) + random.randint(500, 900) for _ in range(128)],
        "B=32 tail": [random.randint(100, 1024) + random.randint(900, 1000) for _ in range(32)],
    }
    if args.batches:
        unknown = set(args.batches.split(",")) - set(batches)
        if unknown:
            raise SystemExit(f"--batches: unknown {sorted(unknown)}; the batches are {list(batches)}")
        batches = {name: lens for name, lens in batches.items() if name in args.batches.split(",")}
    block_g = decode_config(D, HQ // HKV)[0]
    configs = [(block_g, n, w, s, pf) for n, w, s, pf in itertools.product((32, 64, 128), (4, 8), (2, 3, 4),
                                                                          (False, True))]
    value_bytes, scales = 2, None
    if args.kv_fp8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        value_bytes, scales = 1, (torch.ones(HKV, device="cuda"), torch.ones(HKV, device="cuda"))
        configs += [(block_g, n, 2, s, pf) for n, s, pf in itertools.product((32, 64, 128), (3, 4, 5), (False, True))]
        configs += [(block_g, n, 4, 5, pf) for n, pf in itertools.product((32, 64, 128), (False, True))]
    for name, lens in batches.items():
        q, tables, seq_lens, order = make_batch(lens, num_blocks)
        kv_bytes = sum(lens) * HKV * D * 2 * value_bytes
        expect = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, D ** -0.5, workspace=ws,
                                        kv_scales=scales)
        results = []
        splits_options = (1, 2) if len(lens) >= 128 else (None, 1, 2, 4)
        # Over an FP8 cache only the tile is in question: a full product took over 250 s before its first batch.
        orders, splits_options = ((False,), splits_options[:1]) if args.kv_fp8 else ((False, True), splits_options)
        for cfg, use_order, splits in itertools.product(configs, orders, splits_options):
            def call():
                return paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, D ** -0.5, num_splits=splits,
                                              workspace=ws, order=order if use_order else None, _config=cfg,
                                              kv_scales=scales)
            try:
                out = call()
                torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
                ms = triton.testing.do_bench_cudagraph(call, rep=50, return_mode="median")
            except Exception as e:  # an invalid config (shared memory) is skipped, not fatal
                print(f"  {cfg} order={use_order} splits={splits}: {type(e).__name__}: {str(e)[:80]}")
                continue
            results.append((ms, cfg, use_order, splits))
        results.sort(key=lambda r: r[0])
        # The engine's tile for this launch (its warps follow the programs per SM over an FP8 cache).
        splits = splits_options[0] or choose_num_splits(len(lens), HQ, HKV, D, q.device)
        engine = launch_config(len(lens), HQ, HKV, D, q.device, splits, kv_fp8=args.kv_fp8)
        default = next(r for r in results if r[1] == engine and not r[2] and r[3] == splits_options[0])
        print(f"{name}: sum ctx {sum(lens)}, KV {kv_bytes / 1e9:.2f} GB; default config "
              f"{default[0] * 1e3:.1f} us = {kv_bytes / (default[0] * 1e-3) / bw:.1%} of copy BW")
        for ms, cfg, use_order, splits in results[:8]:
            print(f"  {ms * 1e3:7.1f} us  {kv_bytes / (ms * 1e-3) / bw:6.1%}  BLOCK_N={cfg[1]:3d} warps={cfg[2]} "
                  f"stages={cfg[3]} prefetch_blocks={cfg[4]} longest_first={use_order} splits={splits}")
