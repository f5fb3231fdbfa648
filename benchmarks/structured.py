"""`bench.py --structured json`: the benchmark's requests under one JSON-schema constraint, against the
same requests unconstrained, in the same run (arms alternated, each on fresh prompt tokens).

Reported: decode-step walls by batch rows, constrained over unconstrained; the host time filling the
masks per step (`worker/grammar_masks.MaskFillStats`) and in how many steps the forward pass was
still running on the device when the masks were ready (the fill was hidden behind it); compile times
of the benchmark's schema and of a typical tool's call grammar, first and cached.

A tokenizer is needed (the masks are over its tokens): with random weights, --tokenizer names a
directory with tokenizer.json / tokenizer_config.json (default: the embedded SmolLM2's, 49,152
tokens; a model's vocabulary beyond its tokenizer's is never allowed).
"""
import time
from dataclasses import replace

from nanovllm.sampling_params import SamplingParams
from nanovllm.structured_output import StructuredOutputsParams

# Twenty string fields, all required: with random weights a string ends only at a token with a
# quote, so an object takes hundreds of tokens and most steps draw under an open grammar.
SCHEMA = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)},
          "required": [f"field_{i}" for i in range(20)], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def _tool_constraint() -> StructuredOutputsParams:
    """The grammar the server compiles for tool_choice="required" with this one tool."""
    from types import SimpleNamespace

    from nanovllm.entrypoints.openai.protocol import ChatTool
    from nanovllm.entrypoints.openai.tool_parsers import ToolSet
    req = SimpleNamespace(tools=[ChatTool(**TOOL)], tool_choice="required", parallel_tool_calls=None)
    return ToolSet.from_request(req).constraint()


def _compile_times(llm) -> dict:
    compiler = llm.engine.structured.compiler
    out = {}
    for name, params in (("tool call (required, 1 tool)", _tool_constraint()),
                         ("benchmark schema (20 strings)", StructuredOutputsParams(json=SCHEMA))):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            compiler.compile(params)
            times.append(time.perf_counter() - start)
        out[name] = {"first_ms": 1e3 * times[0], "cached_ms": 1e3 * times[1]}
    return out


class _StepTimes:
    """Wraps engine.step: (decode rows, prefill tokens, wall) of every step, the wall being the time
    to the next step's start (the device's step time once the loop is bound by it)."""

    def __init__(self, engine):
        self.engine, self.inner, self.records, self._last = engine, engine.step, [], None

        def step():
            now = time.perf_counter()
            if self._last is not None:
                self.records.append((*self._last, now - self._last[2]))
            out = self.inner()
            self._last = (out[2], out[1], now)
            return out
        engine.step = step

    def close(self):
        if self._last is not None:
            self.records.append((*self._last, time.perf_counter() - self._last[2]))
        self.engine.step = self.inner

    def decode_walls(self, lo: int, hi: int) -> list[float]:
        return [wall for rows, prefill, _, wall in self.records if prefill == 0 and lo <= rows <= hi]


BINS = (("1 row", 1, 1), ("2-63 rows", 2, 63), ("64-127 rows", 64, 127), ("128+ rows", 128, 1 << 30))


def compare(llm, prompts, params: list[SamplingParams], repeat: int) -> dict:
    constrained = [replace(p, structured_outputs=StructuredOutputsParams(json=SCHEMA)) for p in params]
    compile_times = _compile_times(llm)
    llm.generate([[1, 2, 3]], replace(constrained[0], max_tokens=16), use_tqdm=False)  # warm-up
    stats = llm.engine.model_runner.mask_fill
    arms = {"unconstrained": [], "json": []}
    fills = []
    for r in range(max(1, repeat)):
        for i, (name, arm_params) in enumerate((("unconstrained", params), ("json", constrained))):
            shift = 7 + 2 * r + i  # fresh prompt tokens: no prefix-cache hits across arms
            timer = _StepTimes(llm.engine)
            stats.__init__()
            start = time.perf_counter()
            llm.generate([[(t + shift) % 10000 for t in p] for p in prompts], arm_params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            timer.close()
            arms[name].append((elapsed, timer))
            if name == "json":
                fills.append((stats.steps, stats.rows, stats.seconds, stats.hidden_steps))
    result = {"compile": compile_times, "bins": {}, "time_s": {k: [e for e, _ in v] for k, v in arms.items()}}
    for label, lo, hi in BINS:
        mean = {}
        for name, runs in arms.items():
            walls = [w for _, timer in runs for w in timer.decode_walls(lo, hi)]
            mean[name] = (sum(walls) / len(walls), len(walls)) if walls else (None, 0)
        if mean["json"][0] and mean["unconstrained"][0]:
            result["bins"][label] = {"unconstrained_ms": 1e3 * mean["unconstrained"][0], "json_ms": 1e3 * mean["json"][0],
                                     "ratio": mean["json"][0] / mean["unconstrained"][0], "steps": mean["json"][1]}
    steps, rows, seconds, hidden = (sum(x[i] for x in fills) for i in range(4))
    result["mask_fill"] = {"steps": steps, "rows_per_step": rows / max(steps, 1),
                           "ms_per_step": 1e3 * seconds / max(steps, 1),
                           "hidden_fraction": hidden / max(steps, 1) if llm.config.device.type == "cuda" else None}
    return result


def report(result: dict):
    for name, t in result["compile"].items():
        print(f"grammar compile, {name}: first {t['first_ms']:.1f} ms, cached {t['cached_ms']:.3f} ms")
    print("structured json: run times (s): " + ", ".join(f"{k} " + "/".join(f"{x:.2f}" for x in v)
                                                         for k, v in result["time_s"].items()))
    for label, b in result["bins"].items():
        print(f"  decode steps, {label:>12}: unconstrained {b['unconstrained_ms']:.2f} ms, json {b['json_ms']:.2f} ms "
              f"({b['steps']} steps): {b['ratio']:.3f}x")
    m = result["mask_fill"]
    hidden = "n/a on the CPU" if m["hidden_fraction"] is None else f"{m['hidden_fraction']:.1%} of the steps"
    print(f"  mask fill: {m['ms_per_step']:.3f} ms per constrained step ({m['rows_per_step']:.1f} rows), "
          f"forward still running when the masks were ready: {hidden}")
