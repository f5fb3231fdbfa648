"""How fast can the device read? The roofline (bench.py) uses the copy bandwidth (read + write); decode
attention only reads, so its real ceiling is the read bandwidth. Measures, on one GPU:

  copy        torch copy_ of 2 GiB (read + write counted), as bench.py does
  sum         torch.sum over 4 GiB of bf16 (read-only)
  read        a Triton streaming read (pointer loads, contiguous), a few tile configurations
  read-rows   the paged-KV pattern: 256-byte rows (one head of one token) at a 2 KB stride, as decode
              attention reads a token-major cache [blocks, block_size, kv_heads=8, 128]
  read-tma    the same rows through tensor descriptors (TMA), where this Triton has them
  --l2        instead: the rate at which programs re-read [64, 128] bf16 tiles of a buffer that fits in L2
              through tensor descriptors, as the decode GEMMs re-read their operands (each activation
              tile once per output-column tile, each weight tile once per row tile)

    python scripts/bench_bandwidth.py [--l2]     (GPU)
"""
import sys

import torch
import triton
import triton.language as tl
import triton.testing


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for off in tl.range(0, n_per_prog, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _read_rows_kernel(x_ptr, out_ptr, rows_per_prog, heads, ROWS: tl.constexpr, D: tl.constexpr):
    # x: [tokens, heads, D]; program (head, chunk) reads `rows_per_prog` tokens of one head
    head = tl.program_id(0)
    chunk = tl.program_id(1)
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    acc = tl.zeros([ROWS, D], tl.float32)
    row0 = chunk.to(tl.int64) * rows_per_prog
    for off in tl.range(0, rows_per_prog, ROWS):
        ptrs = x_ptr + ((row0 + off + r) * heads + head)[:, None] * D + d[None, :]
        acc += tl.load(ptrs).to(tl.float32)
    tl.store(out_ptr + head * tl.num_programs(1) + chunk, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _read_rows_tma_kernel(desc, out_ptr, rows_per_prog, ROWS: tl.constexpr, D: tl.constexpr):
    head = tl.program_id(0)
    chunk = tl.program_id(1)
    acc = tl.zeros([ROWS, D], tl.float32)
    row0 = chunk * rows_per_prog
    for off in tl.range(0, rows_per_prog, ROWS):
        acc += desc.load([row0 + off, head * D]).to(tl.float32)
    tl.store(out_ptr + head * tl.num_programs(1) + chunk, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _reread_kernel(tile_desc, out_ptr, tiles_per_prog, num_tiles, ROWS: tl.constexpr, COLS: tl.constexpr,
                   STAGES: tl.constexpr):
    # Program pid reads tiles_per_prog consecutive tiles of the [num_tiles * ROWS, COLS] buffer, the
    # programs one after another (wrapping): with many more tile reads than tiles, all but the first
    # come from L2; with more tiles than reads (the 1 GB buffer), every read comes from HBM.
    start = (tl.program_id(0) * tiles_per_prog) % (num_tiles - tiles_per_prog + 1)
    acc = tl.zeros([ROWS, COLS], tl.float32)
    for i in tl.range(0, tiles_per_prog, num_stages=STAGES):
        acc += tile_desc.load([(start + i) * ROWS, 0]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


def l2_main():
    from triton.tools.tensor_descriptor import TensorDescriptor
    dev = "cuda"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, cols = 64, 128
    tile_bytes = rows * cols * 2
    for mbytes in (1, 4, 16, 32, 64, 1024):
        num_tiles = (mbytes << 20) // tile_bytes
        buf = torch.randn(num_tiles * rows, cols, dtype=torch.bfloat16, device=dev)
        desc = TensorDescriptor.from_tensor(buf, [rows, cols])
        for progs_per_sm, stages in ((1, 4), (2, 4), (1, 8)):
            progs = sms * progs_per_sm
            tiles_per_prog = min(num_tiles, 64)
            out = torch.empty(progs, dtype=torch.float32, device=dev)

            def fn():
                _reread_kernel[(progs,)](desc, out, tiles_per_prog, num_tiles, ROWS=rows, COLS=cols,
                                         STAGES=stages, num_warps=4, num_stages=stages)
            fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 20
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / reps
            print(f"re-read {mbytes:5d} MB buffer, {progs_per_sm} program(s)/SM, {stages} stages: "
                  f"{_tbps(progs * tiles_per_prog * tile_bytes, ms):.2f} TB/s ({ms * 1e3:.0f} us per launch)")


def _tbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e12


def main():
    dev = "cuda"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200)
    print(f"copy      2 GiB: {_tbps(2 * src.numel(), ms):.3f} TB/s (read + write)")
    del src, dst
    x = torch.randn(2 << 30, dtype=torch.bfloat16, device=dev)  # 4 GiB
    nbytes = x.numel() * 2
    ms = triton.testing.do_bench(lambda: x.sum(dtype=torch.float32), rep=200)
    print(f"sum       4 GiB: {_tbps(nbytes, ms):.3f} TB/s")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for progs_per_sm in (4, 8, 16):
        for block, warps, stages in ((4096, 4, 1), (4096, 8, 1), (8192, 8, 1), (4096, 4, 3), (8192, 8, 3)):
            progs = sms * progs_per_sm
            per = x.numel() // progs // block * block
            out = torch.empty(progs, dtype=torch.float32, device=dev)
            fn = lambda: _read_kernel[(progs,)](x, out, per, BLOCK=block, num_warps=warps, num_stages=stages)  # noqa: E731
            ms = triton.testing.do_bench(fn, rep=200)
            print(f"read      {progs_per_sm:2d}/SM block {block} warps {warps} stages {stages}: "
                  f"{_tbps(progs * per * 2, ms):.3f} TB/s")
    heads, d = 8, 128
    rows = x.view(-1, heads, d)
    tokens = rows.shape[0]
    for rows_tile, chunk_tokens, warps, stages in ((64, 1024, 4, 3), (64, 512, 4, 3), (64, 1024, 4, 4),
                                                   (128, 1024, 8, 3), (32, 1024, 4, 4)):
        chunks = tokens // chunk_tokens
        out = torch.empty(heads * chunks, dtype=torch.float32, device=dev)
        fn = lambda: _read_rows_kernel[(heads, chunks)](rows, out, chunk_tokens, heads, ROWS=rows_tile, D=d,  # noqa: E731
                                                        num_warps=warps, num_stages=stages)
        ms = triton.testing.do_bench(fn, rep=200)
        print(f"read-rows tile {rows_tile} x {d}, {chunk_tokens} tokens/program, warps {warps} stages {stages}: "
              f"{_tbps(heads * chunks * chunk_tokens * d * 2, ms):.3f} TB/s")
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        print("read-tma: no TensorDescriptor in this Triton")
        return
    flat = x.view(tokens, heads * d)
    for rows_tile, chunk_tokens, warps, stages in ((64, 1024, 4, 3), (64, 1024, 4, 4), (128, 1024, 4, 3),
                                                   (64, 512, 4, 3)):
        chunks = tokens // chunk_tokens
        out = torch.empty(heads * chunks, dtype=torch.float32, device=dev)
        desc = TensorDescriptor.from_tensor(flat, [rows_tile, d])
        fn = lambda: _read_rows_tma_kernel[(heads, chunks)](desc, out, chunk_tokens, ROWS=rows_tile, D=d,  # noqa: E731
                                                            num_warps=warps, num_stages=stages)
        try:
            ms = triton.testing.do_bench(fn, rep=200)
        except Exception as e:  # noqa: BLE001
            print(f"read-tma tile {rows_tile}: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"read-tma  tile {rows_tile} x {d}, {chunk_tokens} tokens/program, warps {warps} stages {stages}: "
              f"{_tbps(heads * chunks * chunk_tokens * d * 2, ms):.3f} TB/s")


if __name__ == "__main__":
    l2_main() if "--l2" in sys.argv[1:] else main()
