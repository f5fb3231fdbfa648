"""benchmarks/verify_host.py: the real engine's verification steps over the stand-in device."""
from benchmarks import verify_host as bench


def test_every_draft_is_accepted_and_each_step_timed():
    results = bench.main(["--batch-sizes", "1,2", "--rounds", "1", "--max-tokens", "60", "--parts"])
    for b in (1, 2):
        # The prefill's token, then 9 steps of 5 drafts all accepted (6 tokens each) before the cap
        # of 60 tokens shortens the drafts: any rejected draft would take more full steps.
        assert results[b]["steps"] == 9
        assert results[b]["median_us"] > 0
        assert set(results[b]["parts_us"]) == {"wants_drafts", "propose", "schedule", "fill_verify_inputs",
                                               "sampling_metadata", "advance", "process"}
