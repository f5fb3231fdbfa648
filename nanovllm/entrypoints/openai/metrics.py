"""Server metrics in the Prometheus text exposition format, written by hand (no client library).

Counters and histograms are fed by the engine thread (as AsyncLLMEngine's listener) and rendered
on the event loop, so they sit behind one lock; gauges come from the engine's published snapshot.
Names follow vLLM's (`vllm:` -> `nanovllm:`), so existing dashboards map over easily.
"""
import threading

from nanovllm.engine.request_output import EngineStats

_PREFIX = "nanovllm:"

# Seconds. TTFT spans queueing and prefill; TPOT a single decode step.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)  # per bucket (not cumulative); +Inf is `count`
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float):
        self.count += 1
        self.sum += value
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
                break

    def render(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [], 0
        sep = "," if labels else ""
        for upper, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{{labels}{sep}le="{upper}"}} {cumulative}')
        lines.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines


class ServerMetrics:
    """The engine listener: counts tokens and finished sequences, times them."""

    def __init__(self, model_name: str):
        self._labels = f'model_name="{_escape(model_name)}"'
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.queue_time = Histogram(TTFT_BUCKETS)    # arrival -> first scheduled
        self.prefill_time = Histogram(TTFT_BUCKETS)  # first scheduled -> first token
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    # ---- called off the event loop (engine thread, or engine process reader) -------------------
    def request_added(self, num_prompt_tokens: int):
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def tokens_generated(self, n: int):
        with self._lock:
            self.generation_tokens += n

    def sequence_finished(self, seq):
        """One completion (a request with n > 1 has n) finished, stopped or was aborted
        (an `engine_core.FinishedSequence`)."""
        reason = seq.finish_reason or "abort"
        first = seq.first_token_time
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if reason == "abort":
                return  # a cancelled request's timings say nothing about the server
            self.e2e.observe(seq.time - seq.arrival_time)
            scheduled = seq.first_scheduled_time
            if scheduled is not None:
                self.queue_time.observe(scheduled - seq.arrival_time)
            if first is not None:
                self.ttft.observe(first - seq.arrival_time)
                if scheduled is not None:
                    self.prefill_time.observe(first - scheduled)
                if seq.num_tokens > 1:
                    self.tpot.observe((seq.time - first) / (seq.num_tokens - 1))

    # ---- rendering (event loop) -----------------------------------------------------------
    def render(self, stats: EngineStats) -> str:
        labels = self._labels
        out: list[str] = []

        def metric(name, kind, help_, samples):
            out.append(f"# HELP {_PREFIX}{name} {help_}")
            out.append(f"# TYPE {_PREFIX}{name} {kind}")
            out.extend(samples)

        def sample(name, value, extra=""):
            both = f"{labels},{extra}" if extra else labels
            return f"{_PREFIX}{name}{{{both}}} {value!r}"

        hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
        metric("num_requests_running", "gauge", "Requests with sequences in the running batch.",
               [sample("num_requests_running", stats.num_running)])
        metric("num_requests_waiting", "gauge", "Requests queued, waiting to be scheduled.",
               [sample("num_requests_waiting", stats.num_waiting)])
        metric("kv_cache_usage_perc", "gauge", "Fraction of KV-cache blocks in use (1 = full).",
               [sample("kv_cache_usage_perc", float(stats.kv_cache_usage))])
        metric("prefix_cache_hit_rate", "gauge", "Prompt tokens served by the prefix cache / prompt tokens looked up.",
               [sample("prefix_cache_hit_rate", float(hit_rate))])
        metric("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
               [sample("prefix_cache_queries_total", stats.prefix_cache_queries)])
        metric("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
               [sample("prefix_cache_hits_total", stats.prefix_cache_hits)])
        metric("num_preemptions_total", "counter", "Sequences preempted (KV cache full) and recomputed later.",
               [sample("num_preemptions_total", stats.num_preemptions)])
        metric("engine_steps_total", "counter", "Engine steps taken.", [sample("engine_steps_total", stats.engine_steps)])
        metric("engine_step_seconds_total", "counter", "Wall time of the engine loop inside engine steps.",
               [sample("engine_step_seconds_total", stats.step_seconds)])
        metric("engine_collect_seconds_total", "counter",
               "Wall time of the engine loop turning step results into per-request outputs.",
               [sample("engine_collect_seconds_total", stats.collect_seconds)])
        metric("engine_emit_seconds_total", "counter",
               "Wall time of the engine loop handing its outputs over to the server.",
               [sample("engine_emit_seconds_total", stats.emit_seconds)])
        with self._lock:
            metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                   [sample("prompt_tokens_total", self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Tokens generated.",
                   [sample("generation_tokens_total", self.generation_tokens)])
            metric("request_success_total", "counter",
                   "Finished completions (n per request) by finish reason; abort = cancelled or failed.",
                   [sample("request_success_total", count, f'finished_reason="{reason}"')
                    for reason, count in sorted(self.finished.items())])
            metric("time_to_first_token_seconds", "histogram", "Time from arrival to the first generated token.",
                   self.ttft.render(f"{_PREFIX}time_to_first_token_seconds", labels))
            metric("request_queue_time_seconds", "histogram", "Time from arrival to first joining the running batch.",
                   self.queue_time.render(f"{_PREFIX}request_queue_time_seconds", labels))
            metric("request_prefill_time_seconds", "histogram",
                   "Time from first joining the running batch to the first generated token (the prompt's chunks).",
                   self.prefill_time.render(f"{_PREFIX}request_prefill_time_seconds", labels))
            metric("time_per_output_token_seconds", "histogram", "Mean time between a completion's tokens.",
                   self.tpot.render(f"{_PREFIX}time_per_output_token_seconds", labels))
            metric("e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.",
                   self.e2e.render(f"{_PREFIX}e2e_request_latency_seconds", labels))
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} for each sample line; for tests and tools, not a full parser."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            samples[key] = float(value)
    return samples
