"""Does a decode step gain from running two half-batches concurrently (one half's memory-bound
attention under the other half's GEMMs and short kernels)? Times, on a steady decode batch of the
random-weight Qwen3-0.6B, CUDA graphs of one step's forward + LM head captured as:

  single     the engine's way: one forward over the whole batch
  halves     two half-batch forwards on two streams, joined before the LM head
  halves+pri the same graph, instantiated with per-node priorities: attention kernels at the lowest
             priority, everything else at the highest, so a half's GEMMs and short kernels take SMs
             ahead of the other half's pending attention programs
  offset+pri as halves+pri, the second half starting after the first half's first layer
  *-balP     the same with decode attention on the balanced kernel (kernels/paged_decode_balanced.py)
             at P persistent programs (one wave): with P at or below the SM count a program holds
             one SM's attention and leaves room beside it for the other half's GEMMs

    python scripts/bench_nanobatch.py [--batch 256 192 128] [--reps 30] [--balanced 100,132,264] [--warm-steps 20]   (GPU)
"""
import argparse
import ctypes
import os
import random
from statistics import median

import torch

from steady_decode import (decode_slices, end_decode_batch, random_weight_llm, start_decode_batch,  # (puts the repo on sys.path)
                           time_interleaved)
from nanovllm.kernels.paged_decode_balanced import alloc_balanced_workspace

_cu = ctypes.CDLL("libcuda.so.1")
_NODE_PRIORITY_FLAG = 8      # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
_ATTR_PRIORITY = 8           # CU_LAUNCH_ATTRIBUTE_PRIORITY


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def _kernel_name(node) -> str:
    params = (ctypes.c_byte * 256)()
    _check(_cu.cuGraphKernelNodeGetParams_v2(node, params), "cuGraphKernelNodeGetParams_v2")
    func = ctypes.c_void_p.from_buffer(params, 0).value
    kern = ctypes.c_void_p.from_buffer(params, 56).value
    name = ctypes.c_char_p()
    if func and _cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func)) == 0:
        return name.value.decode()
    if kern and _cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(kern)) == 0:
        return name.value.decode()
    return "?"


def set_priorities(raw_graph: int, low_names: tuple[str, ...]) -> dict[str, int]:
    """Attention-like kernels (name contains one of low_names) at the lowest priority, every other
    kernel node at the highest. Returns a count of the kernels seen."""
    lo, hi = ctypes.c_int(), ctypes.c_int()
    _check(_cu.cuCtxGetStreamPriorityRange(ctypes.byref(lo), ctypes.byref(hi)), "priority range")
    g = ctypes.c_void_p(raw_graph)
    n = ctypes.c_size_t(0)
    _check(_cu.cuGraphGetNodes(g, None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    _check(_cu.cuGraphGetNodes(g, nodes, ctypes.byref(n)), "cuGraphGetNodes")
    seen = {}
    for node in nodes:
        t = ctypes.c_int()
        _check(_cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t)), "cuGraphNodeGetType")
        if t.value != 0:
            continue
        name = _kernel_name(ctypes.c_void_p(node))
        low = any(s in name for s in low_names)
        seen[("LOW " if low else "") + name[:60]] = seen.get(("LOW " if low else "") + name[:60], 0) + 1
        value = (ctypes.c_byte * 64)()
        ctypes.c_int.from_buffer(value, 0).value = lo.value if low else hi.value
        _check(_cu.cuGraphKernelNodeSetAttribute(ctypes.c_void_p(node), _ATTR_PRIORITY, value), "set priority")
    return seen


