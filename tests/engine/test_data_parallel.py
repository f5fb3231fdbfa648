"""DataParallelEngine over two engine cores on threads (where failures can be injected): requests
spread over both; a core that breaks fails its own requests only, new ones go to the other, /health
stays 200 and says which core is down, /ready too; once none serves both probes turn 503 and
requests get 503. Placement and the checks before anything starts."""
import asyncio
import copy

import httpx
import pytest
import torch

from nanovllm.config import Config
from nanovllm.engine.data_parallel import DataParallelEngine, check_data_parallel, core_config
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.request_output import RequestRejected
from nanovllm.entrypoints.openai.api_server import build_app
from nanovllm.sampling_params import SamplingParams


class BreakableEngine(LLMEngine):
    broken = False

    def step(self):
        if self.broken:
            raise RuntimeError("injected device failure")
        return super().step()


@pytest.fixture
def config(model_factory):
    return Config(model_factory("qwen3"), device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)


async def _run(handle):
    await handle.accepted
    while True:
        out = await handle.queue.get()
        if out.error is not None:
            raise out.error
        if out.finished:
            return out


def _params(max_tokens=4):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_requests_spread_and_a_broken_core_leaves_the_other_serving(config):
    dp = DataParallelEngine(config, 2, max_waiting=8, engine_factory=BreakableEngine, separate_process=False)
    dp.start()
    app = build_app(dp, ["tiny"])

    async def main():
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x")
        handles = [dp.add_request([1, 2, 3, i], _params(), True) for i in range(6)]
        assert {h.engine for h in handles} == set(dp.cores) and [c.load for c in dp.cores] == [3, 3]
        outs = await asyncio.gather(*map(_run, handles))
        assert all(len(o.outputs[0].token_ids) for o in outs) and [c.load for c in dp.cores] == [0, 0]
        assert (await client.get("/health")).json()["status"] == "ok"

        dp.cores[0].engine.broken = True
        doomed = [h for h in (dp.add_request([4, 5, i], _params(), False) for i in range(4)) if h.engine is dp.cores[0]]
        for h in doomed:
            with pytest.raises(RequestRejected, match="injected device failure") as failed:
                await _run(h)
            assert failed.value.status == 500
        while dp.cores[0].healthy:  # a few more failed steps and the core counts as broken
            probe = dp.add_request([6, 7], _params(), False)
            if probe.engine is dp.cores[1]:  # a tie in load went the other way: that core serves it
                await _run(probe)
                continue
            with pytest.raises(RequestRejected):
                await _run(probe)
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        engines = health.json()["engines"]
        assert engines[1] == {"engine": "1", "status": "ok"} and engines[0]["status"] == "down"
        assert "steps failed in a row" in engines[0]["reason"]
        assert (await client.get("/ready")).status_code == 200
        later = [dp.add_request([8, 9, i], _params(), False) for i in range(4)]
        assert all(h.engine is dp.cores[1] for h in later)
        await asyncio.gather(*map(_run, later))
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200

        dp.cores[1].engine.broken = True
        while dp.cores[1].healthy:
            with pytest.raises(RequestRejected):
                await _run(dp.add_request([6, 7], _params(), False))
        health = await client.get("/health")
        assert health.status_code == 503 and "engine core 0" in health.json()["reason"]
        assert "engine core 1" in health.json()["reason"]
        ready = await client.get("/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"]
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"]
        await client.aclose()
    try:
        asyncio.run(main())
    finally:
        dp.shutdown()


def test_capacity_is_per_core_and_summed_over_the_serving_ones(config):
    dp = DataParallelEngine(config, 2, max_waiting=2, separate_process=False)
    dp.start()
    try:
        with pytest.raises(RequestRejected, match="holds 3 prompts") as e:
            dp.check_capacity(3)
        assert e.value.status == 400
        dp.check_capacity(2)
        dp.begin_shutdown()
        with pytest.raises(RequestRejected, match="shutting down") as e:
            dp.check_capacity(1)
        assert e.value.status == 503
    finally:
        dp.shutdown()


def test_placement_and_checks(config):
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        check_data_parallel(config, 0)
    with pytest.raises(ValueError, match="exceeds the .* CPU cores"):
        check_data_parallel(config, 10**4)
    tp = copy.copy(config)
    tp.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="cannot be combined"):
        check_data_parallel(tp, 2)
    assert core_config(config, 1, 2) is config  # the CPU: one config, threads split per process
    gpu = copy.copy(config)
    gpu.device, gpu.tensor_parallel_size = torch.device("cuda", 1), 2
    assert [core_config(gpu, i, 3).device for i in range(3)] == [torch.device("cuda", d) for d in (1, 3, 5)]
