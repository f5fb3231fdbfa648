"""Speculative decoding against plain decoding, in the same run, on one engine (the plain arm is the
same engine with speculation switched off for every step, as above disable_by_batch_size).

    # n-gram (prompt lookup) on the embedded GGUF, one request whose answer copies its prompt
    python -m benchmarks.speculative ngram [--model PATH] [-k 4] [--repeat 3]
    # the same task B times at once, for the batch size where speculation stops paying
    # (speculative_config's disable_by_batch_size)
    python -m benchmarks.speculative ngram --batch-sizes 1,8,16,32,64
    # Qwen3-8B target, Qwen3-0.6B draft, random weights; the draft's proposals forced to the
    # target's greedy tokens (full acceptance: the bound real drafts approach) for k = 1..5, and
    # forced wrong (every draft rejected: the cost of a wasted step). "The target's greedy tokens"
    # are those of the speculative run itself, found in untimed rounds (agreeing_reference): with
    # random bf16 weights a verification pass departs from plain decoding's tokens at near-ties,
    # so its "same tokens as plain" may read False; its acceptance must read 1.0.
    python -m benchmarks.speculative forced [--config ...] [--draft-config ...] [--ks 1,2,3,4,5]

Figures: tokens per second of one generate call (after a warm-up), arms alternated --repeat times,
medians; acceptance from llm.get_metrics(); whether the arms' tokens are the same.
"""
import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from nanovllm import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))

# A function to rewrite with one variable renamed: the answer is the prompt again, nearly verbatim.
FUNCTION = '''def summarize_orders(orders, tax_rate=0.08, discount_threshold=100.0):
    """Group orders by customer and compute totals, discounts and taxes."""
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = 0.0
        for item in order["items"]:
            price = item["price"] * item["quantity"]
            if item.get("on_sale"):
                price = price * 0.9
            amount += price
        if customer not in totals:
            totals[customer] = {"orders": 0, "amount": 0.0, "discount": 0.0, "tax": 0.0}
        entry = totals[customer]
        entry["orders"] += 1
        entry["amount"] += amount
        if amount > discount_threshold:
            discount = amount * 0.05
            entry["discount"] += discount
            amount -= discount
        entry["tax"] += amount * tax_rate
    report = []
    for customer, entry in sorted(totals.items()):
        net = entry["amount"] - entry["discount"] + entry["tax"]
        report.append(f"{customer}: {entry['orders']} orders, net {net:.2f}")
    return report
'''
TASK = ("Rewrite this Python function, renaming the variable `entry` to `record` everywhere. "
        "Output only the complete rewritten function.\n\n```python\n" + FUNCTION + "```")


def _timed(llm: LLM, prompts, params, speculate: bool) -> tuple[float, list[list[int]], dict]:
    speculator = llm.engine.speculator
    limit = speculator.max_batch
    if not speculate:
        speculator.max_batch = 0  # no step speculates: plain decoding on the same engine
    before = llm.get_metrics()
    try:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        speculator.max_batch = limit
    after = llm.get_metrics()
    delta = {key: after[key] - before[key] for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                                        "spec_decode_num_accepted_tokens")}
    tokens = [o["token_ids"] for o in outputs]
    return sum(map(len, tokens)) / elapsed, tokens, delta


def _alternate(llm, prompts, params, repeat: int, arms: dict) -> dict:
    """arms: name -> (speculate, setup callable or None). Returns name -> figures."""
    runs = {name: [] for name in arms}
    for _ in range(repeat):
        for name, (speculate, setup) in arms.items():
            if setup is not None:
                setup()
            runs[name].append(_timed(llm, prompts, params, speculate))
    out = {}
    for name, rs in runs.items():
        rates = [r[0] for r in rs]
        drafts = rs[-1][2]
        out[name] = {"tok_s": statistics.median(rates), "runs_tok_s": rates, "tokens": rs[-1][1],
                     "acceptance": (drafts["spec_decode_num_accepted_tokens"] / drafts["spec_decode_num_draft_tokens"]
                                    if drafts["spec_decode_num_draft_tokens"] else None),
                     "mean_tokens_per_step": None if not drafts["spec_decode_num_drafts"] else
                     1 + drafts["spec_decode_num_accepted_tokens"] / drafts["spec_decode_num_drafts"]}
    return out


