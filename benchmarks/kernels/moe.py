"""The fused-MoE kernels of one Qwen3-30B-A3B layer (128 experts, 8 per token, hidden 2048, expert
intermediate 768, bf16) against a plain torch per-expert loop, at decode and prefill token counts.

    python scripts/gpu_kernels.py moe [--tokens 1,8,64,256,4096] [--tp 2] [--sweep [--block-m 16,32]]      (GPU)
    python scripts/gpu_kernels.py moe --fp8 [--sweep]     block-FP8 experts (W8A8: activations in 1 x 128 groups)

Per token count T: the fused path (router GEMM, top-k, align, gate_up, down; one CUDA graph over
COPIES layers' weights, so every call streams its experts from HBM as in a model) and its stages
timed alone, the torch loop (router, softmax/top-k, then for every routed expert: gather, gate_up,
SiLU, down, weight, index_add; eager: it syncs to find the experts), the ratio, and at decode sizes
the achieved bandwidth: the bytes of the routed experts' weights (+ the router) over the time, against
the copy bandwidth measured as bench.py measures it. First a bf16 check of the fused output against the
loop at every T. --sweep: each GEMM's tiles over a grid of variants at each T (the table's entry first),
the best per GEMM printed as a `moe_gemm._TABLE` candidate. --fp8: the experts in block FP8 (one byte a
weight, fp32 scales per 128 x 128 block), the torch loop over their dequantized form, the bytes counted
at a byte a weight; the check's tolerance then covers the activations' two e4m3 roundings.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.testing

from bench import measure_device
from nanovllm.kernels.fp8_quant import per_token_group_quant
from nanovllm.kernels.moe_gemm import MoeTile, moe_config, moe_down, moe_gate_up, parts_dtype
from nanovllm.kernels.moe_routing import route
from nanovllm.layers.quantization.fp8 import dequantize_experts, quantize_experts

E, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
COPIES = 4  # layers' weights the timed graph rotates over (4 x 1.2 GB: far past L2)
DECODE_MAX = 512


def per_call_us(fn, copies: int = COPIES) -> float:
    """fn(i) for each layer copy i, captured in one graph; microseconds per call."""
    return triton.testing.do_bench_cudagraph(lambda: [fn(i) for i in range(copies)], rep=30) * 1e3 / copies


class Layer:
    def __init__(self, inter: int, dtype, device, seed: int, fp8: bool = False):
        """fp8: w13 / w2 in block FP8 with their scales s13 / s2; ref13 / ref2 their dequantized form (the
        torch loop's); else all four name the 16-bit weights (s13 = s2 = None)."""
        g = torch.Generator(device=device).manual_seed(seed)
        self.router = torch.randn(E, HIDDEN, generator=g, device=device, dtype=dtype) * HIDDEN ** -0.5
        self.w13 = torch.randn(E, 2 * inter, HIDDEN, generator=g, device=device, dtype=dtype) * HIDDEN ** -0.5
        self.w2 = torch.randn(E, HIDDEN, inter, generator=g, device=device, dtype=dtype) * inter ** -0.5
        self.ref13, self.ref2, self.s13, self.s2 = self.w13, self.w2, None, None
        if fp8:
            (self.w13, self.s13), (self.w2, self.s2) = quantize_experts(self.w13), quantize_experts(self.w2)
            self.ref13, self.ref2 = dequantize_experts(self.w13, self.s13, dtype), dequantize_experts(self.w2, self.s2, dtype)


def gate_up(x, layer: Layer, routing, tile):
    """The gated GEMM as the engine runs it (FP8 experts: on x quantized in 1 x 128 groups)."""
    if layer.s13 is None:
        return moe_gate_up(x, layer.w13, routing, tile)
    return moe_gate_up(per_token_group_quant(x), layer.w13, routing, tile, layer.s13)


def down(act, layer: Layer, routing, tile, parts):
    if layer.s2 is None:
        return moe_down(act, layer.w2, routing, tile, parts)
    return moe_down(per_token_group_quant(act), layer.w2, routing, tile, parts, layer.s2)


def fused(x, layer: Layer, config, parts):
    routing = route(F.linear(x, layer.router), TOP_K, config.block_m, True, True)
    down(gate_up(x, layer, routing, config.gate_up), layer, routing, config.down, parts)
    return routing


def torch_loop(x, layer: Layer):
    """HF's eager experts loop (layers/fused_moe.SparseMoeBlock's CPU path) on the GPU."""
    probs = F.softmax(F.linear(x, layer.router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, TOP_K, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        slot, token = torch.where((ids == e).T)
        gate, up = F.linear(x[token], layer.ref13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, layer.ref2[e]) * weights[token, slot, None]
        out.index_add_(0, token, h)
    return out


def eager_us(fn, reps: int = 10) -> float:
    return triton.testing.do_bench(fn, warmup=3, rep=reps * 5) * 1e3


def tile_variants(base: MoeTile, gated: bool, block_m: int, fp8: bool = False):
    """The table's tile first (and it with TMA weights), then column widths x depths x pipeline depths, the
    weights by pointers and through TMA descriptors. fp8: one 128-deep K block a step, BN dividing 128,
    pointer loads (the W8A8 kernels' constraints), over widths x warps x pipeline depths."""
    if fp8:
        out = [base]
        for bn, warps, stages in itertools.product((16, 32, 64, 128), (2, 4, 8), (3, 5)):
            rows = 2 * bn if gated else bn
            if (block_m + rows) * 128 * stages <= 200 << 10:  # one byte an operand element
                out.append(MoeTile(bn, 128, warps, stages, False))
        return list(dict.fromkeys(out))
    bns = (32, 64, 128) if gated else (64, 128, 256)
    out = [base, base._replace(tma=not base.tma)]
    for bn, bk, stages, tma in itertools.product(bns, (64, 128), (3, 4), (False, True)):
        rows = 2 * bn if gated else bn
        if (block_m + rows) * bk * 2 * stages <= 200 << 10:  # shared memory per program
            out.append(MoeTile(bn, bk, 8 if block_m >= 128 else 4, stages, tma))
    return list(dict.fromkeys(out))


def main(argv=None, prog=None):
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,4,16,64,128,256,512,2048,16384")
    ap.add_argument("--tp", type=int, default=1, help="the expert intermediate size of one of this many ranks")
    ap.add_argument("--sweep", action="store_true", help="tile variants at each of --tokens (~1-2 min per count)")
    ap.add_argument("--block-m", default="", help="with --sweep: row blocks to try beside the table's, e.g. 16,32,64")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 experts (W8A8)")
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    inter = INTER // args.tp
    bandwidth, _ = measure_device(dev)
    layers = [Layer(inter, dt, dev, seed, args.fp8) for seed in range(COPIES)]
    expert_bytes = 3 * HIDDEN * inter * (1 if args.fp8 else 2)
    print(f"{torch.cuda.get_device_name(dev)}: copy bandwidth {bandwidth / 1e12:.2f} TB/s; layer: {E} experts of "
          f"[{HIDDEN} x {inter}] (tp={args.tp}), top-{TOP_K}, {'block FP8 experts, ' if args.fp8 else ''}{dt}")
    for t in [int(v) for v in args.tokens.split(",")]:
        xs = [torch.randn(t, HIDDEN, device=dev, dtype=dt) for _ in range(COPIES)]
        config = moe_config(t, HIDDEN, inter, dt, args.fp8)
        parts = torch.empty(TOP_K, t, HIDDEN, device=dev, dtype=parts_dtype(t, HIDDEN, TOP_K, dt))  # as the engine
        routing = fused(xs[0], layers[0], config, parts)
        expect = torch_loop(xs[0], layers[0]).float()
        err = ((parts.float().sum(0) - expect).abs().max() / expect.abs().max()).item()
        status = "ok" if err < (1e-1 if args.fp8 else 2e-2) else "MISMATCH"
        distinct = sum(len(torch.unique(fused(x, l, config, parts).ids)) for x, l in zip(xs, layers)) / COPIES
        t_fused = per_call_us(lambda i: fused(xs[i], layers[i], config, parts))
        t_router = per_call_us(lambda i: F.linear(xs[i], layers[i].router))
        logits = [F.linear(x, l.router) for x, l in zip(xs, layers)]
        routings = [route(lg, TOP_K, config.block_m, True, True) for lg in logits]
        acts = [gate_up(x, l, r, config.gate_up) for x, l, r in zip(xs, layers, routings)]
        t_route = per_call_us(lambda i: route(logits[i], TOP_K, config.block_m, True, True))
        t_gate_up = per_call_us(lambda i: gate_up(xs[i], layers[i], routings[i], config.gate_up))
        t_down = per_call_us(lambda i: down(acts[i], layers[i], routings[i], config.down, parts))
        t_loop = eager_us(lambda: torch_loop(xs[0], layers[0]))
        line = (f"T={t:5d} {status} (rel err {err:.1e}) {distinct:5.1f} experts | fused {t_fused:7.1f} us (router "
                f"{t_router:.1f}, top-k+align {t_route:.1f}, gate_up {t_gate_up:.1f}, down {t_down:.1f}) | torch loop "
                f"{t_loop:8.1f} us | {t_loop / t_fused:5.1f}x")
        if t <= DECODE_MAX:
            moved = distinct * expert_bytes
            gemm_bw = moved / ((t_gate_up + t_down) * 1e-6)
            layer_bw = (moved + E * HIDDEN * 2) / (t_fused * 1e-6)
            line += (f" | expert GEMMs {gemm_bw / 1e12:.2f} TB/s = {gemm_bw / bandwidth:.0%}, layer {layer_bw / 1e12:.2f}"
                     f" TB/s = {layer_bw / bandwidth:.0%} of copy")
        print(line, flush=True)
        if args.sweep:
            sweep(t, xs, layers, logits, inter, config, parts, [int(v) for v in args.block_m.split(",") if v])


def sweep(t, xs, layers, logits, inter, config, parts, block_ms):
    """The table's block_m (and block_ms) with each GEMM's tile variants; the best pair (block_m is shared).
    FP8 experts: the GEMMs timed on activations quantized beforehand (the engine's producers quantize them)."""
    fp8 = layers[0].s13 is not None
    quantized = per_token_group_quant if fp8 else (lambda a: a)
    xq = [quantized(x) for x in xs]
    results = []
    for block_m in sorted({config.block_m, *block_ms}):
        routings = [route(lg, TOP_K, block_m, True, True) for lg in logits]
        base = config
        best = {}
        # down's input: gate_up's output under the table's tile, once for every down tile
        acts = [quantized(gate_up(x, l, r, base.gate_up)) for x, l, r in zip(xs, layers, routings)]
        for name, gated, base_tile in (("gate_up", True, base.gate_up), ("down", False, base.down)):
            for tile in tile_variants(base_tile, gated, block_m, fp8):
                try:
                    if gated:
                        us = per_call_us(lambda i: moe_gate_up(xq[i], layers[i].w13, routings[i], tile, layers[i].s13))
                    else:
                        us = per_call_us(lambda i: moe_down(acts[i], layers[i].w2, routings[i], tile, parts, layers[i].s2))
                except Exception as e:  # noqa: BLE001 - out of shared memory, registers
                    print(f"    BM={block_m} {name} {tile}: {type(e).__name__} {str(e)[:80]}")
                    continue
                mark = " (table)" if block_m == config.block_m and tile == base_tile else ""
                print(f"    BM={block_m:3d} {name:>7} {tile}: {us:7.1f} us{mark}", flush=True)
                best[name] = min(best.get(name, (float("inf"), None)), (us, tile), key=lambda p: p[0])
        if len(best) == 2:
            results.append((best["gate_up"][0] + best["down"][0], block_m, best["gate_up"][1], best["down"][1]))
    if results:
        total, block_m, best_gate_up, best_down = min(results, key=lambda r: r[0])
        print(f"  T={t}: best {total:.1f} us: MoeConfig({block_m}, {best_gate_up}, {best_down})", flush=True)
