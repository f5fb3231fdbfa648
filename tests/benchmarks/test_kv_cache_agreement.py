"""benchmarks/kv_cache_agreement.py: the agreement figure and the summary (the engine runs stubbed)."""
from benchmarks import kv_cache_agreement as agreement_bench
from benchmarks.kv_cache_agreement import agreement


def test_agreement_counts_the_common_prefix_and_the_gap_where_it_ends():
    reference = ([5, 6, 7, 8], [[-0.1, -2.0], [-0.2, -0.3], [-0.5, -1.5], [-0.1, -4.0]], "")
    assert agreement(reference, ([5, 6, 7, 8], [], "")) == (4, None)
    n, gap = agreement(reference, ([5, 6, 9, 8], [], ""))
    assert n == 2 and abs(gap - 1.0) < 1e-9
    n, gap = agreement(reference, ([5, 6], [], ""))  # the other arm stopped early: differs at token 2
    assert n == 2 and abs(gap - 1.0) < 1e-9
    n, gap = agreement(([5, 6], [[-0.1, -2.0], [-0.2, -0.3]], ""), ([5, 6, 7], [], ""))  # the reference stopped
    assert n == 2 and gap is None


def test_summary_separates_the_seed_prompts(monkeypatch, tmp_path):
    def fake_arm(model, prompts, tokens, kv_cache_dtype, **kw):
        out = []
        for i, _ in enumerate(prompts):
            ids = [1, 2, 3]
            if kv_cache_dtype == "fp8" and i == 0:
                ids = [1, 9, 3]
            out.append((ids, [[-0.1, -0.4]] * 3, "t"))
        return out
    monkeypatch.setattr(agreement_bench, "run_arm", fake_arm)
    summary = agreement_bench.main(["--tokens", "3", "--json", str(tmp_path / "a.json")])
    n = len(agreement_bench.SEED_PROMPTS) + len(agreement_bench.MORE_PROMPTS)
    assert summary["seed_prompts_identical"] == len(agreement_bench.SEED_PROMPTS) - 1
    assert summary["prompts_identical"] == n - 1 and summary["prompts"] == n
    assert abs(summary["mean_agreeing_tokens"] - (3 * n - 2) / n) < 1e-9
    assert (tmp_path / "a.json").exists()