def _report(results: dict, baseline: str) -> dict:
    base = results[baseline]
    rows = {}
    for name, r in results.items():
        rows[name] = {"tok_s": round(r["tok_s"], 2), "speedup": round(r["tok_s"] / base["tok_s"], 3),
                      "runs_tok_s": [round(x, 2) for x in r["runs_tok_s"]],
                      "acceptance": None if r["acceptance"] is None else round(r["acceptance"], 3),
                      "tokens_per_verification": (None if r["mean_tokens_per_step"] is None
                                                  else round(r["mean_tokens_per_step"], 2)),
                      "same_tokens_as_plain": r["tokens"] == base["tokens"]}
        print(f"{name:>14}: {rows[name]['tok_s']:9.2f} tok/s  x{rows[name]['speedup']:.3f}  "
              f"acceptance={rows[name]['acceptance']}  tokens/verification={rows[name]['tokens_per_verification']}  "
              f"same tokens as plain: {rows[name]['same_tokens_as_plain']}")
    return rows


def run_ngram(args) -> dict:
    from nanovllm.models.model_path import resolve_model_path
    path = resolve_model_path(args.model)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max, "disable_by_batch_size": max(sizes)}
    llm = LLM(path, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
              max_model_len=args.max_model_len, max_num_seqs=max(256, max(sizes)), speculative_config=spec,
              **_memory(args))
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": TASK}], tokenize=False,
                                           add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.generate([prompt_ids], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)  # warm-up
    print(f"prompt {len(prompt_ids)} tokens (a {len(tokenizer.encode(FUNCTION))}-token function), greedy, "
          f"max_tokens={args.max_tokens}, k={args.k}, device={llm.config.device}")
    by_size = {}
    for size in sizes:
        print(f"batch of {size}:")
        results = _alternate(llm, [prompt_ids] * size, params, args.repeat,
                             {"plain": (False, None), "ngram": (True, None)})
        if size == sizes[0]:
            text = tokenizer.decode(results["ngram"]["tokens"][0], skip_special_tokens=True)
            print(f"output ({len(results['ngram']['tokens'][0])} tokens):\n{text[:600]}{'...' if len(text) > 600 else ''}")
        by_size[size] = _report(results, "plain")
    llm.shutdown()
    return {"case": "ngram", "model": path, "k": args.k, "prompt_tokens": len(prompt_ids), "by_batch_size": by_size}


def _random_model_dir(config_path: str) -> str:
    tmp = tempfile.mkdtemp(prefix="nanovllm-spec-bench-")
    shutil.copy(config_path, os.path.join(tmp, "config.json"))
    return tmp


