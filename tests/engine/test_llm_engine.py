"""The engine loop's own bookkeeping, against a stand-in device."""
import time

import pytest

from nanovllm.config import Config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


class _SlowOutput:
    """A step's results that take a while to come back, as a GPU step's do when the host reads them."""
    awaits_masks = False
    drafts = None

    def __init__(self, device, seqs):
        self.device, self.seqs = device, seqs

    def token_ids(self):
        time.sleep(self.device.step_seconds)
        self.device.read_times.append(time.perf_counter())
        return [7] * len(self.seqs)

    def logprobs(self):
        return None


class _SlowDevice:
    block_bytes = 1

    def __init__(self, num_blocks: int, step_seconds: float):
        self.num_blocks, self.step_seconds = num_blocks, step_seconds
        self.read_times = []  # when each step's tokens were back

    def execute(self, batch, defer_sampling=False):
        return _SlowOutput(self, [s for i, s in enumerate(batch.seqs) if batch.samples(i)])

    def shutdown(self):
        pass


@pytest.mark.parametrize("overlap", [False, True])
def test_first_token_time_is_when_the_token_is_known(model_factory, monkeypatch, overlap):
    """A sequence's first token counts from when the host has read it back, not from before it
    waited for the device: TTFT and prefill time (metrics) would leave out that wait."""
    config = Config(model_factory("qwen3", with_tokenizer=False), device="cpu", num_kvcache_blocks=8,
                    kvcache_block_size=16, max_model_len=128)
    device = _SlowDevice(8, step_seconds=0.05)
    monkeypatch.setattr(LLMEngine, "_make_runner", staticmethod(lambda *_: device))
    engine = LLMEngine(config)
    engine.overlap = overlap
    seq, = engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    first_read = device.read_times[0]  # the prompt's step is the first one read back
    assert seq.first_scheduled_time < first_read - device.step_seconds / 2
    assert first_read <= seq.first_token_time < device.read_times[1]
