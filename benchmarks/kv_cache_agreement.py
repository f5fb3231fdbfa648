"""Greedy text over an FP8 KV cache against the model's own cache dtype: how many of the first N tokens agree.

    python -m benchmarks.kv_cache_agreement [--model PATH] [--tokens 32] [--noise-floor float32] [--json FILE]

The model defaults to the embedded one (SmolLM2-135M-Instruct); the prompts are the seed's two
(example.py's) and a dozen ordinary chat questions, each through the tokenizer's chat template. Both
arms run the same engine settings but `kv_cache_dtype`, greedy, eos honoured; each prompt's figure
is the length of the common prefix of the two token lists (a prompt whose arms both stop early at
the same token counts as agreeing throughout), with the reference's top-2 logprob gap at the first
difference, so that a near-tie reads as one. `--noise-floor DTYPE` adds the model in DTYPE with its own
cache as a third arm, and the same figure for it against the first: how far rounding alone parts the
greedy text (on the CPU, bf16 against fp32 parts it as early as FP8 does in some prompts).
"""
import argparse
import json

from nanovllm import LLM, SamplingParams

SEED_PROMPTS = ["introduce yourself", "list all prime numbers within 100"]
MORE_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish and German.",
    "Summarize the plot of Romeo and Juliet.",
    "What is 17 times 23?",
    "Name five animals that live in the Arctic.",
    "Why is the sky blue?",
    "Suggest a name for a coffee shop.",
]


def run_arm(model, prompts: list[str], tokens: int, kv_cache_dtype: str, **llm_kwargs):
    """Greedy token ids and per-token top-2 logprobs of each chat-templated prompt."""
    with LLM(model, kv_cache_dtype=kv_cache_dtype, **llm_kwargs) as llm:
        tokenizer = llm.get_tokenizer()
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                               add_generation_prompt=True) for p in prompts]
        params = SamplingParams(temperature=0, max_tokens=tokens, logprobs=2)
        outs = llm.generate(texts, params, use_tqdm=False)
    return [(o["token_ids"], [[t["logprob"] for t in e["top_logprobs"]] for e in o["logprobs"]], o["text"])
            for o in outs]


def agreement(reference, other) -> tuple[int, float | None]:
    """(common prefix length, the reference's top-2 gap at the first difference or None)."""
    ref_ids, ref_top, _ = reference
    ids = other[0]
    n = 0
    while n < min(len(ref_ids), len(ids)) and ref_ids[n] == ids[n]:
        n += 1
    if n == len(ref_ids) == len(ids):
        return n, None
    gap = ref_top[n][0] - ref_top[n][1] if n < len(ref_top) and len(ref_top[n]) > 1 else None
    return n, gap


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model directory or .gguf file (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--noise-floor", metavar="DTYPE", help="also the model in this dtype (e.g. float32), its own cache")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    prompts = SEED_PROMPTS + MORE_PROMPTS
    base = run_arm(args.model, prompts, args.tokens, "auto")
    fp8 = run_arm(args.model, prompts, args.tokens, "fp8")
    floor = run_arm(args.model, prompts, args.tokens, "auto", dtype=args.noise_floor) if args.noise_floor else None
    rows = []
    for i, (prompt, b, f) in enumerate(zip(prompts, base, fp8)):
        n, gap = agreement(b, f)
        full = gap is None and n == len(b[0])
        rows.append({"prompt": prompt, "agreeing_tokens": n, "tokens": len(b[0]), "identical": full,
                     "top2_gap_at_difference": gap, "text_auto": b[2], "text_fp8": f[2]})
        where = "identical" if full else f"first difference at token {n} (reference top-2 gap {gap:.3f})"
        if floor is not None:
            rows[-1]["noise_floor_agreeing_tokens"] = agreement(b, floor[i])[0]
            where += f" | {args.noise_floor}: {rows[-1]['noise_floor_agreeing_tokens']}/{len(b[0])}"
        print(f"{'seed' if prompt in SEED_PROMPTS else 'more'}  {prompt[:48]!r:52} {n:3d}/{len(b[0])}  {where}")
    seed = [r for r in rows if r["prompt"] in SEED_PROMPTS]
    summary = {"tokens": args.tokens,
               "seed_prompts_identical": sum(r["identical"] for r in seed), "seed_prompts": len(seed),
               "prompts_identical": sum(r["identical"] for r in rows), "prompts": len(rows),
               "mean_agreeing_tokens": sum(r["agreeing_tokens"] for r in rows) / len(rows)}
    if floor is not None:
        summary["noise_floor_dtype"] = args.noise_floor
        summary["noise_floor_mean_agreeing_tokens"] = sum(r["noise_floor_agreeing_tokens"] for r in rows) / len(rows)
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