class ForcedDrafts:
    """Benchmark switch: the draft model runs all its steps (its cost is paid), then its proposals
    are replaced by the tokens of `reference` (prompt tuple -> the output tokens), `agree`, or by
    tokens that differ from them (every draft rejected)."""

    def __init__(self, llm: LLM, reference: dict, vocab_size: int):
        self.proposer = llm.engine.speculator.proposer
        self.original = self.proposer.propose
        self.reference, self.vocab_size, self.agree = reference, vocab_size, True
        self.proposer.propose = self.propose

    def propose(self, seqs, caps, block_manager):
        drafts = self.original(seqs, caps, block_manager)
        forced = []
        for seq, draft in zip(seqs, drafts):
            ref = self.reference[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            start = seq.num_completion_tokens
            tokens = list(ref[start:start + len(draft)])
            tokens += [0] * (len(draft) - len(tokens))
            if not self.agree:
                tokens = [(t + 1) % self.vocab_size for t in tokens]
            forced.append(tokens)
            state = self.proposer._state.get(seq.seq_id)
            if state is not None:  # the draft's KV is taken as written for these tokens: no recompute
                self.proposer._state[seq.seq_id] = (state[0], tokens, state[2])
        return forced


def agreeing_reference(llm: LLM, prompts, params, forced: ForcedDrafts, max_rounds: int) -> tuple[dict, int]:
    """The output that speculation with forced drafts reproduces token for token (every draft
    accepted), and the rounds it took. Plain decoding's tokens are not it: a verification pass of
    k + 1 tokens sums in another order than a one-token step, and at a near-tie (frequent with
    random bf16 weights) the target's greedy choice differs, after which every forced draft would
    miss. So: a fixed point. Round r runs speculation with the output of round r - 1 as the drafts;
    every step up to round r - 1's first rejection is the same computation again, so the accepted
    prefix grows each round (to the next near-tie), and a round whose output equals its drafts
    accepted every draft. forced.reference is the start (plain decoding's tokens) and is left at
    the last round's output."""
    forced.agree = True
    for rounds in range(1, max_rounds + 1):
        _, tokens, _ = _timed(llm, prompts, params, speculate=True)
        output = {tuple(p): t for p, t in zip(prompts, tokens)}
        if output == forced.reference:
            return output, rounds
        forced.reference = output
    print(f"warning: forced drafts did not converge in {max_rounds} rounds (--max-rounds): acceptance below 1")
    return forced.reference, max_rounds


def run_forced(args) -> dict:
    target = _random_model_dir(args.config)
    draft = _random_model_dir(args.draft_config)
    ks = [int(k) for k in args.ks.split(",")]
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": max(ks)}
    llm = LLM(target, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager, load_format="dummy",
              max_model_len=args.max_model_len, speculative_config=spec, **_memory(args))
    random.seed(0)
    vocab = llm.config.hf_config.vocab_size
    prompts = [[random.randint(0, min(10000, vocab - 1)) for _ in range(args.prompt_len)]]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    # The warm-up also puts the prompt in the prefix cache: every later run starts from the same KV.
    llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16), use_tqdm=False)
    _, plain, _ = _timed(llm, prompts, params, speculate=False)
    plain = {tuple(p): r for p, r in zip(prompts, plain)}
    forced = ForcedDrafts(llm, dict(plain), vocab)
    speculator = llm.engine.speculator
    references, rounds = {}, {}
    for k in ks:  # the verification passes (and so the near-ties) differ with k
        speculator.k, forced.reference = k, dict(plain)
        references[k], rounds[k] = agreeing_reference(llm, prompts, params, forced, args.max_rounds)
    print("rounds to agree: " + ", ".join(f"k={k}: {r}" for k, r in rounds.items()))

    def arm(k, agree):
        def setup():
            speculator.k, forced.agree = k, agree
            forced.reference = references[k] if agree else plain
        return True, setup
    arms = {"plain": (False, None)}
    for k in ks:
        arms[f"agree k={k}"] = arm(k, True)
    arms[f"reject k={max(ks)}"] = arm(max(ks), False)
    print(f"target {args.config}, draft {args.draft_config}, random weights, one request: "
          f"{args.prompt_len}-token prompt, {args.max_tokens} new tokens, greedy, device={llm.config.device}")
    results = _alternate(llm, prompts, params, args.repeat, arms)
    rows = _report(results, "plain")
    for k in ks:
        rows[f"agree k={k}"]["rounds_to_agree"] = rounds[k]
    llm.shutdown()
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(draft, ignore_errors=True)
    return {"case": "forced", "target": args.config, "draft": args.draft_config, "arms": rows}


def _memory(args) -> dict:
    return {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", choices=["ngram", "forced"])
    ap.add_argument("--model", help="ngram: model directory or .gguf (default: the embedded GGUF)")
    ap.add_argument("--config", default=os.path.join(HERE, "configs/qwen3-8b.json"), help="forced: the target")
    ap.add_argument("--draft-config", default=os.path.join(HERE, "configs/qwen3-0.6b.json"), help="forced: the draft")
    ap.add_argument("-k", type=int, default=4, help="ngram: num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1", help="ngram: the task this many times at once (a list: a sweep)")
    ap.add_argument("--ks", default="1,2,3,4,5", help="forced: the values of k")
    ap.add_argument("--prompt-len", type=int, default=128, help="forced: random prompt tokens")
    ap.add_argument("--max-rounds", type=int, default=30,
                    help="forced: at most this many untimed rounds to find the output the drafts reproduce")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    figures = run_ngram(args) if args.case == "ngram" else run_forced(args)
    figures["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
