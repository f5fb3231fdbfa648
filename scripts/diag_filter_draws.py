"""Where the filter kernels' draw and the sampler's torch path part ways in an engine run: every
eager sampling step draws both ways on the same logits; each differing row is printed with what
decides it (both tokens' logits, ranks, ties, the mass ranked before them, the row's settings).
    python scripts/diag_filter_draws.py [top_p|mixed|top_k]"""
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests", "gpu")]
import nanovllm.layers.sampler as sampler  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from gpu_helpers import make_prompts  # noqa: E402


def params_for(which, n):
    if which == "top_k":
        return [SamplingParams(temperature=0.0 if i % 4 == 3 else 0.9, top_k=(20, 50, 128)[i % 3],
                               top_p=0.9 if i % 2 else 1.0, min_p=0.1 if i % 4 == 1 else 0.0, seed=i,
                               max_tokens=24, ignore_eos=True) for i in range(n)]
    if which == "mixed":
        return [SamplingParams(temperature=0.9, top_k=40 if i % 2 else -1, top_p=0.9 if i % 3 else 1.0, seed=i,
                               max_tokens=24, ignore_eos=True) for i in range(n)]
    params = [SamplingParams(temperature=0.0 if i % 4 == 3 else 0.9, top_p=(0.5, 0.9, 1.0)[i % 3], seed=i,
                             max_tokens=24, ignore_eos=True) for i in range(n)]
    params[1] = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                               seed=1, max_tokens=24, ignore_eos=True)
    params[4] = SamplingParams(temperature=0.9, top_p=0.8, min_tokens=10, stop_token_ids=[0, 1, 2], seed=4,
                               max_tokens=24)
    return params


def per_row(meta, batch):
    from nanovllm.layers.filter_kernels import _per_row
    top_k, top_p, log_min_p = _per_row(meta, batch)
    return top_k, top_p, log_min_p


def explain(logits, meta, keys, r, ours, ref):
    x = sampler.processed_logits(logits, meta)[r].float()
    t = float(meta.temperatures[r])
    y = x / t
    top_k, top_p, log_min_p = per_row(meta, logits.shape[0])
    probs = y.softmax(-1)
    noise = sampler._gumbel(keys[r:r + 1], torch.tensor([[ours, ref]], device=x.device))[0]
    print(f"  row {r}: temp {t} top_k {None if top_k is None else int(top_k[r])} "
          f"top_p {None if top_p is None else float(top_p[r])} "
          f"log_min_p {None if log_min_p is None else float(log_min_p[r])} dtype {logits.dtype}")
    for name, tok in (("kernel", ours), ("torch", ref)):
        v = y[tok]
        above, tied = int((y > v).sum()), int((y == v).sum())
        before = float(probs[y > v].sum())
        print(f"    {name} token {tok}: logit/t {float(v):.6f} rank {above} ({tied} tied) mass before {before:.7f} "
              f"mass through ties {before + float(probs[y == v].sum()):.7f}; prob {float(probs[tok]):.3e}")
    print(f"    scores (logit/t + gumbel): kernel {float(y[ours] + noise[0]):.6f} torch {float(y[ref] + noise[1]):.6f}; "
          f"row max {float(y.max()):.4f}, distinct values among the top 1000: {y.topk(1000).values.unique().numel()}")


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "top_p"
    original = sampler.Sampler.sample
    state = {"steps": 0, "differ": 0}

    def both(self, logits, meta):
        out = original(self, logits, meta)
        kernel_draw = sampler.filter_kernel_draw
        sampler.filter_kernel_draw = lambda *a: None
        try:
            ref = original(self, logits, meta)
        finally:
            sampler.filter_kernel_draw = kernel_draw
        state["steps"] += 1
        rows = (out.token_ids != ref.token_ids).nonzero().flatten().tolist()
        if rows and kernel_draw(logits.dtype, meta) is not None:
            state["differ"] += 1
            keys = meta.row_keys if meta.row_keys is not None else sampler.row_keys(meta.seeds, meta.offsets)
            print(f"step {state['steps']}: batch {logits.shape[0]}, rows differing {rows}, draw {kernel_draw(logits.dtype, meta).__name__}")
            for r in rows[:4]:
                explain(logits, meta, keys, r, int(out.token_ids[r]), int(ref.token_ids[r]))
        return out

    sampler.Sampler.sample = both
    tmp = tempfile.mkdtemp()
    shutil.copy(os.path.join(HERE, "..", "benchmarks", "configs", "qwen3-0.6b.json"), os.path.join(tmp, "config.json"))
    prompts = make_prompts(8, lengths=(10, 100, 300, 40, 200, 70, 150, 500))
    with LLM(tmp, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=16,
             gpu_memory_utilization=0.3) as llm:
        llm.generate(prompts, params_for(which, len(prompts)), use_tqdm=False)
    print(f"{which}: {state['differ']} of {state['steps']} sampling steps drew differently")


if __name__ == "__main__":
    main()
