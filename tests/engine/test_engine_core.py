"""EngineCore, the message pump around the engine, driven through its inbox and emitted events."""
import queue
import threading
import time

from nanovllm.config import Config
from nanovllm.engine.engine_core import EngineCore
from nanovllm.sampling_params import SamplingParams


def test_a_requests_first_output_goes_ahead_of_the_passs_others(model_factory):
    """The front end serves a pass's outputs in order: a new request's first tokens come first, so
    its first chunk does not wait for a chunk to every stream already running."""
    config = Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    inbox, passes = queue.Queue(), []
    core = EngineCore(config, inbox, passes.append)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()

    def outputs():
        return [[e[1] for e in events if e[0] == "output"] for events in list(passes)]

    def wait_for(request_id):
        deadline = time.monotonic() + 60
        while not any(request_id in ids for ids in outputs()):
            assert time.monotonic() < deadline, f"no output for {request_id}"
            time.sleep(0.01)

    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    try:
        for request_id in ("old1", "old2"):
            inbox.put(("add", request_id, [1, 2, 3, 4], params, True, time.perf_counter()))
        wait_for("old2")  # both stream now
        inbox.put(("add", "new", [5, 6, 7, 8, 9], params, True, time.perf_counter()))
        wait_for("new")
    finally:
        inbox.put(("stop", None))
        thread.join(30)
    opened = next(ids for ids in outputs() if "new" in ids)
    assert opened == ["new", "old1", "old2"]  # old1 and old2 decoded in that pass too


def test_stats_split_the_steps_that_launched_prompt_tokens(model_factory):
    """EngineStats counts every step and, of them, those that launched prompt tokens (prefill or
    mixed), with their wall time: the decode-only steps are the difference."""
    config = Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    inbox, passes = queue.Queue(), []
    core = EngineCore(config, inbox, passes.append)
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        inbox.put(("add", "one", [1, 2, 3, 4], params, True, time.perf_counter()))
        deadline = time.monotonic() + 60
        while not any(e[0] == "output" and e[2].finished for events in list(passes) for e in events):
            assert time.monotonic() < deadline, "the request did not finish"
            time.sleep(0.01)
    finally:
        inbox.put(("stop", None))
        thread.join(30)
    stats = [e[1] for events in passes for e in events if e[0] == "stats"][-1]
    # One prefill step (4 prompt tokens, the first token), then 5 decode steps.
    assert stats.prefill_steps == 1 and stats.engine_steps >= 6
    assert 0 < stats.prefill_step_seconds < stats.step_seconds
