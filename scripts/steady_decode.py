"""Shared by the step-level GPU scripts (profile_step.py, host_timing.py, ablate_step.py, bench_nanobatch.py,
bench_green_overlap.py): an engine on a random-weight model, brought to a steady decode batch of a given size,
and the timing of several launch variants interleaved."""
import os
import random
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from nanovllm import LLM, SamplingParams  # noqa: E402

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks/configs/qwen3-0.6b.json")


def random_weight_llm(config: str = DEFAULT_CONFIG) -> LLM:
    tmp = tempfile.mkdtemp()
    shutil.copy(config, os.path.join(tmp, "config.json"))
    return LLM(tmp, load_format="dummy", max_model_len=4096)


def start_decode_batch(engine, batch: int, rng: random.Random, temperature: float = 0.6):
    """Add `batch` requests with the benchmark's prompt lengths and step until all are decoding."""
    for i in range(batch):
        prompt = [rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"{batch}-{i}", prompt, SamplingParams(temperature=temperature, ignore_eos=True,
                                                                  max_tokens=3000))
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()


def decode_slices(graph_runner, batch: int):
    """The steady batch's inputs as its decode graph last read them: (positions, meta), where
    meta(lo, hi) is the AttentionMetadata of rows lo..hi (the inputs copied: later steps leave them be)."""
    import torch
    from nanovllm.attention.base import AttentionMetadata
    s = graph_runner.static
    pos, lens = s["positions"][:batch].clone(), s["seq_lens"][:batch].clone()
    slots, tables = s["slot_mapping"][:batch].clone(), s["block_tables"][:batch].clone()
    qsl, bound = graph_runner.query_start_loc, graph_runner.max_model_len

    def meta(lo: int, hi: int) -> AttentionMetadata:
        n = hi - lo
        order = torch.argsort(lens[lo:hi], descending=True).to(torch.int32)
        return AttentionMetadata(num_seqs=n, num_decodes=n, slot_mapping=slots[lo:hi], query_start_loc=qsl[:n + 1],
                                 seq_lens=lens[lo:hi], block_tables=tables[lo:hi], max_query_len=1, max_seq_len=bound,
                                 max_seq_len_bound=bound, decode_order=order)
    return pos, meta


def end_decode_batch(engine, batch: int):
    for i in range(batch):
        engine.abort_request(f"{batch}-{i}")
    engine.drain()


def time_interleaved(launchers: dict, reps: int, rounds: int = 5) -> dict[str, list[float]]:
    """ms per launch of each variant: `rounds` rounds of `reps` back-to-back launches (after one
    untimed launch), the variants interleaved round by round so that clock drift hits them alike."""
    import torch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {name: [] for name in launchers}
    for _ in range(rounds):
        for name, launch in launchers.items():
            launch()
            start.record()
            for _ in range(reps):
                launch()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return times
