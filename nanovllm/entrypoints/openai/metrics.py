"""/metrics: vLLM's metric names and meanings, through prometheus-client, on a private registry.

Dashboards, autoscalers and gateways written for vLLM read these unchanged. Every series carries
`model_name` (the first served name) and `engine` (the engine core's index, "0" with one core), as
vLLM labels them. Two sources feed them:

- the events an engine core reports (`EngineMetrics.record`, AsyncLLMEngine's listener, called off
  the event loop): token counters, per-request histograms, finish reasons. TTFT and the end-to-end
  latency end when this process receives the first token and the last (vLLM's front-end timing:
  they include the hop from the engine's process), the other timings are the engine's. prometheus-client's
  metrics are thread-safe; so is `WeightedHistogram`, which takes the inter-token gaps a pass
  reports as (seconds, count) pairs, a few updates per pass however many streams decode;
- the core's latest published snapshot (`EngineStats`): gauges, and counters the engine keeps
  itself, read at scrape time by `_SnapshotCollector`.

Adding a metric: a row in `_SNAPSHOT_METRICS` for an EngineStats field, or a metric in
`ServerMetrics` and a handler in `EngineMetrics` for a new kind of engine event.
"""
import bisect
import dataclasses
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.utils import floatToGoString

from nanovllm.engine.request_output import EngineStats

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's; counted from 0, so rates exist from the start

