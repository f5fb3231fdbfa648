import numpy as np

from nanovllm.spec_decode.config import SpeculativeConfig
from nanovllm.spec_decode.speculator import Speculator


def reference_verify(rows: list[int], draft: list[int]) -> tuple[list[int], int]:
    """The rule spelled out: drafts up to the first that differs from its row's draw, then that draw."""
    accepted = 0
    while accepted < len(draft) and rows[accepted] == draft[accepted]:
        accepted += 1
    return rows[:accepted + 1], accepted


def test_verify_gains_the_accepted_run_and_counts_it_by_position():
    k = 4
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k), max_model_len=100)
    rng = np.random.default_rng(0)
    num_drafts = num_draft_tokens = num_accepted = 0
    per_position = [0] * k
    for _ in range(2000):
        draft = rng.integers(0, 3, int(rng.integers(0, k + 1))).tolist()
        rows = rng.integers(0, 3, len(draft) + 1).tolist()
        if rng.random() < 0.3:  # every draft accepted
            rows[:len(draft)] = draft
        gained, accepted = reference_verify(rows, draft)
        assert speculator.verify(rows, draft) == gained
        if draft:
            num_drafts += 1
            num_draft_tokens += len(draft)
            num_accepted += accepted
            for pos in range(accepted):
                per_position[pos] += 1
    assert speculator.stats.as_dict() == {
        "spec_decode_num_drafts": num_drafts, "spec_decode_num_draft_tokens": num_draft_tokens,
        "spec_decode_num_accepted_tokens": num_accepted, "spec_decode_num_accepted_tokens_per_pos": per_position}
    assert 0 < per_position[-1] < per_position[0]


def test_no_speculation_counts_no_positions():
    assert Speculator().stats.as_dict()["spec_decode_num_accepted_tokens_per_pos"] == []


def test_cap_leaves_room_for_the_bonus_token_and_skips_what_cannot_take_drafts():
    from nanovllm.engine.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams
    k, max_model_len = 5, 20
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=k), max_model_len=max_model_len)
    for prompt_len in (3, 10, 17):
        for max_tokens in (1, 2, 4, 8, 30):
            seq = Sequence(list(range(prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0)
            for num_outputs in range(min(max_tokens, max_model_len - prompt_len)):
                seq.token_ids = list(range(prompt_len + num_outputs))
                seq.num_computed_tokens = len(seq.token_ids) - 1
                # a step gains at most drafts + 1 tokens: never past max_tokens or max_model_len
                room = min(max_tokens - num_outputs, max_model_len - len(seq.token_ids))
                assert speculator._cap(seq) == max(0, min(k, room - 1))
                seq.num_computed_tokens -= 1  # still prefilling
                assert speculator._cap(seq) == 0
                seq.num_computed_tokens += 1
                seq.num_pending_tokens = 1
                assert speculator._cap(seq) == 0 and speculator._cap(seq, in_flight_ok=True) == max(0, min(k, room - 1))
                seq.num_pending_tokens = 0
                seq.grammar = object()
                assert speculator._cap(seq) == 0
                seq.grammar = None
