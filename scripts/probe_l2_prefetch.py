"""Does `cp.async.bulk.prefetch.L2` bring a region into L2? Reads a 24 MB region of a 1 GB buffer after
flushing L2 (from HBM), and after bulk-prefetching it in chunks of 4 KB-512 KB and waiting: if the prefetch
lands, the read runs at L2 speed.

    python scripts/probe_l2_prefetch.py     (GPU, sm_90)
"""
from statistics import median

import torch
import triton
import triton.language as tl


@triton.jit
def _prefetch_kernel(x_ptr, chunk_elems, chunk_bytes):
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [x_ptr + tl.program_id(0).to(tl.int64) * chunk_elems, chunk_bytes],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr):
    base = x_ptr + tl.program_id(0).to(tl.int64) * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for off in tl.range(0, n_per_prog, BLOCK):
        acc += tl.load(base + off + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def main():
    dev = "cuda"
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    buf = torch.randn(512 << 20, dtype=torch.bfloat16, device=dev)  # 1 GB
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    region_bytes = 24 << 20
    region = buf[(300 << 20):(300 << 20) + region_bytes // 2]
    progs = 264
    per = region.numel() // progs // 4096 * 4096
    out = torch.empty(progs, dtype=torch.float32, device=dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def read_us():
        start.record()
        _read_kernel[(progs,)](region, out, per, BLOCK=4096, num_warps=8)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3

    def trial(chunk_bytes):
        flush.zero_()
        torch.cuda.synchronize()
        if chunk_bytes:
            _prefetch_kernel[(region_bytes // chunk_bytes,)](region, chunk_bytes // 2, chunk_bytes, num_warps=1)
            torch.cuda._sleep(200_000)  # ~100 us: let the prefetches land
        return read_us()

    read_us()  # compile
    trial(65536)
    for chunk in (0, 4096, 16384, 65536, 131072, 524288, 0, 131072):
        us = median(trial(chunk) for _ in range(5))
        nbytes = progs * per * 2
        print(f"prefetch chunk {chunk // 1024:4d} KB: read {us:6.1f} us "
              f"({nbytes / us / 1e6:.2f} TB/s)" + ("   (no prefetch: from HBM)" if not chunk else ""))


if __name__ == "__main__":
    main()
