"""AsyncLLMEngine: outputs reach asyncio consumers, the loop sleeps when idle, a failing step fails
only its requests, an engine that keeps failing reports itself unhealthy (core on a thread, where
failures can be injected); in its own process: the same outputs, an idle process that sleeps, a
killed process that fails its requests instead of leaving them hanging, startup errors raised."""
import asyncio
import os
import signal
import time

import httpx
import pytest

from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.engine.request_output import RequestRejected
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.entrypoints.openai.api_server import build_app
from nanovllm.sampling_params import SamplingParams


class FlakyEngine(LLMEngine):
    """Raises from step() while `failures` is positive."""
    failures = 0

    def step(self):
        if self.failures > 0:
            self.failures -= 1
            super().step()  # leave the engine mid-step, as a real failure would
            raise RuntimeError("injected failure")
        return super().step()


@pytest.fixture
def engine(model_factory):
    config = Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    e = AsyncLLMEngine(config, max_waiting=8, engine_factory=FlakyEngine, separate_process=False)
    e.start()
    yield e
    e.shutdown()


async def _run(engine, prompt, max_tokens=8, stream=True):
    handle = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                stream)
    await handle.accepted
    outputs = []
    while True:
        out = await handle.queue.get()
        if out.error is not None:
            raise out.error
        outputs.append(out)
        if out.finished:
            return outputs


def test_stream_outputs_and_idle_sleep(engine):
    async def main():
        streamed = await _run(engine, [1, 2, 3, 4], stream=True)
        whole = await _run(engine, [1, 2, 3, 4], stream=False)
        return streamed, whole
    streamed, whole = asyncio.run(main())
    ids = [t for out in streamed for o in out.outputs for t in o.token_ids]
    assert len(streamed) > 1 and ids == whole[-1].outputs[0].token_ids and len(ids) == 8
    assert "".join(o.text for out in streamed for o in out.outputs) == whole[-1].outputs[0].text
    assert streamed[-1].outputs[-1].finish_reason == "length" and streamed[-1].num_prompt_tokens == 4
    # Idle: the engine thread blocks on its command queue instead of spinning.
    cpu = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - cpu < 0.1
    assert engine.stats.num_running == engine.stats.num_waiting == 0 and engine.stats.kv_cache_usage == 0


@pytest.mark.parametrize("mode", ["engine", "process_engine"])
def test_validation_errors_are_rejections_with_their_status(mode, request):
    engine = request.getfixturevalue(mode)  # on a thread, in its own process (status pickled)

    async def main():
        handle = engine.add_request([1, 10**6], SamplingParams(), True)
        with pytest.raises(RequestRejected, match="outside the vocabulary") as e:
            await handle.accepted
        assert e.value.status == 400
    asyncio.run(main())


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine):
    async def main():
        engine.engine.failures = 1
        with pytest.raises(RequestRejected, match="injected failure") as e:
            await _run(engine, [5, 6, 7])
        assert e.value.status == 500
        outputs = await _run(engine, [5, 6, 7])
        assert outputs[-1].outputs[-1].finish_reason == "length"
    asyncio.run(main())
    assert engine.healthy and engine.stats.kv_cache_usage == 0


def test_an_engine_that_keeps_failing_is_unhealthy(engine):
    app = build_app(engine, ["tiny"])

    async def main():
        engine.engine.failures = 10**9
        for _ in range(3):
            with pytest.raises(RequestRejected):
                await _run(engine, [5, 6, 7])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
            r = await client.get("/health")
            assert r.status_code == 503 and "failed" in r.json()["reason"]
            r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"]
    asyncio.run(main())
    assert not engine.healthy


def failing_factory(config):
    raise ValueError("cannot build this engine")


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture
def process_engine(model_factory):
    config = Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    e = AsyncLLMEngine(config, max_waiting=8)
    e.start()
    yield e
    e.shutdown()


