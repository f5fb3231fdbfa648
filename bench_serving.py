"""Online serving benchmark against a running OpenAI-compatible server (`nanovllm serve`, or vLLM).

Sends random token-id prompts to /v1/completions, streaming, either all at once (default), as a
Poisson process (`--request-rate`), and/or with at most `--concurrency` in flight, and reports
request and token throughput, TTFT, TPOT, ITL and end-to-end latency (mean, p50, p90, p99).

  nanovllm serve --port 8000 &
  python bench_serving.py --base-url http://127.0.0.1:8000 --num-prompts 32 --concurrency 4 \
      --input-len 32:128 --output-len 64

TTFT: request sent -> first streamed token. ITL: gaps between streamed chunks. TPOT: (latency -
TTFT) / (output tokens - 1), per request. Output tokens are the server's reported usage
(`ignore_eos` makes every request generate exactly --output-len tokens).

`--multi-turn`: chat conversations instead (`--num-prompts` of them, `--turns` each), all opening
with one system prompt of `--system-len` tokens; each turn's prompt is the conversation so far (the
previous prompt and the model's answer) plus a new user message of `--input-len` tokens, sent when
the previous answer has arrived. Conversations start at once, or at `--request-rate` per second,
at most `--concurrency` at a time; an untimed warm-up sends the system prompt alone first (a
production server has it cached). Reports the prefix-cache hit rate in tokens (the server's
`usage.prompt_tokens_details.cached_tokens` over prompt tokens) beside the ideal one (every token a
prompt shares with an earlier one reused) and TTFT. The answers' token ids come back as the
logprobs' tokens (`logprobs: 0`), which a server without a tokenizer spells as ids; a server that
spells text gets synthetic answers in the history instead, and the ideal counts the prompts only.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time

from benchmarks.multi_turn import report_multi_turn, run_multi_turn
from benchmarks.serving_client import (Result, frozen_heap, http_client, one_request,
                                      parse_range, percentiles, served_model)


async def prepare(args) -> tuple[str, list[tuple[list[int], int]]]:
    """The served model's name and the request list (seeded), after the untimed warm-up."""
    model, (lo_id, hi_id) = await served_model(args)
    rng = random.Random(args.seed)
    requests = [([rng.randrange(lo_id, hi_id) for _ in range(rng.randint(*args.input_len))],
                 rng.randint(*args.output_len)) for _ in range(args.num_prompts)]
    if args.warmup:
        async with http_client(args) as client:
            await one_request(client, args, model, requests[0][0], 4)
    return model, requests


