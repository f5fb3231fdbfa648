"""How Triton pipelines our decode kernels on Hopper, without a GPU: compile for sm_90 and print the
shared memory and the multi-buffered loads (the depth of each `local_alloc` is the number of tiles a
program keeps in flight).

    python scripts/kernel_ir.py            (any machine with triton; ptxas ships with it)

The arguments carry the divisibility hints the JIT derives at a real launch (pointers and strides
divisible by 16): without them Triton cannot use async copies and pipelines nothing.
"""
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm.kernels.gemm import _gemm_kernel  # noqa: E402
from nanovllm.kernels.paged_decode import _decode_split_kernel  # noqa: E402
from nanovllm.kernels.paged_decode_balanced import _balanced_decode_kernel  # noqa: E402
from nanovllm.kernels.paged_prefill import _prefill_kernel  # noqa: E402

_DECODE_PTRS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "order_ptr": "*i32", "out_ptr": "*bf16", "part_o_ptr": "*fp32",
                "part_lse_ptr": "*fp32"}


def compile_sm90(fn, constexprs, pointer_type, divisible, num_warps, num_stages):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_type(name)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name.endswith("_desc"):  # a TMA tensor descriptor: its type names the block shape
            signature[name] = pointer_type(name)
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if divisible(name):
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    buffers = re.findall(r"ttg.local_alloc : \(\) -> !ttg.memdesc<([0-9x]+\w+)", compiled.asm["ttgir"])
    return compiled.metadata.shared, buffers, registers(compiled)


def registers(compiled) -> int | None:
    """Registers per thread of the compiled sm_90 kernel (cuobjdump, shipped with Triton)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+)", usage)
    return int(found.group(1)) if found else None


def main():
    print("paged decode (Qwen3-0.6B: GQA 2, D=128, block 256, BLOCK_N=64, 4 warps)")
    for prefetch in (False, True):
        for stages in (2, 3, 4):
            consts = dict(GROUP=2, HEAD_BLOCKS=1, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=256, BLOCK_N=64,
                          DIRECT_OUT=True, HAS_ORDER=True, DOT_PREC="tf32", PREFETCH_BLOCKS=prefetch)
            shared, buffers, regs = compile_sm90(
                _decode_split_kernel, consts, _DECODE_PTRS.get,
                lambda n: (n.startswith("stride") and n != "stride_bt") or n == "num_q_heads", 4, stages)
            print(f"  PREFETCH_BLOCKS={prefetch!s:5} num_stages={stages}: shared {shared:6d} B, {regs} registers, "
                  f"buffers {buffers}")
    print("balanced paged decode (kernels/paged_decode_balanced.py, same shapes)")
    for stages in (2, 3, 4):
        consts = dict(GROUP=2, HEAD_BLOCKS=1, UNITS=8, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=256, BLOCK_N=64,
                      BLOCK_B=512, DOT_PREC="tf32")
        shared, buffers, regs = compile_sm90(_balanced_decode_kernel, consts, _DECODE_PTRS.get,
                                             lambda n: n.startswith("stride") and n != "stride_bt", 4, stages)
        print(f"  num_stages={stages}: shared {shared:6d} B, {regs} registers, buffers {buffers}")
    print("paged prefill (Qwen3-0.6B: GQA 2, D=128, block 256, BLOCK_N=64; K/V by pointers or TMA descriptors)")
    prefill_types = {"cu_seqlens_q_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
                     "k_desc": "tensordesc<bf16[64, 128]>", "v_desc": "tensordesc<bf16[64, 128]>"}
    for block_m, warps in ((128, 8), (256, 16)):
        for kv_desc in (False, True):
            for stages in (2, 3, 4):
                consts = dict(GROUP=2, BLOCK_Q=block_m // 2, BLOCK_M=block_m, BLOCK_N=64, HEAD_DIM=128, BLOCK_D=128,
                              PAGE_SIZE=256, DOT_PREC="tf32", KV_DESC=kv_desc)
                shared, buffers, regs = compile_sm90(
                    _prefill_kernel, consts, lambda n: prefill_types.get(n, "*bf16"),
                    lambda n: n.startswith("stride") and n != "stride_bt", warps, stages)
                print(f"  BLOCK_M={block_m} warps={warps} KV_DESC={kv_desc!s:5} num_stages={stages}: "
                      f"shared {shared:6d} B, {regs} registers, buffers {buffers}")
    print("decode GEMM (split-K partials, M<=16 tile)")
    for stages in (2, 3):
        consts = dict(K_SPLIT=512, BM=16, BN=32, BK=128, GATED=False, PARTIALS=True)
        types = {"a_desc": "tensordesc<bf16[16, 128]>", "w_desc": "tensordesc<bf16[32, 128]>", "out_ptr": "*fp32"}
        shared, buffers, _ = compile_sm90(_gemm_kernel, consts, types.get,
                                          lambda n: n.startswith("stride") or n == "N", 4, stages)
        print(f"  num_stages={stages}: shared {shared:6d} B, buffers {buffers}")


if __name__ == "__main__":
    main()