# Seconds. vLLM's bucket boundaries, with finer ones below them where a fast engine's figures fall
# (a decode step on an H200 takes ~6 ms; vLLM's token-gap buckets start at 10 ms, its request
# latency buckets at 0.3 s).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                     1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                           15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Read from each engine's latest EngineStats at scrape time: (kind, name, help, value).
_SNAPSHOT_METRICS = (
    ("gauge", "vllm:num_requests_running", "Number of requests in model execution batches.",
     lambda s: s.num_running),
    ("gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     lambda s: s.num_waiting),
    ("gauge", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     lambda s: s.kv_cache_usage),
    ("counter", "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     lambda s: s.prefix_cache_queried_tokens),
    ("counter", "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     lambda s: s.prefix_cache_hit_tokens),
    ("counter", "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
     lambda s: s.num_preemptions),
    # nanovllm's own: where the engine loop's time goes (see EngineStats).
    ("counter", "nanovllm:engine_steps", "Engine steps taken.", lambda s: s.engine_steps),
    ("counter", "nanovllm:engine_step_seconds", "Wall time of the engine loop inside engine steps.",
     lambda s: s.step_seconds),
    ("counter", "nanovllm:engine_collect_seconds",
     "Wall time of the engine loop turning step results into per-request outputs.", lambda s: s.collect_seconds),
    ("counter", "nanovllm:engine_emit_seconds", "Wall time of the engine loop handing its outputs to the server.",
     lambda s: s.emit_seconds),
    ("counter", "nanovllm:engine_prefill_steps", "Engine steps that launched prompt tokens (prefill or mixed).",
     lambda s: s.prefill_steps),
    ("counter", "nanovllm:engine_prefill_step_seconds", "Wall time of the engine loop inside those steps.",
     lambda s: s.prefill_step_seconds),
)


def token_count_buckets(max_value: int) -> list[int]:
    """vLLM's 1-2-5 series up to max_value: 1, 2, 5, 10, 20, 50, ..."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class WeightedHistogram:
    """A histogram fed (value, count) pairs: `count` observations of one value cost one update."""

    def __init__(self, buckets):
        self.bounds = tuple(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # per bucket, the last one +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1):
        i = bisect.bisect_left(self.bounds, value)  # the first bucket with value <= its bound
        with self._lock:
            self._counts[i] += count
            self._sum += value * count

    def samples(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (le, count) buckets ending with +Inf, and the sum (HistogramMetricFamily's)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        buckets, cumulative = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), counts):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        return buckets, total


class ServerMetrics:
    """The metrics of one server: its registry and, per engine core, an `EngineMetrics` listener."""

    def __init__(self, model_name: str, max_model_len: int, num_speculative_tokens: int = 0):
        """num_speculative_tokens: the engines' k when they speculate (their spec-decode series
        exist, at 0, from the start), else 0."""
        disable_created_metrics()  # as vLLM: no `_created` series next to every counter
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        token_buckets = token_count_buckets(max_model_len)

        def histogram(name, help_, buckets):
            return Histogram(name, help_, LABELS, buckets=buckets, registry=registry)

        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS,
                                     registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         LABELS, registry=registry)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       LABELS + ("finished_reason",), registry=registry)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", TOKEN_GAP_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.engines: list[EngineMetrics] = []
        registry.register(_SnapshotCollector(self.engines, num_speculative_tokens))

    def engine_listener(self, index: int = 0) -> "EngineMetrics":
        """The listener for engine core `index` (AsyncLLMEngine's `listener`)."""
        listener = EngineMetrics(self, str(index))
        self.engines.append(listener)
        return listener

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition the scraper asked for (Accept header: Prometheus text by default, or
        OpenMetrics), and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type


class EngineMetrics:
    """One engine core's series: fed by `record(events)` (see the module docstring)."""

    def __init__(self, server: ServerMetrics, engine: str):
        self.labels = labels = (server.model_name, engine)
        self.stats = EngineStats()
        self._server = server
        self.prompt_tokens = server.prompt_tokens.labels(*labels)
        self.generation_tokens = server.generation_tokens.labels(*labels)
        self.finished = {reason: server.request_success.labels(*labels, reason) for reason in FINISH_REASONS}
        for name in ("ttft", "e2e", "queue_time", "inference_time", "prefill_time", "decode_time", "request_tpot",
                     "request_prompt_tokens", "request_generation_tokens"):
            setattr(self, name, getattr(server, name).labels(*labels))
        self.token_gaps = WeightedHistogram(TOKEN_GAP_BUCKETS)
        self._handlers = {"stats": self._on_stats, "tokens": self._on_tokens, "token_gaps": self._on_token_gaps,
                          "first_tokens": self._on_first_tokens, "finished": self._on_finished,
                          "dead": self._on_dead}
        self._received = 0.0

    def record(self, events: list, received: float):
        """events: a dispatch's metric events; received: when this process got them (perf_counter)."""
        self._received = received  # one caller: the core's reader (or its thread, in process)
        handlers = self._handlers
        for event in events:
            handler = handlers.get(event[0])
            if handler is not None:  # kinds this version does not know are someone else's
                handler(*event[1:])

    def _on_stats(self, stats: EngineStats):
        self.stats = stats  # one assignment: a scrape sees one snapshot

    def _on_dead(self, _reason: str):
        """The core stopped serving: it runs nothing, queues nothing and holds no KV cache any more
        (its counters keep their last values: counters never go back)."""
        self.stats = dataclasses.replace(self.stats, num_running=0, num_waiting=0, kv_cache_usage=0.0)

    def _on_tokens(self, prompt: int, generated: int):
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)

    def _on_token_gaps(self, gaps: list):
        for seconds, count in gaps:
            self.token_gaps.observe(seconds, count)

    def _on_first_tokens(self, arrivals: list):
        received = self._received
        for arrival in arrivals:
            self.ttft.observe(received - arrival)

    def _on_finished(self, seq):
        """One completion (a request with n > 1 has n) ended: a `request_output.FinishedSequence`."""
        reason = seq.finish_reason
        counter = self.finished.get(reason)
        if counter is None:
            counter = self.finished[reason] = self._server.request_success.labels(*self.labels, reason)
        counter.inc()
        if reason == "abort":
            return  # cancelled or cut short: its timings say nothing about the server
        self.e2e.observe(self._received - seq.arrival_time)
        self.request_prompt_tokens.observe(seq.num_prompt_tokens)
        self.request_generation_tokens.observe(seq.num_tokens)
        scheduled, first = seq.first_scheduled_time, seq.first_token_time
        if scheduled is not None:
            self.queue_time.observe(scheduled - seq.arrival_time)
            self.inference_time.observe(seq.time - scheduled)
        if first is not None:
            if scheduled is not None:
                self.prefill_time.observe(first - scheduled)
            self.decode_time.observe(seq.time - first)
            if seq.num_tokens > 1:
                self.request_tpot.observe((seq.time - first) / (seq.num_tokens - 1))


# Speculative decoding, vLLM's series (only while an engine speculates): (name, help, SpecDecodeStats key).
_SPEC_DECODE_METRICS = (
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_decode_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_decode_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_decode_num_accepted_tokens"),
)


def _spec_decode_families(snapshots, k: int):
    none = {key: 0 for _, _, key in _SPEC_DECODE_METRICS} | {"spec_decode_num_accepted_tokens_per_pos": [0] * k}
    speculating = [(labels, stats.spec_decode or none) for labels, stats in snapshots]  # none: nothing published yet
    for name, help_, key in _SPEC_DECODE_METRICS:
        family = CounterMetricFamily(name, help_, labels=LABELS)
        for labels, spec in speculating:
            family.add_metric(labels, spec[key])
        yield family
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted tokens per draft position.", labels=LABELS + ("position",))
    for labels, spec in speculating:
        for position, count in enumerate(spec["spec_decode_num_accepted_tokens_per_pos"]):
            family.add_metric(labels + (str(position),), count)
    yield family


class _SnapshotCollector:
    """Series read at scrape time: each engine's latest EngineStats, and the token gaps."""

    def __init__(self, engines: list[EngineMetrics], num_speculative_tokens: int = 0):
        self.engines = engines
        self.num_speculative_tokens = num_speculative_tokens

    def collect(self):
        engines = list(self.engines)
        snapshots = [(e.labels, e.stats) for e in engines]  # one per engine for the whole scrape
        for kind, name, help_, value in _SNAPSHOT_METRICS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_, labels=LABELS)
            for labels, stats in snapshots:
                family.add_metric(labels, value(stats))
            yield family
        if self.num_speculative_tokens:
            yield from _spec_decode_families(snapshots, self.num_speculative_tokens)
        # The gaps between a sequence's tokens: vLLM's inter-token latency, and its older name for it.
        for name, help_ in (("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
                            ("vllm:time_per_output_token_seconds",
                             "Histogram of time per output token in seconds (the inter-token latency).")):
            family = HistogramMetricFamily(name, help_, labels=LABELS)
            for e in engines:
                buckets, total = e.token_gaps.samples()
                family.add_metric(e.labels, buckets, total)
            yield family
