"""Sampling with speculation draws from the target's distribution: over thousands of seeds on a
16-token vocabulary, the tokens of speculative sampling (n-gram drafts: a deterministic proposal;
a draft model: the drafts coupled with the target's noise) have the distribution of plain
sampling's, position by position, to within sampling noise, far below the distance between the
target's and the draft's own distributions. Plain and speculative runs use disjoint seeds, so the
check is statistical, not the pathwise equality test_spec_engine.py asserts."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from nanovllm import LLM, SamplingParams

VOCAB, NUM_SEEDS, NEW_TOKENS = 16, 3000, 4
KW = dict(dtype="float32", max_model_len=64, kvcache_block_size=16, max_num_seqs=512, max_num_batched_tokens=4096)
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: prompt lookup proposes "3, 1, 2, ..."


def _tiny_vocab_model(path, seed: int) -> str:
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.1, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return (_tiny_vocab_model(tmp_path_factory.mktemp("target"), 0),
            _tiny_vocab_model(tmp_path_factory.mktemp("draft"), 1))


def _histograms(path, seeds, spec=None) -> tuple[np.ndarray, dict]:
    """[NEW_TOKENS, VOCAB] frequencies of each output position over the seeds, and the metrics."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=NEW_TOKENS, ignore_eos=True) for s in seeds]
    with LLM(path, speculative_config=spec, **KW) as llm:
        outs = llm.generate([PROMPT] * len(seeds), params, use_tqdm=False)
        metrics = llm.get_metrics()
    tokens = np.array([o["token_ids"] for o in outs])
    return np.stack([np.bincount(tokens[:, j], minlength=VOCAB) / len(seeds) for j in range(NEW_TOKENS)]), metrics


def _tv(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return 0.5 * np.abs(a - b).sum(axis=-1)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_sampling_keeps_the_target_distribution(models, method):
    target, draft = models
    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
            if method == "ngram" else {"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    spec["disable_by_batch_size"] = KW["max_num_seqs"]  # every step speculates
    plain, _ = _histograms(target, range(NUM_SEEDS))
    speculative, metrics = _histograms(target, range(NUM_SEEDS, 2 * NUM_SEEDS), spec)
    drafts_own, _ = _histograms(draft, range(NUM_SEEDS))
    # Hundreds of drafts accepted and rejected: both branches of the verification are sampled.
    accepted, drafted = metrics["spec_decode_num_accepted_tokens"], metrics["spec_decode_num_draft_tokens"]
    assert 100 < accepted < drafted - 100, (accepted, drafted)
    # Two samples of N draws of one distribution p lie ~ sum_v sqrt(p_v (1 - p_v) / (pi N)) apart
    # in TV (the mean of |difference| of two binomial frequencies, halved); the draft's own
    # distribution lies far beyond that.
    noise = np.sqrt(plain * (1 - plain) / (np.pi * NUM_SEEDS)).sum(axis=-1)
    tv = _tv(plain, speculative)
    assert (tv < 2 * noise).all(), (tv, noise)
    assert (_tv(plain, drafts_own)[1:] > 5 * noise[1:]).all(), (_tv(plain, drafts_own), noise)
