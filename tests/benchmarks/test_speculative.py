"""benchmarks/speculative.py on the CPU with tiny random models: the forced drafts reach full
acceptance (forced wrong: none), also from a reference that departs from what the verification
passes compute, and the n-gram batch-size sweep runs end to end (the GPU figures come from the same code)."""
import json
import os

from benchmarks import speculative
from nanovllm import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny_config(tmp_path, name: str, hidden: int) -> str:
    with open(os.path.join(ROOT, "benchmarks/configs/qwen3-0.6b.json")) as f:
        config = json.load(f)
    config.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=1024, max_position_embeddings=512)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_forced_drafts_agree_fully_and_wrong_ones_never(tmp_path):
    out = tmp_path / "forced.json"
    speculative.main(["forced", "--config", _tiny_config(tmp_path, "target", 64),
                      "--draft-config", _tiny_config(tmp_path, "draft", 32), "--device", "cpu", "--dtype", "float32",
                      "--ks", "1,3", "--max-tokens", "40", "--prompt-len", "24", "--max-model-len", "256",
                      "--repeat", "1", "--json", str(out)])
    arms = json.loads(out.read_text())["arms"]
    for k in (1, 3):
        assert arms[f"agree k={k}"]["acceptance"] == 1.0
        assert arms[f"agree k={k}"]["tokens_per_verification"] > k  # k drafts and the bonus token (fewer at the end)
    assert arms["reject k=3"]["acceptance"] == 0.0 and arms["reject k=3"]["tokens_per_verification"] == 1.0


def test_agreeing_reference_repairs_a_reference_the_verification_departs_from(model_factory):
    """As at a bf16 near-tie: the start reference differs from what the verification computes at
    one position; the rounds converge on an output whose forced drafts are all accepted."""
    target = model_factory("qwen3")
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    prompts = [list(range(10, 30))]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=30)
    with LLM(target, dtype="float32", max_model_len=256, speculative_config=spec) as llm:
        _, plain, _ = speculative._timed(llm, prompts, params, speculate=False)
        departed = list(plain[0])
        departed[9] = (departed[9] + 1) % llm.config.hf_config.vocab_size
        forced = speculative.ForcedDrafts(llm, {tuple(prompts[0]): departed}, llm.config.hf_config.vocab_size)
        reference, rounds = speculative.agreeing_reference(llm, prompts, params, forced, max_rounds=10)
        assert rounds >= 2 and reference[tuple(prompts[0])] == plain[0]  # fp32: no near-tie moves the output
        _, tokens, drafts = speculative._timed(llm, prompts, params, speculate=True)
    assert tokens == plain
    assert drafts["spec_decode_num_accepted_tokens"] == drafts["spec_decode_num_draft_tokens"] > 0


def test_ngram_batch_size_sweep_runs(model_factory, tmp_path):
    out = tmp_path / "ngram.json"
    speculative.main(["ngram", "--model", model_factory("qwen3"), "--device", "cpu", "--batch-sizes", "1,3",
                      "--max-tokens", "24", "--max-model-len", "1024", "--repeat", "1", "--json", str(out)])
    figures = json.loads(out.read_text())
    assert set(figures["by_batch_size"]) == {"1", "3"}
    for rows in figures["by_batch_size"].values():
        assert rows["plain"]["tok_s"] > 0 and rows["ngram"]["same_tokens_as_plain"]
