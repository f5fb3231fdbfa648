"""Can decode attention and the GEMMs overlap when each owns its SMs? A decode step's attention
reads HBM at copy bandwidth while the projections at 128-256 rows are compute-bound; on shared
SMs they fight (scripts/bench_nanobatch.py: attention needs every SM's occupancy), so this splits
the GPU with CUDA green contexts: attention on one partition, everything else on the other, and
two half-batches pipelined through them (half A's attention of layer L runs while half B's
o_proj/MLP of layer L-1 and qkv of layer L run, and the other way round).

Times, on a steady decode batch of the random-weight Qwen3-0.6B, CUDA graphs of one step's
forward + LM head:

  single        the engine's way: one forward over the whole batch
  pipe-plain    the two-half pipeline on two ordinary streams (no partition)
  pipe-gG       the pipeline with the GEMM stream on a green context of G SMs, attention on
                the remaining SMs
  pipe-gG-full  GEMM stream on G SMs, attention on an ordinary stream (every SM)
and, as diagnostics, graphs of 28 layers' decode attention alone (whole batch, one half) on every
SM and on the attention partition (attn-*), of 27 layers' post-attention + qkv chain for one half
on every SM and on the GEMM partition (chain-half*), and of the whole batch's attention beside two
halves' chains with no dependencies between them, on shared SMs and on the two partitions (conc-*).
Measured on the H200 (BENCHMARKS.md, fourteenth session): no partition beats the single graph.

    python scripts/bench_green_overlap.py [--batch 256 128] [--gemm-sms 24 32 40] [--reps 20]   (GPU)
"""
import argparse
import ctypes
import os
import random
from statistics import median

import torch

from steady_decode import (decode_slices, end_decode_batch, random_weight_llm, start_decode_batch,  # (puts the repo on sys.path)
                           time_interleaved)
from nanovllm.layers.rotary import norm_args

_cu = ctypes.CDLL("libcuda.so.1")
_RESOURCE_BYTES = 144          # sizeof(CUdevResource): type, 92 bytes of padding, a 48-byte union
_SM_OFFSET = 96                # the union's CUdevSmResource {smCount, minSmPartitionSize, alignment}
_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 1
_CU_STREAM_NON_BLOCKING = 1


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def _sm_count(resource) -> int:
    return ctypes.c_uint.from_buffer(resource, _SM_OFFSET).value


