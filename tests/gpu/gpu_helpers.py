"""Prompts, greedy runs and the bf16 agreement rule shared by the GPU tests."""
import random

from nanovllm import SamplingParams


def make_prompts(seed, lengths=(1, 7, 30, 64, 129, 250, 400, 700)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def greedy(llm, prompts, n=24):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [o["token_ids"] for o in outs]


def greedy_topk(llm, prompts, n, k=20):
    """Greedy tokens and, per token, the k best (token id, logprob) of the reference."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=k)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o["token_ids"], [{t["token_id"]: t["logprob"] for t in e["top_logprobs"]} for e in o["logprobs"]])
            for o in outs]


# bf16 paths round differently (accumulation order, fused vs separate ops): over 28 layers the
# logits move by a few hundredths, so a reference logprob gap below this is a tie, not a bug.
BF16_NEAR_TIE = 0.1


def assert_bf16_agreement(ours, reference, what, near_tie=BF16_NEAR_TIE):
    """Token-equal to the reference until a divergence where our token was a near-tie of the
    reference's (within near_tie of its logprob, by the reference's own logprobs); after that the
    continuations are not comparable. (Random weights give flat distributions: the near-tie may be
    the reference's third or fourth candidate, not only its runner-up.)"""
    for i, (tokens, (ref_tokens, ref_topk)) in enumerate(zip(ours, reference)):
        for j, (a, b) in enumerate(zip(tokens, ref_tokens)):
            if a == b:
                continue
            top = ref_topk[j]
            assert a in top and top[b] - top[a] < near_tie, (
                f"{what}: prompt {i} token {j}: ours {a} ({top.get(a, 'not in the reference top-k')}), "
                f"reference {b} ({top[b]:.4f})\nours {tokens}\nref  {ref_tokens}")
            break


def reference_spread(first, second):
    """The largest logprob difference between two equally valid references (greedy_topk results),
    over the tokens both list, at the positions where both chose the same tokens so far: how far the
    reference itself is determined."""
    spread = 0.0
    for (tokens_a, topk_a), (tokens_b, topk_b) in zip(first, second):
        for j, (a, b) in enumerate(zip(tokens_a, tokens_b)):
            if a != b:
                break
            spread = max(spread, max(abs(topk_a[j][t] - topk_b[j][t]) for t in topk_a[j] if t in topk_b[j]))
    return spread
