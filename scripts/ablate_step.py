"""What would a decode step cost without one kind of kernel? Ceilings for fusions, by deletion.

On a steady decode batch of the random-weight Qwen3-0.6B (contexts grown by --warm-steps decode steps,
as late in the benchmark's run), captures a CUDA graph of one step's forward + LM head + default draw,
as the engine replays it, and the same step with one kind of kernel taken out:

  no-norms       the two residual-add RMSNorms of every layer return a static buffer (the split-K
                 partials of o_proj / down_proj are never summed)
  empty-norms    the same, but each norm is replaced by an empty kernel launched the same way (PDL):
                 what a fusion that absorbs the norms' work would still pay is between the two
  no-merge       decode attention's split merge kernel skipped
  no-attention   decode attention skipped (its share of the step)
  no-projections the qkv (+ rotary + K/V store), o, gate_up (+ SiLU) and down projections skipped
  no-lm-head     the LM head skipped
  no-sampler     the sampling graph not replayed

The ablated graphs compute garbage; only their times mean something (each kernel's time does not
depend on the values it reads). A fusion can save at most the difference to `full`.

    python scripts/ablate_step.py [--batch 256 128 64 32 16 4] [--warm-steps 300 600 900 900 900 900] [--kinds ...]   (GPU)
"""
import argparse
import contextlib
import os
import random
from statistics import median

import torch
import triton

from steady_decode import end_decode_batch, random_weight_llm, start_decode_batch, time_interleaved  # (puts the repo on sys.path)
import nanovllm.kernels.paged_decode as paged_decode
from nanovllm.kernels.pdl import PDL_LAUNCH, pdl_prologue
from nanovllm.layers.layernorm import RMSNorm


@triton.jit
def _empty_kernel(x_ptr):
    pdl_prologue()


class _Skip:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def ablated(kind: str, runner, scratch: torch.Tensor, q_scratch: torch.Tensor):
    patches = []

    def patch(obj, name, value):
        patches.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    if kind in ("no-norms", "empty-norms"):
        def norm_forward(self, x, residual=None):
            if kind == "empty-norms":
                _empty_kernel[(1,)](scratch, **PDL_LAUNCH)
            out = scratch[:x.shape[0]]
            return out if residual is None else (out, residual)
        layers = runner.model.model.layers
        for layer in layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                patch(norm, "forward", norm_forward.__get__(norm, RMSNorm))
    elif kind == "no-merge":
        patch(paged_decode, "_decode_merge_kernel", _Skip())
    elif kind == "no-attention":
        patch(runner.backend, "decode", lambda *args, **kwargs: None)
    elif kind == "no-projections":
        for layer in runner.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            patch(attn.qkv_proj, "rope_store_kv", lambda x, *args, attn=attn, **kwargs:
                  q_scratch[:x.shape[0], :attn.num_heads * attn.head_dim].view(x.shape[0], attn.num_heads, -1))
            patch(attn.o_proj, "forward", lambda x, partials_ok=False: scratch[:x.shape[0]])
            patch(mlp.gate_up_proj, "swiglu", lambda x: x)
            patch(mlp.down_proj, "forward", lambda x, partials_ok=False: scratch[:x.shape[0]])
    elif kind == "no-lm-head":
        patch(runner.model, "compute_logits", lambda hidden, out=None: out)
    try:
        yield
    finally:
        for obj, name, value in reversed(patches):
            setattr(obj, name, value)


KINDS = ["full", "no-norms", "empty-norms", "no-merge", "no-attention", "no-projections", "no-lm-head", "no-sampler"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 128, 64, 32, 16, 4])
    ap.add_argument("--warm-steps", type=int, nargs="+", default=[300, 600, 900, 900, 900, 900])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS, help="variants to time ('full' always)")
    args = ap.parse_args()
    llm = random_weight_llm()
    engine = llm.engine
    runner = engine.model_runner
    gr = runner.graph_runner
    hidden = runner.model.config.hidden_size
    scratch = torch.zeros(gr.max_bs, hidden, dtype=gr.logits.dtype, device="cuda")
    q_scratch = torch.zeros(gr.max_bs, 8 * hidden, dtype=gr.logits.dtype, device="cuda")
    rng = random.Random(0)
    kinds = ["full"] + [k for k in args.kinds if k != "full"]
    for i, batch in enumerate(args.batch):
        start_decode_batch(engine, batch, rng)
        for _ in range(args.warm_steps[min(i, len(args.warm_steps) - 1)]):
            engine.step()
        torch.cuda.synchronize()
        bs = gr.padded_size(batch)
        lens = gr.static["seq_lens"][:batch].float()
        print(f"\nbatch {batch} (graph {bs}): mean context {lens.mean().item():.0f}, max {lens.max().item():.0f}")
        graphs = {}
        with torch.inference_mode():
            for kind in kinds:
                with ablated(kind, runner, scratch, q_scratch):
                    def step():
                        gr._forward(bs)
                        if kind != "no-sampler":
                            gr._sample(bs)
                    step()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, gr.pool):
                        step()
                    graphs[kind] = g
            torch.cuda.synchronize()
            times = time_interleaved({kind: g.replay for kind, g in graphs.items()}, args.reps)
        full = median(times["full"])
        for kind in kinds:
            t = median(times[kind])
            print(f"  {kind:13s} {t:7.3f} ms/step  saves {full - t:6.3f} ms ({(full - t) / full * 100:5.1f}%)")
        del graphs
        end_decode_batch(engine, batch)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
