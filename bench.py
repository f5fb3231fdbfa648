"""nano-vllm's throughput benchmark, reproduced exactly, with a roofline measured in the same run.

    python bench.py                       # Qwen3-0.6B architecture, random bf16 weights
    python bench.py --config benchmarks/configs/qwen3-8b.json
    python bench.py --model /path/to/Qwen3-0.6B        # real weights
    python bench.py --single              # one request: 128-token prompt, 512 new tokens, greedy
    python bench.py --structured json     # also every request under one JSON schema (benchmarks/structured.py)
    python bench.py --structured host     # only the host's grammar work per step, 1..--num-seqs rows (no model)
    python bench.py --config benchmarks/configs/qwen3-8b.json --quantization fp8   # a Qwen3-8B-FP8 user's case
    python bench.py --kv-cache-dtype fp8  # the KV cache in float8_e4m3fn
    python bench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'   # speculation's cost
    python bench.py --config benchmarks/configs/qwen3-30b-a3b.json   # a mixture of experts: the roofline
                                          # reads the weights of the experts each step routed to

Workload (nano-vllm's bench.py): random.seed(0); 256 prompts of randint(100, 1024) random token
ids in [0, 10000], then max_tokens randint(100, 1024) each; temperature 0.6, ignore_eos. One
warm-up generate, then throughput = output tokens / wall time of one generate call.
"""
import argparse
import gc
import json
import os
import random
import shutil
import tempfile
import time
from array import array
from operator import add

import torch

from benchmarks.diagnostics import ClockTrace, GcPauses, log_triton_compiles, print_segment_allocs, profile_run
from benchmarks.roofline import RoutingRecord, architecture_costs, roofline
from nanovllm import LLM, SamplingParams

HERE = os.path.dirname(os.path.abspath(__file__))


def workload(num_seqs: int, max_input: int, max_output: int):
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input))] for _ in range(num_seqs)]
    max_tokens = [random.randint(100, max_output) for _ in range(num_seqs)]
    return prompts, max_tokens


