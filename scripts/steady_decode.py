"""Shared by the step-level GPU scripts (profile_step.py, host_timing.py): an engine on a
random-weight model, brought to a steady decode batch of a given size."""
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


def end_decode_batch(engine, batch: int):
    for i in range(batch):
        engine.abort_request(f"{batch}-{i}")
    engine.drain()