class Exec:
    def __init__(self, raw_graph: int, flags: int):
        self.handle = ctypes.c_void_p()
        _check(_cu.cuGraphInstantiateWithFlags(ctypes.byref(self.handle), ctypes.c_void_p(raw_graph),
                                               ctypes.c_ulonglong(flags)), "cuGraphInstantiateWithFlags")

    def launch(self):
        _check(_cu.cuGraphLaunch(self.handle, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)),
               "cuGraphLaunch")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 192, 128])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--balanced", default="", help="comma-separated program counts P: also the *-balP variants")
    ap.add_argument("--warm-steps", type=int, default=20,
                    help="decode steps before timing: ~900 gives the long contexts of the run's 16-63-sequence tail")
    args = ap.parse_args()
    llm = random_weight_llm()
    engine = llm.engine
    runner = engine.model_runner
    gr, model, backend = runner.graph_runner, runner.model, runner.backend
    rng = random.Random(0)
    side = torch.cuda.Stream(priority=-1)
    for batch in args.batch:
        start_decode_batch(engine, batch, rng)
        for _ in range(args.warm_steps):
            engine.step()
        torch.cuda.synchronize()
        bs, h = batch, batch // 2
        pos, meta = decode_slices(gr, bs)
        ids = torch.ones(bs, dtype=torch.int64, device="cuda")
        logits = gr.logits
        ws_main = backend.workspace
        ws_side = tuple(torch.empty_like(t) for t in ws_main)
        attn = model.model.layers[0].self_attn
        hq, hkv, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        bal_ws = {p: (alloc_balanced_workspace(p, hq, hkv, head_dim, ids.device),
                      alloc_balanced_workspace(p, hq, hkv, head_dim, ids.device))
                  for p in (int(v) for v in args.balanced.split(",") if v)}
        plain = (backend.balanced, backend.balanced_max_batch)

        def use_balanced(p, side_stream=False):
            if p is None:
                backend.balanced, backend.balanced_max_batch = plain
            else:
                backend.balanced = (p, bal_ws[p][1 if side_stream else 0])
                backend.balanced_max_batch = 1 << 30

        m_all, m_a, m_b = meta(0, bs), meta(0, h), meta(h, bs)
        print(f"batch {bs}: mean context {m_all.seq_lens.float().mean().item():.0f} tokens")

        def layers(lo, hi, m, x=None, residual=None, first=0, last=None):
            if x is None:
                x = model.model.embed_tokens(ids[lo:hi])
            for layer in model.model.layers[first:last]:
                x, residual = layer(pos[lo:hi], x, residual, m)
            return x, residual

        def single(bal=None):
            use_balanced(bal)
            hidden = model(ids, pos, m_all)
            model.compute_logits(hidden, out=logits[:bs])
            use_balanced(None)

        def halves(offset_layers=0, bal=None):
            use_balanced(bal)
            main = torch.cuda.current_stream()
            xa, ra = layers(0, h, m_a, last=offset_layers or None) if offset_layers else (None, None)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                backend.workspace = ws_side
                use_balanced(bal, side_stream=True)
                xb, rb = layers(h, bs, m_b)
                xb, _ = model.model.norm(xb, rb)
                backend.workspace = ws_main
                use_balanced(bal)
            if offset_layers:
                xa, ra = layers(0, h, m_a, xa, ra, first=offset_layers)
            else:
                xa, ra = layers(0, h, m_a)
            xa, _ = model.model.norm(xa, ra)
            main.wait_stream(side)
            model.compute_logits(torch.cat([xa, xb]), out=logits[:bs])
            use_balanced(None)

        variants = {}
        plans = [("single", single, False), ("halves", halves, False), ("halves+pri", halves, True),
                 ("offset+pri", lambda: halves(1), True), ("single+pri", single, True)]
        for p in bal_ws:
            plans += [(f"single-bal{p}", lambda p=p: single(bal=p), False),
                      (f"halves-bal{p}", lambda p=p: halves(bal=p), False),
                      (f"halves+pri-bal{p}", lambda p=p: halves(bal=p), True)]
        with torch.inference_mode():
            for name, fn, prio in plans:
                fn()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.graph(g, gr.pool):
                    fn()
                if prio:
                    seen = set_priorities(g.raw_cuda_graph(), ("_decode_split", "_decode_merge", "_balanced_decode",
                                                                              "_merge_kernel"))
                    if name == "halves+pri":
                        print("kernel nodes:", seen)
                variants[name] = (g, Exec(g.raw_cuda_graph(), _NODE_PRIORITY_FLAG if prio else 0))
            torch.cuda.synchronize()
            times = time_interleaved({name: ex.launch for name, (_, ex) in variants.items()}, args.reps)
            base = median(times["single"])
            print(f"\n===== batch {batch} (halves of {h}); median of 5 x {args.reps} launches, ms per step")
            for name, ts in times.items():
                t = median(ts)
                print(f"  {name:12s} {t:7.3f} ms  ({base / t:5.3f}x single)   runs {', '.join(f'{x:.3f}' for x in ts)}")
        del variants
        end_decode_batch(engine, batch)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
