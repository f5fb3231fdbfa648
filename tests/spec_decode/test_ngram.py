import numpy as np
import pytest

from nanovllm.spec_decode.ngram import ngram_lookup


def reference_lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule spelled out: the longest n in [min_n, max_n] whose suffix occurred earlier (ending
    before the last token), its earliest occurrence, then the k tokens after it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for start in range(total - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("alphabet", [2, 3, 50])
@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_lookup_follows_the_rule(alphabet, min_n, max_n):
    rng = np.random.default_rng(alphabet * 100 + min_n * 10 + max_n)
    for _ in range(300):
        tokens = rng.integers(0, alphabet, int(rng.integers(1, 40))).astype(np.int32)
        k = int(rng.integers(0, 6))
        got = ngram_lookup(tokens, min_n, max_n, k)
        assert got.tolist() == reference_lookup(tokens.tolist(), min_n, max_n, k)


def test_a_match_across_token_boundaries_is_not_one():
    # As little-endian bytes the suffix [256, 256] (00 01 00 00 00 01 00 00) first appears from the
    # last byte of token 0 (00 00 00 00 01 00 00 00 01 ...); as tokens it occurs only at 4..5.
    tokens = np.array([0, 1, 1, 7, 256, 256, 9, 256, 256], dtype=np.int32)
    history = tokens[:-1].tobytes()
    assert history.find(tokens[-2:].tobytes()) % 4  # the byte search does meet a misaligned match
    assert ngram_lookup(tokens, 2, 2, 3).tolist() == [9, 256, 256]
    assert ngram_lookup(tokens, 2, 2, 3).tolist() == reference_lookup(tokens.tolist(), 2, 2, 3)


def test_longest_suffix_wins_over_an_earlier_shorter_one():
    tokens = np.array([5, 6, 1, 4, 5, 6, 2, 9, 4, 5, 6], dtype=np.int32)
    assert ngram_lookup(tokens, 2, 3, 2).tolist() == [2, 9]  # [4, 5, 6] at 3..5, not [5, 6] at 0..1
    assert ngram_lookup(tokens, 2, 2, 2).tolist() == [1, 4]


def test_the_suffix_itself_is_no_occurrence_but_one_overlapping_it_is():
    assert ngram_lookup(np.array([5, 1, 2], dtype=np.int32), 2, 2, 3).size == 0
    assert ngram_lookup(np.array([1, 2, 1, 2, 1], dtype=np.int32), 3, 3, 3).tolist() == [2, 1]  # [1, 2, 1] at 0..2
