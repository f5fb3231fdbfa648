"""/metrics: vLLM's names, types and labels through prometheus_client, read back with its official
parser; values that follow what the engine did (one metrics object fed by hand, then a real server)."""
import httpx
from prometheus_client.parser import text_string_to_metric_families

from nanovllm.engine.engine_core import FinishedSequence
from nanovllm.engine.request_output import EngineStats
from nanovllm.entrypoints.openai.metrics import ServerMetrics, WeightedHistogram, token_count_buckets
from openai_server_utils import engine_samples

# name -> type, as vLLM exposes them (the parser reports counters without their _total suffix).
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram", "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _finished(reason, arrival=10.0, scheduled=10.5, first=11.0, end=13.0, prompt=7, tokens=5):
    return FinishedSequence(reason, arrival, scheduled, first, prompt, tokens, end)


def test_names_types_labels_and_values_from_engine_events():
    metrics = ServerMetrics("tiny", max_model_len=1000)
    engines = [metrics.engine_listener(0), metrics.engine_listener(1)]  # as data-parallel cores would
    engines[0].record([
        ("stats", EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, prefix_cache_queried_tokens=100,
                              prefix_cache_hit_tokens=40, num_preemptions=1, engine_steps=9, prefill_steps=4,
                              prefill_step_seconds=0.5)),
        ("tokens", 7, 5), ("first_tokens", [12.0]), ("token_gaps", [(0.004, 64), (0.5, 1)]),
        ("finished", _finished("length")), ("finished", _finished("abort")), ("finished", _finished("error")),
        ("a_kind_from_a_later_engine", 1, 2),  # ignored, not an error
    ], received=13.0)  # TTFT and e2e end here, at the front end's receipt (vLLM's timing)
    engines[1].record([("tokens", 3, 0)], received=13.0)
    body, content_type = metrics.render()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    families = _families(body.decode())
    for name, kind in VLLM_METRICS.items():
        assert families[name].type == kind, name
        assert {s.labels["model_name"] for s in families[name].samples} == {"tiny"}, name
        assert {s.labels["engine"] for s in families[name].samples} == {"0", "1"}, name
    assert "vllm:prompt_tokens_total" in body.decode() and "_created" not in body.decode()
    m = engine_samples(body.decode())
    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert [m[name] for name in gauges] == [3, 2, 0.25]
    assert (m["vllm:prefix_cache_queries_total"], m["vllm:prefix_cache_hits_total"]) == (100, 40)
    assert m["vllm:num_preemptions_total"] == 1 and m["nanovllm:engine_steps_total"] == 9
    assert (m["nanovllm:engine_prefill_steps_total"], m["nanovllm:engine_prefill_step_seconds_total"]) == (4, 0.5)
    assert (m["vllm:prompt_tokens_total"], m["vllm:generation_tokens_total"]) == (7, 5)
    assert engine_samples(body.decode(), engine="1")["vllm:prompt_tokens_total"] == 3
    reasons = {k: v for k, v in m.items() if k.startswith("vllm:request_success_total")}
    assert reasons == {'vllm:request_success_total{finished_reason="%s"}' % r: n
                       for r, n in (("stop", 0), ("length", 1), ("abort", 1), ("error", 1))}
    # Timings: of the completions that were not aborted (length, error), from their timestamps.
    assert m["vllm:time_to_first_token_seconds_count"] == 1 and m["vllm:time_to_first_token_seconds_sum"] == 1.0
    assert m['vllm:time_to_first_token_seconds_bucket{le="1.0"}'] == 1
    assert m['vllm:time_to_first_token_seconds_bucket{le="0.75"}'] == 0
    for name, value in (("e2e_request_latency", 3.0), ("request_queue_time", 0.5), ("request_prefill_time", 0.5),
                        ("request_decode_time", 2.0), ("request_inference_time", 2.5),
                        ("request_time_per_output_token", 0.5)):
        assert m[f"vllm:{name}_seconds_count"] == 2 and m[f"vllm:{name}_seconds_sum"] == 2 * value, name
    assert m["vllm:request_prompt_tokens_sum"] == 14 and m['vllm:request_generation_tokens_bucket{le="5.0"}'] == 2
    # 65 token gaps from two (seconds, count) pairs, under both of vLLM's names.
    for name in ("inter_token_latency", "time_per_output_token"):
        assert m[f"vllm:{name}_seconds_count"] == 65
        assert abs(m[f"vllm:{name}_seconds_sum"] - (64 * 0.004 + 0.5)) < 1e-9
        assert m[f'vllm:{name}_seconds_bucket{{le="0.005"}}'] == 64
        assert m[f'vllm:{name}_seconds_bucket{{le="+Inf"}}'] == 65
    # OpenMetrics for a scraper that asks for it.
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


