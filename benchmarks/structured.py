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

import numpy as np

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


# ---- the host side alone (`bench.py --structured host`): no model, any machine ----------------


def _draw(rng, bits, vocab_size: int):
    """A random allowed token per mask row (what random weights draw), from candidates tried
    first and the row's full mask where none of them is allowed."""
    n = bits.shape[0]
    cand = rng.integers(0, vocab_size, size=(n, 64))
    rows = np.arange(n)[:, None]
    ok = (bits[rows, cand >> 5] >> (cand & 31).astype(np.uint32)) & 1
    first = ok.argmax(1)
    tokens = cand[np.arange(n), first]
    for r in np.flatnonzero(ok[np.arange(n), first] == 0):
        allowed = np.flatnonzero(np.unpackbits(bits[r].view(np.uint8), bitorder="little")[:vocab_size])
        tokens[r] = rng.choice(allowed)
    return tokens.tolist()


def host_costs(tokenizer_dir: str, vocab_size: int | None = None, rows=(1, 16, 256), steps: int = 40,
               seed: int = 0, num_threads: int | None = None) -> dict:
    """Per decode step, the host time of the engine's grammar calls for `rows` sequences under the
    benchmark's schema: `advance` (accept the drawn tokens) and `fill_masks` (the next masks), as
    `LLMEngine.step` makes them. Tokens are drawn at random among the allowed ones (random weights);
    a sequence whose grammar ends is replaced (untimed), so every row stays under an open grammar."""
    import torch
    from transformers import AutoTokenizer

    from nanovllm.engine.sequence import Sequence
    from nanovllm.structured_output.manager import Phase, StructuredOutputs
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab_size = vocab_size or len(tokenizer)
    manager = StructuredOutputs(tokenizer, vocab_size, {tokenizer.eos_token_id}, num_threads=num_threads)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    manager.check(params)  # compiled once, outside the timings
    rng = np.random.default_rng(seed)
    masks = torch.zeros(max(rows), manager.words, dtype=torch.int32)
    mask_rows = np.zeros(max(rows), dtype=np.int32)
    bits = masks.numpy().view(np.uint32)

    def fresh():
        seq = Sequence([1, 2, 3], params, seed=0)
        manager.attach([seq])
        return seq
    out = {"vocab_size": vocab_size, "threads": manager.threads.num_threads, "rows": {}}
    for n in rows:
        seqs = [fresh() for _ in range(n)]
        accept = fill = 0.0
        for step in range(steps + 2):  # two warm-up steps
            t0 = time.perf_counter()
            num = manager.fill_masks(seqs, mask_rows, masks)
            t1 = time.perf_counter()
            tokens = _draw(rng, bits[:num], vocab_size)
            t2 = time.perf_counter()
            rejected = manager.advance(seqs, tokens)
            t3 = time.perf_counter()
            assert num == n and not rejected
            if step >= 2:
                fill, accept = fill + t1 - t0, accept + t3 - t2
            for i, seq in enumerate(seqs):
                if seq.grammar.phase != Phase.ACTIVE:  # the object is complete
                    manager.release(seq)
                    seqs[i] = fresh()
        for seq in seqs:
            manager.release(seq)
        out["rows"][n] = {"fill_ms": 1e3 * fill / steps, "accept_ms": 1e3 * accept / steps,
                          "total_ms": 1e3 * (fill + accept) / steps, "us_per_row": 1e6 * (fill + accept) / steps / n}
    return out


def host_compare(tokenizer_dir: str, vocab_size: int | None = None, max_rows: int = 256, repeat: int = 2) -> dict:
    """host_costs for 1, 2, 4 ... max_rows rows on one thread and on the engine's default number of
    threads (where more than one), alternated `repeat` times; per arm and row count the fastest
    run's figures."""
    from nanovllm.structured_output.threads import default_num_threads
    arms = sorted({1, 8, default_num_threads()})  # the default (one thread) against a pool of 8
    rows = sorted({1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows} | {max_rows})
    runs = {t: [] for t in arms}
    for _ in range(repeat):
        for t in arms:
            runs[t].append(host_costs(tokenizer_dir, vocab_size, rows, num_threads=t))
    out = {"vocab_size": runs[1][0]["vocab_size"], "default_threads": arms[-1], "threads": {}}
    for t, results in runs.items():
        out["threads"][t] = {n: min((r["rows"][n] for r in results), key=lambda x: x["total_ms"])
                             for n in results[0]["rows"]}
    return out


def report_host(result: dict):
    print(f"structured host costs per decode step (vocab {result['vocab_size']}; the engine's default: "
          f"{result['default_threads']} thread(s)):")
    for t, rows in result["threads"].items():
        for n, r in rows.items():
            print(f"  {t} thread(s), {n:>4} rows: fill {r['fill_ms']:.3f} ms + accept {r['accept_ms']:.3f} ms = "
                  f"{r['total_ms']:.3f} ms ({r['us_per_row']:.1f} us/row)")