def test_engine_process_outputs_equal_the_thread_engine(process_engine, engine):
    async def main(e):
        streamed = await _run(e, [1, 2, 3, 4], max_tokens=12, stream=True)
        whole = await _run(e, [1, 2, 3, 4], max_tokens=12, stream=False)
        return streamed, whole
    streamed, whole = asyncio.run(main(process_engine))
    _, reference = asyncio.run(main(engine))
    ids = [t for out in streamed for o in out.outputs for t in o.token_ids]
    assert ids == whole[-1].outputs[0].token_ids == reference[-1].outputs[0].token_ids
    assert process_engine.engine is None and process_engine._process.is_alive()
    # Idle: the engine process blocks on its pipe instead of spinning.
    pid = process_engine._process.pid
    cpu = _cpu_seconds(pid)
    time.sleep(0.5)
    assert _cpu_seconds(pid) - cpu < 0.1
    assert process_engine.stats.num_running == 0 and process_engine.stats.kv_cache_usage == 0


def test_killed_engine_process_fails_its_requests(process_engine):
    async def main():
        handle = process_engine.add_request([1, 2, 3], SamplingParams(max_tokens=100000, ignore_eos=True), True)
        await handle.accepted
        await handle.queue.get()  # generating
        os.kill(process_engine._process.pid, signal.SIGKILL)
        while True:
            out = await asyncio.wait_for(handle.queue.get(), 10)
            if out.finished:
                break
        assert out.error is not None and "exited unexpectedly" in str(out.error) and out.error.status == 500
        late = process_engine.add_request([1, 2], SamplingParams(), True)
        with pytest.raises(RequestRejected, match="unavailable") as e:
            await late.accepted
        assert e.value.status == 503
    asyncio.run(main())
    assert not process_engine.healthy


def test_health_of_an_engine_process_asks_no_system_call_and_sees_it_die(process_engine, monkeypatch):
    """healthy is asked several times per request: its answer comes from the reader thread, which
    ends once the process's pipe closes, not from a waitpid of the process."""
    process = process_engine._process
    monkeypatch.setattr(process, "is_alive", lambda: pytest.fail("healthy asked the process"))
    assert process_engine.healthy
    process_engine.accepting = False  # as in a drain: nothing fails the requests, the process just goes
    os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while process_engine.healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not process_engine.healthy and process_engine.dead is None


def test_engine_process_startup_error_is_raised(model_factory):
    config = Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)
    e = AsyncLLMEngine(config, engine_factory=failing_factory)
    with pytest.raises(ValueError, match="cannot build this engine"):
        e.start()
    assert not e.healthy


def test_engine_process_exits_when_its_parent_dies(model_factory):
    """A server killed outright (no shutdown) does not leave its engine process behind."""
    import subprocess
    import sys
    code = f"""
import sys, time
from nanovllm.config import Config
from nanovllm.engine.async_engine import AsyncLLMEngine
e = AsyncLLMEngine(Config({model_factory("qwen3")!r}, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20))
e.start()
print(e._process.pid, flush=True)
time.sleep(60)
"""
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(5)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
            stat = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                break
            time.sleep(0.1)
        alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        assert not alive, "the engine process outlived its killed parent"
    finally:
        parent.kill()