def measure_fp8_matmul(device: torch.device) -> float:
    """FP8 matmul FLOP/s: torch._scaled_mm on 8192^3 float8_e4m3fn with per-tensor scales (the library's
    best FP8 rate), median of repeats; nan where there is none."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return float("nan")
    import triton.testing
    a = torch.randn(8192, 8192, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    ms = triton.testing.do_bench(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                 warmup=50, rep=300, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192 ** 3 / (ms * 1e-3)


def measure_device(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), median of repeats."""
    if device.type != "cuda":
        return float("nan"), float("nan")
    import triton.testing
    src = torch.randn(1 << 30, dtype=torch.bfloat16, device=device)  # 2 GiB, far beyond L2
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    bandwidth = 2 * src.numel() * src.element_size() / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    flops = 2 * 8192 ** 3 / (ms * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return bandwidth, flops


class ScheduleRecorder:
    """Wraps the scheduler to record, per step, the tokens computed and the context read.

    The records go into flat integer arrays, which the garbage collector does not track: per-step
    lists of 256 ints would be ~800k list items by the end of the run, and walking them made a
    generation-1 collection inside the timed run (10-20 ms, a device stall) that the engine alone
    does not have."""

    def __init__(self, scheduler):
        self._num_decodes = array("q")
        self._row_end = array("q")  # step i's rows are [_row_end[i - 1], _row_end[i]) of the arrays below
        self._new, self._ctx, self._computed = array("q"), array("q"), array("q")
        self.times = []  # perf_counter at each scheduled step: the gaps are step times once the GPU is busy
        inner = scheduler.schedule

        def schedule(*args, **kwargs):  # the scheduler's own arguments (a speculative step's drafts)
            batch = inner(*args, **kwargs)
            if batch is not None:
                self.times.append(time.perf_counter())
                self._num_decodes.append(batch.num_decodes)
                computed = [s.num_computed_tokens for s in batch.seqs]
                self._new.extend(batch.num_new_tokens)
                self._computed.extend(computed)
                self._ctx.extend(map(add, computed, batch.num_new_tokens))
                self._row_end.append(len(self._new))
            return batch
        scheduler.schedule = schedule

    @property
    def steps(self) -> list[tuple[int, list[int], list[int], list[int]]]:
        """(decode rows, new tokens per row, context per row, computed tokens per row) per step."""
        out, lo = [], 0
        for nd, hi in zip(self._num_decodes, self._row_end):
            out.append((nd, self._new[lo:hi].tolist(), self._ctx[lo:hi].tolist(), self._computed[lo:hi].tolist()))
            lo = hi
        return out


def step_walls(times: list[float], end: float) -> list[float]:
    """Each step's wall time: the gap between its scheduling and the next step's (or the run's end)."""
    return [b - a for a, b in zip(times, times[1:] + [end])]


def prefill_walls(steps, walls) -> list[float]:
    """The walls of the steps that carry prompt tokens (prefill and mixed steps)."""
    return [w for (num_decodes, new, _, _), w in zip(steps, walls) if len(new) > num_decodes]


def step_breakdown(steps, times, end: float, step_ideal, experts_per_layer: list[float] | None = None) -> list[dict]:
    """Wall time against ideal time, by kind of step: where the run loses to the roofline (and, for a
    mixture of experts, the mean number of experts a layer routed to in those steps)."""
    bins = [("prefill/mixed", lambda nd, n: n > nd), ("decode 1-15", lambda nd, n: n == nd < 16),
            ("decode 16-63", lambda nd, n: n == nd and 16 <= nd < 64),
            ("decode 64-127", lambda nd, n: n == nd and 64 <= nd < 128),
            ("decode 128+", lambda nd, n: n == nd >= 128)]
    walls = step_walls(times, end)
    rows = []
    for name, pick in bins:
        idx = [i for i, (nd, new, _, _) in enumerate(steps) if pick(nd, len(new))]
        wall, ideal = sum(walls[i] for i in idx), sum(step_ideal[i] for i in idx)
        rows.append({"steps": name, "count": len(idx), "wall_s": wall, "ideal_s": ideal,
                     "wall_ms_per_step": 1e3 * wall / max(len(idx), 1), "ideal_ms_per_step": 1e3 * ideal / max(len(idx), 1)})
        if experts_per_layer is not None:
            rows[-1]["experts_per_layer"] = sum(experts_per_layer[i] for i in idx) / max(len(idx), 1)
    return rows


def model_dir(args) -> tuple[str, dict, str]:
    if args.model:
        with open(os.path.join(args.model, "config.json")) as f:
            return args.model, json.load(f), "auto"
    tmp = tempfile.mkdtemp(prefix="nanovllm-bench-")
    shutil.copy(args.config, os.path.join(tmp, "config.json"))
    if args.structured:  # constraints need a tokenizer beside the random weights
        from nanovllm.models.model_path import resolve_model_path
        source = args.tokenizer or resolve_model_path(None)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(source, name), os.path.join(tmp, name))
    with open(args.config) as f:
        return tmp, json.load(f), "dummy"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory with real weights (default: random weights)")
    ap.add_argument("--config", default=os.path.join(HERE, "benchmarks/configs/qwen3-0.6b.json"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="the engine's share of GPU memory (Config's default: 0.9); the KV cache gets what is left")
    ap.add_argument("--single", action="store_true", help="one request: 128-token prompt, 512 new tokens")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="fp8: block-FP8 weights (an FP8 checkpoint's format; random or plain weights are quantized "
                         "to it at load)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8 (float8_e4m3fn)")
    ap.add_argument("--speculative-config", metavar="JSON", type=json.loads, default=None,
                    help='LLM(speculative_config=...), e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\': '
                         "what speculation costs a workload whose random prompts give it nothing to propose "
                         "(steps above its disable_by_batch_size do not speculate)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="sampling filter to price (default: off; with --single the request then samples at 0.6)")
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=1,
                    help="timed runs, the later ones on other prompt tokens (the first is the reported figure)")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--steps-json", metavar="FILE",
                    help="write every step of the timed run to FILE: decode rows, tokens, wall and ideal ms")
    ap.add_argument("--clock-trace", action="store_true",
                    help="sample the GPU's SM clock and power (nvidia-smi) during the timed run; print them for "
                         "the prefill and decode segments")
    ap.add_argument("--log-compiles", action="store_true",
                    help="print every Triton kernel variant compiled after start-up (with its specialisation)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timed runs, profile one run of the same shape (other prompt tokens, so no "
                         "prefix-cache hits): device busy vs idle time and the kernels that take it")
    ap.add_argument("--alloc-trace", action="store_true",
                    help="record where the timed run's device allocations (cudaMalloc) come from (slows the run)")
    ap.add_argument("--trace", metavar="FILE", help="with --profile: write the run's chrome trace to FILE")
    ap.add_argument("--structured", choices=["json", "host"],
                    help="json: after the timed run, the same requests under one JSON schema against them "
                         "unconstrained (alternated --repeat times): decode-step times, mask-fill time, compile times; "
                         "host: only the host's grammar work per decode step (fill + accept) for 1..--num-seqs "
                         "rows of that schema, over the tokenizer and the config's vocabulary, on 1 and the "
                         "engine's default number of threads, no model")
    ap.add_argument("--tokenizer", help="with --structured and random weights: a directory with tokenizer.json and "
                                        "tokenizer_config.json (default: the embedded SmolLM2's)")
    args = ap.parse_args()

    if args.structured == "host":
        from benchmarks import structured
        from nanovllm.models.model_path import resolve_model_path
        with open(os.path.join(args.model, "config.json") if args.model else args.config) as f:
            vocab_size = json.load(f)["vocab_size"]
        host = structured.host_compare(args.tokenizer or args.model or resolve_model_path(None), vocab_size,
                                       args.num_seqs)
        structured.report_host(host)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"structured_host": host}, f, indent=1)
        return
    path, cfg, load_format = model_dir(args)
    moe = architecture_costs(cfg)["sparse_layers"] > 0
    if moe:  # the MoE layers count the experts they route to (device-side), for the roofline
        os.environ["NANOVLLM_RECORD_ROUTING"] = "1"
    # Before the engine exists: the measurement's buffers are freed and its cache emptied, which would
    # otherwise also drop the activation memory the engine keeps in the allocator.
    want = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth, flops = measure_device(torch.device(want))
    fp8_weights = args.quantization == "fp8" or (cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
    fp8_flops = measure_fp8_matmul(torch.device(want)) if fp8_weights else float("nan")
    engine_start = time.perf_counter()
    memory = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
    llm = LLM(path, enforce_eager=args.enforce_eager, max_model_len=args.max_model_len, load_format=load_format,
              device=args.device, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              speculative_config=args.speculative_config, **memory)
    device = llm.config.device
    quant = llm.config.quant_config.name if llm.config.quant_config is not None else None
    print(f"num_kvcache_blocks={llm.config.num_kvcache_blocks} block_size={llm.config.kvcache_block_size} "
          f"dtype={llm.config.torch_dtype} quantization={quant} kv_cache_dtype={llm.config.kv_cache_torch_dtype} "
          f"device={device} start-up={time.perf_counter() - engine_start:.1f}s")

    if args.single:
        random.seed(0)
        # Greedy, unless a filter is to be priced: then sampled at the benchmark's temperature.
        filtered = args.top_p < 1.0 or args.top_k > 0 or args.min_p > 0.0 or args.repetition_penalty != 1.0
        prompts = [[random.randint(0, 10000) for _ in range(128)]]
        params = [SamplingParams(temperature=0.6 if filtered else 0.0, ignore_eos=True, max_tokens=512,
                                 top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                 repetition_penalty=args.repetition_penalty)]
    else:
        prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m, top_p=args.top_p, top_k=args.top_k,
                                 min_p=args.min_p, repetition_penalty=args.repetition_penalty) for m in max_tokens]
    llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=16), use_tqdm=False)  # warm-up
    if args.log_compiles:
        log_triton_compiles()
    recorder = ScheduleRecorder(llm.engine.scheduler)
    routing = RoutingRecord(llm) if moe else None
    if routing is not None:
        routing.start()  # reads the device: before the clock starts
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        if args.alloc_trace:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    clocks = ClockTrace() if args.clock_trace else None
    gc_pauses = GcPauses()
    start, start_unix = time.perf_counter(), time.time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if routing is not None:
        routing.stop()
    if clocks is not None:
        clocks.stop()
    gc.callbacks.remove(gc_pauses.callback)
    print(f"garbage collector in the timed run: {len(gc_pauses.times)} collections "
          f"({sum(g == 2 for g in gc_pauses.generations)} full), {1e3 * sum(gc_pauses.times):.1f} ms, "
          f"longest {1e3 * max(gc_pauses.times, default=0):.1f} ms (generation@ms into the run:ms "
          f"{gc_pauses.timeline(start)})")
    if args.alloc_trace and device.type == "cuda":
        print_segment_allocs(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
    if args.log_compiles:
        print(f"timed run: {start:.3f} to {start + elapsed:.3f}")
    if device.type == "cuda":  # device allocations inside the timed run cost time (and may synchronize)
        after = torch.cuda.memory_stats()
        print("allocator in the timed run: " + ", ".join(
            f"{key} +{after.get(key, 0) - before.get(key, 0)}"
            for key in ("num_device_alloc", "num_device_free", "num_alloc_retries")))
    steps, times = recorder.steps, list(recorder.times)  # steps: a fresh list already
    for i in range(1, args.repeat):
        # Other prompt tokens of the same lengths: the same prompts would hit the prefix cache.
        first_step = len(recorder.times)
        again = time.perf_counter()
        llm.generate([[(t + i) % 10000 for t in p] for p in prompts], params, use_tqdm=False)
        took = time.perf_counter() - again
        prefill = prefill_walls(recorder.steps[first_step:], step_walls(recorder.times[first_step:], again + took))
        print(f"repeat {i} (fresh prompt tokens): {took:.2f}s, {sum(p.max_tokens for p in params) / took:,.0f} tok/s; "
              f"prefill/mixed {sum(prefill):.3f}s, step walls (ms): " + " ".join(f"{1e3 * w:.1f}" for w in prefill))
    if args.structured:
        from benchmarks import structured
        structured_result = structured.compare(llm, prompts, params, args.repeat)
        structured.report(structured_result)
    out_tokens = sum(len(o["token_ids"]) for o in outputs)
    assert out_tokens == sum(p.max_tokens for p in params)
    throughput = out_tokens / elapsed
    dtype_bytes = torch.tensor([], dtype=llm.config.torch_dtype).element_size()
    # Tensor parallelism: each rank moves and computes its shard, so the ideal is the ranks' sum.
    tp = args.tensor_parallel_size
    kv_bytes = torch.tensor([], dtype=llm.config.kv_cache_torch_dtype).element_size()
    routed = routing.per_step() if routing is not None else None
    if moe and (routed is None or len(routed) != len(steps)):
        print(f"routing record: {None if routed is None else len(routed)} forward passes for {len(steps)} steps; "
              "the roofline counts every expert in every step")
        routed = None
    costs = architecture_costs(cfg, dtype_bytes, fp8_weights=quant == "fp8", kv_dtype_bytes=kv_bytes)
    roof = roofline(cfg, steps, bandwidth * tp, flops * tp, dtype_bytes, routed, fp8_weights=quant == "fp8",
                    kv_dtype_bytes=kv_bytes, fp8_flops=fp8_flops * tp)
    ideal_tput = out_tokens / roof["ideal_time_s"]
    result = {
        "mode": "single" if args.single else "throughput", "model": args.model or os.path.basename(args.config),
        "prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": out_tokens,
        "time_s": elapsed, "throughput_tok_s": throughput, "steps": roof["steps"],
        "quantization": quant, "kv_cache_dtype": str(llm.config.kv_cache_torch_dtype),
        "measured_bandwidth_TBps": bandwidth / 1e12, "measured_matmul_TFLOPs": flops / 1e12,
        "measured_fp8_matmul_TFLOPs": fp8_flops / 1e12,
        "ideal_time_s": roof["ideal_time_s"], "roofline_tok_s": ideal_tput,
        "fraction_of_roofline": throughput / ideal_tput, "enforce_eager": args.enforce_eager,
        "tensor_parallel_size": args.tensor_parallel_size, "speculative_config": args.speculative_config,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "breakdown": step_breakdown(steps, times, start + elapsed, roof["step_ideal_s"],
                                    None if routed is None else [r / costs["sparse_layers"] for r in routed]),
    }
    if routed is not None:
        result["expert_bytes_read"] = sum(routed) * costs["expert_bytes"]
        result["mean_experts_per_layer"] = sum(routed) / len(routed) / costs["sparse_layers"]
    if args.structured:
        result["structured"] = structured_result
    if args.steps_json:
        walls = step_walls(times, start + elapsed)
        with open(args.steps_json, "w") as f:
            json.dump([{"decode_rows": nd, "tokens": sum(new), "wall_ms": 1e3 * w, "ideal_ms": 1e3 * ideal}
                       for (nd, new, _, _), w, ideal in zip(steps, walls, roof["step_ideal_s"])], f)
    print(f"Total: {out_tokens} tok, Time: {elapsed:.2f}s, Throughput: {throughput:,.0f} tok/s")
    fp8_rate = f", FP8 {fp8_flops / 1e12:.0f} TFLOP/s" if fp8_flops == fp8_flops else ""  # not nan
    print(f"Roofline (measured {bandwidth / 1e12:.2f} TB/s, {flops / 1e12:.0f} TFLOP/s{fp8_rate}"
          + (f" per GPU x {tp}" if tp > 1 else "")
          + f", {roof['steps']} steps): "
          f"ideal {roof['ideal_time_s']:.2f}s = {ideal_tput:,.0f} tok/s; achieved {throughput / ideal_tput:.1%}")
    print(f"  before the first step {1e3 * (times[0] - start):.1f} ms; prefill/mixed step walls (ms): " + " ".join(
        f"{1e3 * w:.1f}" for w in prefill_walls(steps, step_walls(times, start + elapsed))))
    if routed is not None:
        print(f"  routed experts: {result['mean_experts_per_layer']:.1f} of {costs['num_experts']} per "
              f"layer and step on average, {result['expert_bytes_read'] / 1e9:.1f} GB of expert weights in the ideal")
    for row in result["breakdown"]:
        experts = f", {row['experts_per_layer']:.1f} experts/layer" if "experts_per_layer" in row else ""
        print(f"  {row['steps']:>14}: {row['count']:5d} steps, wall {row['wall_s']:.3f}s "
              f"({row['wall_ms_per_step']:.2f} ms/step), ideal {row['ideal_s']:.3f}s ({row['ideal_ms_per_step']:.2f} ms/step)"
              + experts)
    if clocks is not None:
        unix = lambda t: start_unix + (t - start)  # noqa: E731
        first_decode = next((times[i] for i, (nd, new, _, _) in enumerate(steps) if len(new) == nd), start + elapsed)
        below_128 = next((times[i] for i, (nd, new, _, _) in enumerate(steps)
                          if len(new) == nd and times[i] >= first_decode and nd < 128), start + elapsed)
        clocks.report([("whole run", start_unix, unix(start + elapsed)),
                       ("prefill/mixed", start_unix, unix(first_decode)),
                       ("decode", unix(first_decode), unix(start + elapsed)),
                       ("decode 128+", unix(first_decode), unix(below_128)),
                       ("decode 1-127", unix(below_128), unix(start + elapsed))])
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.profile and device.type == "cuda":
        profile_run(llm, [[(t + 1) % 10000 for t in p] for p in prompts], params, trace=args.trace, steps=len(steps))
    llm.shutdown()


if __name__ == "__main__":
    main()
