import numpy as np
import torch

from nanovllm.layers.sampler import row_keys
from nanovllm.worker.sampling_inputs import host_row_keys


def test_host_row_keys_equal_the_device_formula():
    rng = np.random.default_rng(0)
    seeds = np.concatenate([rng.integers(-2**63, 2**63 - 1, 200, dtype=np.int64), [0, -1, 2**63 - 1, -2**63]])
    offsets = rng.integers(0, 1 << 20, seeds.size, dtype=np.int64)
    offsets[:3] = [1 << 32, (1 << 40) + 7, (1 << 62) + 3]  # past 32 bits: only the low 32 enter the key
    expected = row_keys(torch.from_numpy(seeds), torch.from_numpy(offsets)).numpy()
    assert np.array_equal(host_row_keys(seeds, offsets), expected)


def test_settled_tokens_follow_the_sequence_without_its_pending_token():
    """The numpy mirror the penalties read grows with the output, never holds a placeholder, and
    picks up a placeholder's value once the host has read it."""
    from nanovllm import SamplingParams
    from nanovllm.engine.sequence import PENDING_TOKEN, Sequence
    from nanovllm.worker.sampling_inputs import settled_tokens

    seq = Sequence([5, 6, 7], SamplingParams(), seed=0)
    assert settled_tokens(seq).tolist() == [5, 6, 7]
    for t in range(100):  # past the first buffer's capacity
        seq.append_token(t)
    assert settled_tokens(seq).tolist() == [5, 6, 7] + list(range(100))
    seq.token_ids.append(PENDING_TOKEN)
    seq.num_pending_tokens = 1
    assert settled_tokens(seq).tolist() == [5, 6, 7] + list(range(100))
    seq.token_ids[-1], seq.num_pending_tokens = 42, 0
    assert settled_tokens(seq)[-2:].tolist() == [99, 42]


def test_keys_of_an_all_greedy_batch_are_left_out_and_its_draw_is_the_argmax():
    """A greedy row's draw reads no noise: an all-greedy batch gets zero keys (no hashing), and its
    tokens are the argmax; a batch with a random row gets every row's key."""
    from nanovllm import SamplingParams
    from nanovllm.engine.sequence import Sequence
    from nanovllm.layers.sampler import Sampler
    from nanovllm.worker.sampling_inputs import build_sampling_metadata

    cpu = torch.device("cpu")
    greedy = [Sequence([1, 2, 3], SamplingParams(temperature=0.0), seed=s) for s in (11, 12)]
    meta = build_sampling_metadata(greedy, cpu)
    assert meta.all_greedy and not meta.all_random and not meta.row_keys.any()
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler().sample(logits, meta).token_ids, logits.argmax(dim=-1))

    mixed = greedy + [Sequence([1, 2, 3], SamplingParams(temperature=0.7), seed=13)]
    meta = build_sampling_metadata(mixed, cpu)
    assert not meta.all_greedy and not meta.all_random
    assert build_sampling_metadata(mixed[2:], cpu).all_random
    seeds = np.array([11, 12, 13], dtype=np.int64)
    assert np.array_equal(meta.row_keys.numpy(), host_row_keys(seeds, np.zeros(3, dtype=np.int64)))


def test_verification_rows_are_the_rows_of_their_positions():
    """A sequence verifying drafts d gets len(d) + 1 rows; row j's parameters are those a plain step
    would build once d[:j] had been generated: its offset, min_tokens bans, penalty history, and the
    sequence's filters, bias and seed."""
    from nanovllm import SamplingParams
    from nanovllm.engine.sequence import Sequence
    from nanovllm.worker.sampling_inputs import build_sampling_metadata

    cpu = torch.device("cpu")
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9]),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, logit_bias={4: 1.5, 6: -2.0}),
              SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3, min_tokens=6),
              SamplingParams(temperature=0.0, presence_penalty=0.5, logprobs=2),
              SamplingParams(temperature=0.9)]
    drafts = [[7, 8, 9], [], [5, 5], [1], [2, 3, 4, 5]]
    seqs = []
    for i, sp in enumerate(params):
        seq = Sequence([10 + i, 11, 12], sp, seed=100 + i)
        seq.token_ids += [20 + i] * i  # i outputs so far
        seqs.append(seq)
    got = build_sampling_metadata(seqs, cpu, eos_token_ids=(2,), vocab_size=50, drafts=drafts)
    # The reference: one plain row per position, a sequence with the drafts before it generated.
    rows = []
    for seq, draft in zip(seqs, drafts):
        for j in range(len(draft) + 1):
            row = Sequence(seq.prompt_token_ids, seq.sampling_params, seed=seq.seed)
            row.token_ids = seq.token_ids + draft[:j]
            rows.append(row)
    expected = build_sampling_metadata(rows, cpu, eos_token_ids=(2,), vocab_size=50)
    for name in ("temperatures", "seeds", "offsets", "row_keys", "filter_rows", "top_k", "top_p", "min_p_rows",
                 "min_p", "banned_rows", "banned_ids", "bias_rows", "bias_ids", "bias_values", "top_k_rows",
                 "other_rows"):
        a, b = getattr(got, name), getattr(expected, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    for name in ("all_greedy", "all_random", "max_num_logprobs", "max_top_k", "top_k_bounded", "random_rows_filtered"):
        assert getattr(got, name) == getattr(expected, name), name
    p, q = got.penalties, expected.penalties
    for name in ("rows", "output_tokens", "output_rows", "prompt_tokens", "prompt_rows", "repetition", "frequency",
                 "presence"):
        a, b = getattr(p, name), getattr(q, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    assert got.banned_rows is not None and got.penalties.rows is not None  # the cases are exercised