def test_engine_process_outbox_never_blocks_and_merges_what_the_reader_missed():
    """The engine loop hands its passes over without waiting for the reader; passes that queued up
    while nobody read arrive merged (one output per request), with every token in order."""
    import multiprocessing
    import pickle

    from nanovllm.engine.engine_process import PipeOutbox
    from nanovllm.engine.request_output import CompletionOutput, RequestOutput

    reader, writer = multiprocessing.Pipe()
    outbox = PipeOutbox(writer)
    passes, width = 400, 64
    start = time.perf_counter()
    for step in range(passes):  # far more than the pipe holds: nobody reads yet
        outbox.emit([("output", f"r{i}", RequestOutput(f"r{i}", [CompletionOutput(0, "x" * 200, [step], None)]))
                     for i in range(width)])
    assert time.perf_counter() - start < 5.0
    received = {f"r{i}": [] for i in range(width)}
    messages = 0
    while sum(map(len, received.values())) < passes * width:
        events = pickle.loads(reader.recv_bytes())
        messages += 1
        seen = set()
        for kind, request_id, output in events:
            assert kind == "output" and request_id not in seen  # one output per request and message
            seen.add(request_id)
            received[request_id] += output.outputs[0].token_ids
    assert all(ids == list(range(passes)) for ids in received.values())
    assert messages < passes
    outbox.close()


def test_capacity_counts_each_waiting_request_once(model_factory):
    """Requests the engine took in are counted by its snapshot only, not also as still on their way
    (issue 38: 503s below --max-waiting, and messages counting more requests than existed)."""
    config = Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20,
                    max_num_seqs=1)
    e = AsyncLLMEngine(config, max_waiting=4, separate_process=False)
    e.start()

    async def main():
        with pytest.raises(RequestRejected, match="holds 5 prompts.*the limit is 4") as never:
            e.check_capacity(5)  # could never be queued: a 400, not a 503 to retry
        assert never.value.status == 400
        handles = [e.add_request([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True), True)
                   for _ in range(5)]
        # This coroutine holds the loop: the engine takes them in, their acceptances wait undelivered.
        deadline = time.monotonic() + 30
        while (e.stats.num_running, e.stats.num_waiting) != (1, 4) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert e.stats.num_requests_received == 5 and e.num_waiting == 4
        e.check_capacity(0)
        with pytest.raises(RequestRejected, match="4 requests are already waiting") as full:
            e.check_capacity(1)
        assert full.value.status == 503
        for h in handles:
            h.abort()
    try:
        asyncio.run(main())
    finally:
        e.shutdown()


def test_begin_shutdown_finishes_requests_with_what_they_have(engine):
    """What a drain does when its time is up: every request ends now as if finished, with its tokens
    so far and finish_reason "abort"; streamed or not."""
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        streamed = engine.add_request([1, 2, 3], params, True)
        whole = engine.add_request([4, 5, 6], params, False)
        await streamed.accepted
        await whole.accepted
        outputs = [await streamed.queue.get()]  # it is generating
        engine.begin_shutdown()
        while not outputs[-1].finished:
            outputs.append(await asyncio.wait_for(streamed.queue.get(), 10))
        final = await asyncio.wait_for(whole.queue.get(), 10)
        return outputs, final
    outputs, final = asyncio.run(main())
    assert all(out.error is None for out in outputs) and final.error is None
    last = outputs[-1].outputs[-1]
    assert last.finish_reason == "abort" and 0 < last.num_tokens < 1000
    assert last.num_tokens == sum(len(o.token_ids) for out in outputs for o in out.outputs)
    done = final.outputs[0]
    assert final.finished and done.finish_reason == "abort" and len(done.token_ids) == done.num_tokens > 0
    assert engine.stats.kv_cache_usage == 0 and engine.num_in_flight == 0
    with pytest.raises(RequestRejected, match="shutting down"):
        engine.check_capacity(1)


def test_a_stream_cut_by_a_failure_ends_with_final_chunks_then_the_error(engine):
    """Through the app: the failed step's stream still ends as a stream should (finish_reason
    "abort", the usage chunk it asked for), then names the failure, then [DONE]."""
    import json
    app = build_app(engine, ["tiny"])

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=30) as c:
            body = {"prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            engine.engine.failures = 1
            r = await c.post("/v1/completions", json=body)
            return r.status_code, [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    status, events = asyncio.run(main())
    assert status == 200 and events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    error = chunks.pop()
    assert error["error"]["type"] == "server_error" and "injected failure" in error["error"]["message"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 3
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["abort"]