class Partition:
    """Two green contexts over disjoint SMs (G for the GEMM side, the rest for attention), a
    non-blocking stream in each, wrapped for torch."""

    def __init__(self, gemm_sms: int, device_index: int = 0):
        dev = ctypes.c_int()
        _check(_cu.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        whole = (ctypes.c_byte * _RESOURCE_BYTES)()
        _check(_cu.cuDeviceGetDevResource(dev, whole, _CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
        groups = (ctypes.c_byte * _RESOURCE_BYTES)()
        rest = (ctypes.c_byte * _RESOURCE_BYTES)()
        n = ctypes.c_uint(1)
        _check(_cu.cuDevSmResourceSplitByCount(groups, ctypes.byref(n), whole, rest, 0, gemm_sms),
               "cuDevSmResourceSplitByCount")
        self.gemm_sms, self.attn_sms = _sm_count(groups), _sm_count(rest)
        self.streams = []
        for res in (groups, rest):
            desc = ctypes.c_void_p()
            _check(_cu.cuDevResourceGenerateDesc(ctypes.byref(desc), res, 1), "cuDevResourceGenerateDesc")
            ctx = ctypes.c_void_p()
            _check(_cu.cuGreenCtxCreate(ctypes.byref(ctx), desc, dev, _CU_GREEN_CTX_DEFAULT_STREAM),
                   "cuGreenCtxCreate")
            stream = ctypes.c_void_p()
            _check(_cu.cuGreenCtxStreamCreate(ctypes.byref(stream), ctx, _CU_STREAM_NON_BLOCKING, 0),
                   "cuGreenCtxStreamCreate")
            self.streams.append(torch.cuda.ExternalStream(stream.value))
        self.gemm, self.attn = self.streams


class Graph:
    """A CUDA graph of fn (captured on a side stream of this context, forking to whatever
    streams fn uses), replayed and timed."""

    def __init__(self, fn, pool):
        fn()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool):
            self.keep = fn()
        torch.cuda.synchronize()

    def time(self, reps: int, rounds: int = 5) -> float:
        """Median ms per replay over `rounds` rounds of `reps` replays."""
        return median(time_interleaved({"graph": self.graph.replay}, reps, rounds)["graph"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--gemm-sms", type=int, nargs="+", default=[24, 32, 40, 48])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    llm = random_weight_llm()
    engine = llm.engine
    runner = engine.model_runner
    gr, model = runner.graph_runner, runner.model
    layers = model.model.layers
    partitions = {}
    for g in args.gemm_sms:
        try:
            partitions[g] = Partition(g)
            p = partitions[g]
            print(f"partition for {g}: GEMM side {p.gemm_sms} SMs, attention side {p.attn_sms} SMs")
        except RuntimeError as e:
            print(f"partition for {g} SMs: {e}")
    rng = random.Random(0)
    for batch in args.batch:
        start_decode_batch(engine, batch, rng)
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
        bs, h = batch, batch // 2
        pos, meta = decode_slices(gr, bs)
        ids = torch.randint(0, 10000, (bs,), dtype=torch.int64, device="cuda")
        logits = gr.logits
        halves = [(0, h, meta(0, h)), (h, bs, meta(h, bs))]
        m_all = meta(0, bs)

        def pre(i, lo, hi, m, x, residual):
            layer = layers[i]
            if residual is None:
                x, residual = layer.input_layernorm(x), x
            else:
                x, residual = layer.input_layernorm(x, residual)
            sa = layer.self_attn
            kv = (sa.attn.k_cache, sa.attn.v_cache, m.slot_mapping)
            norms = (sa.q_norm, sa.k_norm) if sa.qk_norm else ()
            q = sa.qkv_proj.rope_store_kv(x, pos[lo:hi], sa.rotary_emb.cos_sin_cache, kv, *norm_args(*norms))
            assert q is not None, "the fused qkv kernel does not serve this batch"
            return q, residual

        def attend(i, q, m):
            return layers[i].self_attn.attn(q, None, None, m, kv_stored=True)

        def post(i, o, residual):
            layer = layers[i]
            x = layer.self_attn.o_proj(o, partials_ok=True)
            x, residual = layer.post_attention_layernorm(x, residual)
            return layer.mlp(x), residual

        def single():
            hidden = model(ids, pos, m_all)
            model.compute_logits(hidden, out=logits[:bs])

        def pipeline(gemm_stream, attn_stream):
            """Half A's attention under half B's GEMMs and the other way round. Every tensor
            stays referenced until capture ends: the two streams share them."""
            keep = []
            origin = torch.cuda.current_stream()
            gemm_stream.wait_stream(origin)
            attn_stream.wait_stream(origin)
            state = [[None, None] for _ in halves]   # per half: (x, residual)
            qs = [None, None]
            done_pre = [torch.cuda.Event() for _ in halves]
            done_attn = [torch.cuda.Event() for _ in halves]
            outs = [None, None]
            with torch.cuda.stream(gemm_stream):
                for j, (lo, hi, m) in enumerate(halves):
                    x = model.model.embed_tokens(ids[lo:hi])
                    qs[j], state[j][1] = pre(0, lo, hi, m, x, None)
                    keep += [x, qs[j], state[j][1]]
                    done_pre[j].record()
            for i in range(len(layers)):
                for j, (lo, hi, m) in enumerate(halves):
                    with torch.cuda.stream(attn_stream):
                        attn_stream.wait_event(done_pre[j])
                        outs[j] = attend(i, qs[j], m)
                        keep.append(outs[j])
                        done_attn[j].record()
                for j, (lo, hi, m) in enumerate(halves):
                    with torch.cuda.stream(gemm_stream):
                        gemm_stream.wait_event(done_attn[j])
                        x, residual = post(i, outs[j], state[j][1])
                        keep += [x, residual]
                        if i + 1 < len(layers):
                            qs[j], state[j][1] = pre(i + 1, lo, hi, m, x, residual)
                            keep += [qs[j], state[j][1]]
                            done_pre[j].record()
                        else:
                            hidden, _ = model.model.norm(x, residual)
                            keep.append(hidden)
                            model.compute_logits(hidden, out=logits[lo:hi])
            origin.wait_stream(gemm_stream)
            origin.wait_stream(attn_stream)
            return keep

        def attention_only(lo, hi, m):
            q = torch.randn(hi - lo, layers[0].self_attn.num_heads, layers[0].self_attn.head_dim,
                            dtype=torch.bfloat16, device="cuda")

            def fn():
                return [attend(i, q, m) for i in range(len(layers))]
            return fn

        def on(stream, fn):
            def wrapped():
                origin = torch.cuda.current_stream()
                stream.wait_stream(origin)
                with torch.cuda.stream(stream):
                    keep = fn()
                origin.wait_stream(stream)
                return keep
            return wrapped

        def chain(lo, hi, m):
            o = torch.randn(hi - lo, layers[0].self_attn.num_heads * layers[0].self_attn.head_dim,
                            dtype=torch.bfloat16, device="cuda")
            residual = torch.randn(hi - lo, model.config.hidden_size, dtype=torch.bfloat16, device="cuda")

            def fn():
                keep = []
                for i in range(len(layers) - 1):
                    x, r = post(i, o, residual)
                    keep += [x, r, pre(i + 1, lo, hi, m, x, r)]
                return keep
            return fn

        def concurrent(attn_stream, gemm_stream):
            """Attention over the whole batch beside two halves' worth of chains, with no
            dependencies between them: does the partition run them at once, and how much does
            each slow the other down?"""
            attn_fn, chain_fn = attention_only(0, bs, m_all), chain(0, h, halves[0][2])

            def fn():
                origin = torch.cuda.current_stream()
                attn_stream.wait_stream(origin)
                gemm_stream.wait_stream(origin)
                with torch.cuda.stream(attn_stream):
                    keep = attn_fn()
                with torch.cuda.stream(gemm_stream):
                    keep += chain_fn() + chain_fn()
                origin.wait_stream(gemm_stream)
                origin.wait_stream(attn_stream)
                return keep
            return fn

        results = {}
        with torch.inference_mode():
            graphs = {"single": Graph(single, gr.pool)}
            ref = logits[:bs].float().clone()
            side_a, side_b = torch.cuda.Stream(), torch.cuda.Stream()
            graphs["pipe-plain"] = Graph(lambda: pipeline(side_a, side_b), gr.pool)
            err = (logits[:bs].float() - ref).abs().max().item()
            agree = (logits[:bs].argmax(-1) == ref.argmax(-1)).float().mean().item()
            print(f"batch {bs}: pipe-plain vs single logits: max |diff| {err:.4f}, argmax agreement {agree:.3f}")
            graphs["attn-all"] = Graph(attention_only(0, bs, m_all), gr.pool)
            graphs["attn-half"] = Graph(attention_only(0, h, halves[0][2]), gr.pool)
            graphs["chain-half"] = Graph(chain(0, h, halves[0][2]), gr.pool)
            graphs["conc-plain"] = Graph(concurrent(side_b, side_a), gr.pool)
            for g, p in partitions.items():
                try:
                    graphs[f"pipe-g{p.gemm_sms}"] = Graph(lambda p=p: pipeline(p.gemm, p.attn), gr.pool)
                    err = (logits[:bs].float() - ref).abs().max().item()
                    print(f"batch {bs}: pipe-g{p.gemm_sms} vs single logits: max |diff| {err:.4f}")
                    graphs[f"pipe-g{p.gemm_sms}-full"] = Graph(lambda p=p: pipeline(p.gemm, side_b), gr.pool)
                    graphs[f"attn-all-on{p.attn_sms}"] = Graph(on(p.attn, attention_only(0, bs, m_all)), gr.pool)
                    graphs[f"attn-half-on{p.attn_sms}"] = Graph(on(p.attn, attention_only(0, h, halves[0][2])),
                                                                gr.pool)
                    graphs[f"chain-half-on{p.gemm_sms}"] = Graph(on(p.gemm, chain(0, h, halves[0][2])), gr.pool)
                    graphs[f"conc-g{p.gemm_sms}"] = Graph(concurrent(p.attn, p.gemm), gr.pool)
                except RuntimeError as e:
                    print(f"batch {bs}, partition {g}: {e}")
            torch.cuda.synchronize()
            for name, graph in graphs.items():
                results[name] = graph.time(args.reps)
        base = results["single"]
        print(f"\n===== batch {bs} (halves of {h}); median of 5 x {args.reps} replays, ms")
        for name, t in results.items():
            ratio = f"  ({base / t:5.3f}x single)" if name.startswith(("single", "pipe")) else ""
            print(f"  {name:22s} {t:7.3f}{ratio}")
        del graphs
        end_decode_batch(engine, batch)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