def test_two_servers_in_one_process_keep_their_own_series():
    a, b = ServerMetrics("a", 100), ServerMetrics("b", 100)
    a.engine_listener().record([("tokens", 5, 0)], received=0.0)
    b.engine_listener()
    assert engine_samples(a.render()[0].decode())["vllm:prompt_tokens_total"] == 5
    assert engine_samples(b.render()[0].decode())["vllm:prompt_tokens_total"] == 0


def test_weighted_histogram_and_token_buckets():
    h = WeightedHistogram((0.1, 1.0))
    h.observe(0.1, 3)  # on a bound: counted in it (le)
    h.observe(0.5)
    h.observe(7.0, 2)
    assert h.samples() == ([("0.1", 3), ("1.0", 4), ("+Inf", 6)], 0.3 + 0.5 + 14.0)
    assert token_count_buckets(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def _delta(after: dict, before: dict, key: str) -> float:
    return after[key] - before.get(key, 0.0)


def test_server_metrics_follow_the_requests(tiny_server):
    model = tiny_server.client().models.list().data[0].id
    r = httpx.get(tiny_server.url + "/metrics")
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    families = _families(r.text)
    for name, kind in VLLM_METRICS.items():
        assert families[name].type == kind and all(s.labels["model_name"] == model for s in families[name].samples)
    before = tiny_server.wait_idle()
    client = tiny_server.client()
    client.completions.create(model=model, prompt=[5, 6, 7, 8], max_tokens=6, extra_body={"ignore_eos": True})
    list(client.completions.create(model=model, prompt=[9, 10], max_tokens=3, n=2, stream=True, temperature=1.0,
                                   extra_body={"ignore_eos": True}))
    after = tiny_server.wait_idle()
    assert _delta(after, before, "vllm:prompt_tokens_total") == 4 + 2  # the n=2 prompt counts once
    assert _delta(after, before, "vllm:generation_tokens_total") == 6 + 2 * 3
    assert _delta(after, before, 'vllm:request_success_total{finished_reason="length"}') == 3
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time"):
        assert _delta(after, before, f"vllm:{name}_seconds_count") == 3, name
    assert _delta(after, before, "vllm:inter_token_latency_seconds_count") == 5 + 2 * 2
    assert _delta(after, before, "vllm:request_prompt_tokens_sum") == 4 + 2 * 2  # per completion
    # The engine's phases of a request add up: prefill + decode = running. TTFT and the end-to-end
    # latency end at the server process's receipt of the first and last tokens (vLLM's timing): the
    # engine's queued + prefill (+ decode) and the hop from the engine's process, a few ms at most.
    sums = {name: _delta(after, before, f"vllm:{name}_seconds_sum") for name in
            ("time_to_first_token", "request_queue_time", "request_prefill_time", "request_decode_time",
             "request_inference_time", "e2e_request_latency")}
    assert abs(sums["request_prefill_time"] + sums["request_decode_time"] - sums["request_inference_time"]) < 1e-6
    first_hops = sums["time_to_first_token"] - sums["request_queue_time"] - sums["request_prefill_time"]
    last_hops = sums["e2e_request_latency"] - sums["request_queue_time"] - sums["request_inference_time"]
    assert 0 < first_hops < 1.0 and 0 < last_hops < 1.0, (first_hops, last_hops)
    assert sums["request_inference_time"] > 0


def test_server_prefix_cache_counts_tokens(tiny_server):
    client = tiny_server.client()
    model = client.models.list().data[0].id
    prompt = [3 + i % 400 for i in range(300)]  # more than one 256-token block
    before = tiny_server.wait_idle()
    client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    middle = tiny_server.wait_idle()
    client.completions.create(model=model, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
    after = tiny_server.wait_idle()
    assert _delta(middle, before, "vllm:prefix_cache_queries_total") == 300
    assert _delta(after, middle, "vllm:prefix_cache_queries_total") == 300
    assert 256 <= _delta(after, middle, "vllm:prefix_cache_hits_total") < 300
