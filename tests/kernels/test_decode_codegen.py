"""What the FP8 KV cache's decode kernel compiles to on Hopper, checked on any machine: Triton compiles
it for sm_90 without a GPU (its bundled ptxas), in a subprocess outside the interpreter.

Over an FP8 cache the kernel's speed depends on how V reaches the P @ V product: converted to fp16 as
it is loaded and read through ldmatrix.trans, not read from shared memory one byte per instruction
(fp8.e4m3_to_fp16_as_loaded says why Triton would otherwise do the latter). No timing runs in CI, so
this holds the generated code to it."""
import json
import os
import subprocess
import sys

import pytest

# Qwen3-0.6B's attention (16 query heads on 8 KV heads of 128), 256-token blocks; the engine's tiles
# for FP8 launches: (BLOCK_G, BLOCK_N, num_warps, num_stages, PREFETCH_BLOCKS).
TILES = {"two warps": (16, 64, 2, 3, True), "four warps": (16, 64, 4, 3, True)}


def _compile_ptx(tile) -> str:
    """The PTX of the split kernel as paged_decode_attention launches it over an FP8 cache with a bf16
    q on an sm_90 GPU (its arguments captured from the wrapper, specialised as Triton's launcher does)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nanovllm.kernels import paged_decode

    launches = []
    paged_decode.launch = lambda fn, grid, args, kwargs, *rest: launches.append((fn, args, kwargs))
    paged_decode.has_e4m3_pair_conversion = lambda device: True  # as on sm_90
    hq, hkv, d, page, blocks, batch = 16, 8, 128, 256, 4, 2
    q = torch.zeros(batch, hq, d, dtype=torch.bfloat16)
    k_cache = torch.zeros(blocks, page, hkv, d, dtype=torch.float8_e4m3fn)
    tables = torch.zeros(batch, 2, dtype=torch.int32)
    seq_lens = torch.full((batch,), 300, dtype=torch.int32)
    scales = (torch.ones(hkv), torch.ones(hkv))
    paged_decode.paged_decode_attention(q, k_cache, k_cache.clone(), tables, seq_lens, d ** -0.5, num_splits=2,
                                        kv_scales=scales, _config=tile, order=seq_lens)
    fn, args, kwargs = launches[0]
    assert fn is paged_decode._decode_split_kernel and kwargs["E4M3_PAIRS"]
    types = {torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv", torch.int32: "*i32", torch.float32: "*fp32"}
    signature, constexprs, attrs = {}, {}, {}
    values = dict(zip(fn.arg_names, args))
    for index, name in enumerate(fn.arg_names):
        param = fn.params[index]
        if name in kwargs or param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(index,)] = kwargs[name] if name in kwargs else param.default
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = types[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # every cache and buffer is 16-byte aligned
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0 and index not in fn.do_not_specialize:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=kwargs["num_warps"], num_stages=kwargs["num_stages"]))
    return compiled.asm["ptx"]


@pytest.mark.parametrize("tile", list(TILES))
def test_fp8_decode_reads_v_in_vectors(tile):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the compile needs no GPU; the same on a GPU machine
    run = subprocess.run([sys.executable, __file__, tile], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    # The tile's values in 16-byte vectors, none a byte at a time; V through the transposing ldmatrix.
    assert counts["ld.shared.b8"] == 0, counts
    assert counts["ldmatrix.trans"] > 0, counts
    assert counts["e4m3x2 conversions"] > 0, counts


if __name__ == "__main__":
    ptx = _compile_ptx(TILES[sys.argv[1]])
    print(json.dumps({"ld.shared.b8": ptx.count("ld.shared.b8"),
                      "ldmatrix.trans": sum("ldmatrix" in line and ".trans" in line for line in ptx.splitlines()),
                      "e4m3x2 conversions": ptx.count("cvt.rn.f16x2.e4m3x2")}))
