"""Is decode attention below the read ceiling because of its arithmetic, or because of what it reads? The
engine's kernel against a kernel with the same grid and the same paged loads (block ids one tile ahead, K and V
tiles of BLOCK_N x D) that either runs attention's two products without the softmax (`dots`: its loads are pipelined
through shared memory as attention's are) or only sums the tiles (`loads`: plain loads into registers). Each at equal
lengths (no raggedness), over:

  paged       the engine's cache layout with block tables in random order, as in a run
  contiguous  the same with each sequence's blocks in order (block table = arange)
  kv-adjacent K and V of one token and head side by side (one [blocks, page, heads, 2, D] tensor: 512 bytes
              in a row instead of two 256-byte rows in two tensors); the engine's kernel takes it through
              its strides unchanged
  k-only      the loads-only kernel reading K alone (half the bytes: one stream per program)

and, on the paged layout, the engine's kernel without software pipelining (`UNPIPELINED`).

If `dots` or `loads` reads near the ceiling (`bench_bandwidth.py`: ~4.55-4.65 TB/s) and attention does not, the
softmax holds the loads back; if all stop at the same rate, the access pattern is the limit.

    python scripts/probe_decode_loads.py     (GPU)
"""
import os
import sys

import torch
import triton
import triton.language as tl
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.paged_decode import _decode_config, paged_decode_attention  # noqa: E402

HQ, HKV, D, PAGE = 16, 8, 128, 256
# The engine's kernel without software pipelining (num_stages=1: loads straight into registers, as `loads` does,
# and more programs per SM), at 4 and 8 warps: `_decode_config`'s tuple (BLOCK_G, BLOCK_N, warps, stages, prefetch).
UNPIPELINED = {"attention 1 stage": (16, 64, 4, 1, False), "attention 1 stage 8 warps": (16, 64, 8, 1, False),
               "attention 1 stage BLOCK_N 128": (16, 128, 8, 1, False)}


@triton.jit
def _paged_loads_kernel(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
                        stride_kb, stride_kt, stride_kh, stride_bt,
                        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, WITH_V: tl.constexpr,
                        DOTS: tl.constexpr):
    kv_head = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    acc = tl.zeros([BLOCK_N, D], tl.float32)
    q = tl.full([16, D], 0.01, k_cache_ptr.dtype.element_ty)
    acc_dots = tl.zeros([16, D], tl.float32)
    blk_next = tl.load(bt_row + offs_n // PAGE_SIZE, mask=offs_n < seq_len, other=0)
    k_head = k_cache_ptr + kv_head * stride_kh
    v_head = v_cache_ptr + kv_head * stride_kh
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + offs_n
        blk = blk_next.to(tl.int64)
        blk_next = tl.load(bt_row + (pos + BLOCK_N) // PAGE_SIZE, mask=pos + BLOCK_N < seq_len, other=0)
        row = (blk * stride_kb + (pos % PAGE_SIZE) * stride_kt)[:, None] + d[None, :]
        mask = (pos < seq_len)[:, None]
        k = tl.load(k_head + row, mask=mask, other=0.0)
        if DOTS:  # attention's two products, no softmax: its loads are pipelined as attention's are
            s = tl.dot(q, tl.trans(k))
            v = tl.load(v_head + row, mask=mask, other=0.0)
            acc_dots = tl.dot(s.to(v.dtype), v, acc_dots)
        else:
            acc += k.to(tl.float32)
            if WITH_V:
                acc += tl.load(v_head + row, mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(tl.sum(acc_dots, 1), 0) if DOTS else tl.sum(tl.sum(acc, 1), 0)
    tl.store(out_ptr + b * tl.num_programs(0) + kv_head, total)


def run_stand_in(k_cache, v_cache, tables, lens, out, with_v=True, dots=False):
    """Sums the tiles (plain loads into registers), or with `dots` runs attention's two products on them
    without the softmax (loads then pipelined through shared memory, as attention's are)."""
    assert k_cache.stride() == v_cache.stride()
    _, block_n, warps, stages, _ = _decode_config(D, HQ // HKV)
    _paged_loads_kernel[(HKV, lens.numel())](
        k_cache, v_cache, tables, lens, out, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        PAGE_SIZE=PAGE, BLOCK_N=block_n, D=D, WITH_V=with_v, DOTS=dots, num_warps=warps, num_stages=stages)


def main():
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    tokens = 262144
    blocks = tokens // PAGE
    separate = (torch.randn(blocks, PAGE, HKV, D, dtype=torch.bfloat16, device=dev),
                torch.randn(blocks, PAGE, HKV, D, dtype=torch.bfloat16, device=dev))
    adjacent = torch.randn(blocks, PAGE, HKV, 2, D, dtype=torch.bfloat16, device=dev)
    layouts = {"paged": (separate, torch.randperm(blocks, device=dev)),
               "contiguous": (separate, torch.arange(blocks, device=dev)),
               "kv-adjacent": ((adjacent[..., 0, :], adjacent[..., 1, :]), torch.randperm(blocks, device=dev))}
    kv_bytes = 2 * tokens * HKV * D * 2
    print(f"{tokens} cached tokens ({kv_bytes / 1e9:.2f} GB of K/V), one split (a program per sequence and KV head), "
          "TB/s (us):")
    for length in (512, 1024, 2048, 8192):
        batch = tokens // length
        q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device=dev)
        lens = torch.full((batch,), length, dtype=torch.int32, device=dev)
        sink = torch.empty(batch * HKV, dtype=torch.float32, device=dev)
        row = []
        for name, ((k_cache, v_cache), perm) in layouts.items():
            tables = perm.to(torch.int32).view(batch, length // PAGE)
            runs = {"attention": lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5,
                                                                num_splits=1),
                    "dots": lambda: run_stand_in(k_cache, v_cache, tables, lens, sink, dots=True),
                    "loads": lambda: run_stand_in(k_cache, v_cache, tables, lens, sink)}
            if name == "paged":
                runs["k-only"] = lambda: run_stand_in(k_cache, v_cache, tables, lens, sink, with_v=False)
                for label, config in UNPIPELINED.items():
                    runs[label] = lambda config=config: paged_decode_attention(
                        q, k_cache, v_cache, tables, lens, D ** -0.5, num_splits=1, _config=config)
            for kind, fn in runs.items():
                us = triton.testing.do_bench(fn, warmup=20, rep=200, return_mode="median") * 1e3
                nbytes = kv_bytes // 2 if kind == "k-only" else kv_bytes
                row.append(f"{name} {kind} {nbytes / us / 1e6:4.2f} ({us:.0f})")
        print(f"  B={batch:4d} L={length:5d}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