async def drive(args, model: str, requests, concurrency: int | None, rate: float, seed: int):
    """Send the requests; returns (results, start, end) in time.perf_counter() (CLOCK_MONOTONIC on
    Linux: comparable across the client processes of one machine)."""
    rng = random.Random(seed)
    async with http_client(args) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def limited(prompt, output_len):
            if gate is None:
                return await one_request(client, args, model, prompt, output_len)
            async with gate:
                return await one_request(client, args, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt, output_len in requests:
            tasks.append(asyncio.create_task(limited(prompt, output_len)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        return results, start, time.perf_counter()


def _drive_shard(job):
    args, model, requests, concurrency, rate, seed = job
    return frozen_heap(lambda: asyncio.run(drive(args, model, requests, concurrency, rate, seed)))


def run(args) -> tuple[list[Result], float, str]:
    """With --processes N the requests are dealt round-robin to N client processes, each with
    1/N of the concurrency and of the request rate (a Poisson process split N ways is N Poisson
    processes): one Python client cannot parse hundreds of streams as fast as a GPU serves them."""
    model, requests = asyncio.run(prepare(args))
    n = min(args.processes, len(requests))
    if n == 1:
        results, start, end = _drive_shard((args, model, requests, args.concurrency, args.request_rate, args.seed))
        return results, end - start, model
    import multiprocessing
    concurrency = -(-args.concurrency // n) if args.concurrency else None
    jobs = [(args, model, requests[i::n], concurrency, args.request_rate / n, args.seed + i) for i in range(n)]
    with multiprocessing.get_context("spawn").Pool(n) as pool:
        shards = pool.map(_drive_shard, jobs)
    results: list[Result] = [None] * len(requests)
    for i, (shard, _, _) in enumerate(shards):
        results[i::n] = shard
    return results, max(end for _, _, end in shards) - min(start for _, start, _ in shards), model


def report(args, results: list[Result], duration: float, model: str) -> dict:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "model": model, "num_prompts": len(results), "successful": len(ok), "failed": len(failed),
        "request_rate": args.request_rate, "concurrency": args.concurrency, "client_processes": args.processes,
        "duration_s": duration,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * 1e3 for k, v in percentiles(
            [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]).items()},
        "itl_ms": {k: v * 1e3 for k, v in percentiles([x for r in ok for x in r.itl]).items()},
        "e2e_latency_ms": {k: v * 1e3 for k, v in percentiles([r.latency for r in ok]).items()},
    }
    # Under a concurrency limit the first `concurrency` requests go out together and queue behind
    # each other's prefills; the later ones each replace a finished request. Their TTFTs differ in kind.
    by_send = sorted(ok, key=lambda r: r.sent)
    wave = args.concurrency or 0
    if 0 < wave < len(by_send):
        summary["ttft_ms_first_wave"] = {k: v * 1e3 for k, v in percentiles([r.ttft for r in by_send[:wave]]).items()}
        summary["ttft_ms_later"] = {k: v * 1e3 for k, v in percentiles([r.ttft for r in by_send[wave:]]).items()}
    t0 = by_send[0].sent if by_send else 0.0
    summary["requests"] = [{"sent_s": r.sent - t0, "ttft_ms": r.ttft * 1e3, "e2e_ms": r.latency * 1e3,
                            "prompt_len": r.prompt_len, "output_tokens": r.output_tokens} for r in by_send]
    line = "=" * 60
    print(line)
    print(f"{'Serving benchmark':^60}")
    print(line)
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    rows = [("Model", model), ("Request rate (req/s)", rate), ("Max concurrency", args.concurrency or "-"),
            ("Successful requests", len(ok)), ("Failed requests", len(failed)),
            ("Benchmark duration (s)", f"{duration:.2f}"), ("Total input tokens", input_tokens),
            ("Total output tokens", output_tokens),
            ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}")]
    for name, value in rows:
        print(f"{name + ':':<40}{value:>20}")
    for key, title in (("ttft_ms", "Time to first token"), ("tpot_ms", "Time per output token (excl. 1st)"),
                       ("itl_ms", "Inter-token latency"), ("e2e_latency_ms", "End-to-end latency")):
        print(f"{title:-^60}")
        for stat in ("mean", "p50", "p90", "p99"):
            print(f"{stat.upper() if stat == 'mean' else stat} (ms):".ljust(40) + f"{summary[key][stat]:>20.2f}")
    if "ttft_ms_first_wave" in summary:
        first, later = summary["ttft_ms_first_wave"], summary["ttft_ms_later"]
        print(f"{'TTFT: first ' + str(wave) + ' requests / the rest':-^60}")
        for stat in ("mean", "p50", "p99"):
            print(f"{stat.upper() if stat == 'mean' else stat} (ms):".ljust(40) + f"{first[stat]:>9.2f} / {later[stat]:>8.2f}")
    print(line)
    for r in failed[:5]:
        print(f"failed: {r.error}", file=sys.stderr)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=parse_range, default=(32, 128), help="prompt tokens: N or LO:HI")
    p.add_argument("--output-len", type=parse_range, default=(64, 64), help="output tokens: N or LO:HI")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default: inf, all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=None, help="token ids to draw from (default: the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up request")
    p.add_argument("--json-out", default=None, help="also write the summary here as JSON")
    p.add_argument("--processes", type=int, default=1, help="client processes sharing the requests (default 1)")
    p.add_argument("--multi-turn", action="store_true",
                   help="chat conversations (--num-prompts of them) with a shared system prompt and growing histories")
    p.add_argument("--turns", type=parse_range, default=(4, 8), help="--multi-turn: turns per conversation, N or LO:HI")
    p.add_argument("--system-len", type=int, default=1000, help="--multi-turn: tokens of the shared system prompt")
    args = p.parse_args(argv)
    if (args.num_prompts < 1 or (args.concurrency is not None and args.concurrency < 1) or args.request_rate <= 0
            or args.processes < 1):
        p.error("--num-prompts, --concurrency and --processes must be >= 1, --request-rate > 0")
    if args.multi_turn:
        if args.system_len < 1:
            p.error("--system-len must be >= 1")
        summary = report_multi_turn(args, *run_multi_turn(args))
    else:
        summary = report(args, *run(args))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
