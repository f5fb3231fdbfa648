"""`bench_serving.py --multi-turn`: chat conversations against an OpenAI-compatible server, each turn
sent when the previous answer has arrived, reporting the prefix-cache hit rate against the ideal and
TTFT (bench_serving.py's docstring describes the workload). The requests themselves go through
benchmarks/serving_client.py's `one_request`."""
import asyncio
import random
import sys
import time
from dataclasses import dataclass

from benchmarks.serving_client import Result, frozen_heap, http_client, one_request, percentiles, served_model


@dataclass
class Turn:
    conversation: int
    turn: int
    shared: int  # prompt tokens shared with earlier prompts and answers: what an ideal cache reuses
    result: Result


async def chat(client, args, model: str, system: list[int], turns, index: int, out: list[Turn], rng, ids):
    """One conversation: each turn's prompt is the history (every prompt and answer so far) plus
    the next user message, sent once the previous answer is complete."""
    history, shared = list(system), len(system) if args.warmup else 0  # the warm-up sent the system prompt
    for turn, (message, output_len) in enumerate(turns):
        prompt = history + message
        result = await one_request(client, args, model, prompt, output_len, want_tokens=True)
        out.append(Turn(index, turn, min(shared, len(prompt) - 1), result))  # the last prompt token is computed
        if not result.ok:
            return
        answer = result.token_ids
        if answer is None:  # the server spelled it as text: a stand-in the server has never seen
            history, shared = prompt + [rng.randrange(*ids) for _ in range(result.output_tokens)], len(prompt)
        else:
            history = prompt + answer
            shared = len(history)


async def plan_multi_turn(args):
    """The served model, its prompt ids, the system prompt and the conversations (seeded), after the
    untimed warm-up: a server in production has the system prompt cached."""
    model, ids = await served_model(args)
    rng = random.Random(args.seed)
    system = [rng.randrange(*ids) for _ in range(args.system_len)]
    def message():
        return [rng.randrange(*ids) for _ in range(rng.randint(*args.input_len))], rng.randint(*args.output_len)
    conversations = [[message() for _ in range(rng.randint(*args.turns))] for _ in range(args.num_prompts)]
    if args.warmup:
        async with http_client(args) as client:
            await one_request(client, args, model, system, 1)
    return model, ids, system, list(enumerate(conversations))


async def drive_conversations(args, model: str, ids, system: list[int], conversations, concurrency: int | None,
                              rate: float, seed: int):
    """Hold the conversations ((index, turns) pairs); returns (turns, start, end, client CPU seconds)."""
    rng = random.Random(seed)
    turns: list[Turn] = []
    async with http_client(args) as client:
        gate = asyncio.Semaphore(concurrency) if concurrency else None

        async def limited(i, conversation):
            talk = chat(client, args, model, system, conversation, i, turns, random.Random(args.seed + i), ids)
            if gate is None:
                return await talk
            async with gate:
                return await talk

        start, cpu = time.perf_counter(), time.process_time()
        tasks = []
        for i, conversation in conversations:
            tasks.append(asyncio.create_task(limited(i, conversation)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))  # conversations start as a Poisson process
        await asyncio.gather(*tasks)
        return turns, start, time.perf_counter(), time.process_time() - cpu


def _drive_conversation_shard(job):
    return frozen_heap(lambda: asyncio.run(drive_conversations(*job)))


def run_multi_turn(args) -> tuple[list[Turn], float, str, float]:
    """The conversations, dealt round-robin to --processes client processes as `run` deals requests.
    Also returns the busiest client process's CPU share of the run: near 1, the client (not the
    server) may be what paces the streams and inflates TTFT."""
    model, ids, system, conversations = asyncio.run(plan_multi_turn(args))
    n = min(args.processes, len(conversations))
    concurrency = -(-args.concurrency // n) if args.concurrency else None
    jobs = [(args, model, ids, system, conversations[i::n], concurrency, args.request_rate / n, args.seed + i)
            for i in range(n)]
    if n == 1:
        shards = [_drive_conversation_shard(jobs[0])]
    else:
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(n) as pool:
            shards = pool.map(_drive_conversation_shard, jobs)
    turns = [turn for shard in shards for turn in shard[0]]
    duration = max(end for _, _, end, _ in shards) - min(start for _, start, _, _ in shards)
    busiest = max(cpu / (end - start) for _, start, end, cpu in shards)
    return turns, duration, model, busiest


def report_multi_turn(args, turns: list[Turn], duration: float, model: str, client_cpu: float) -> dict:
    ok = [t for t in turns if t.result.ok]
    prompt_tokens = sum(t.result.prompt_len for t in ok)
    cached = sum(t.result.cached_tokens for t in ok)
    ideal = sum(t.shared for t in ok)
    echoed = all(t.result.token_ids is not None for t in ok)
    summary = {
        "model": model, "mode": "multi-turn", "conversations": args.num_prompts, "requests": len(turns),
        "successful": len(ok), "failed": len(turns) - len(ok), "duration_s": duration,
        "client_processes": args.processes, "client_cpu_share": client_cpu,
        "system_len": args.system_len, "prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "output_tokens": sum(t.result.output_tokens for t in ok), "answers_echoed": echoed,
        "hit_rate": cached / prompt_tokens if prompt_tokens else 0.0,
        "ideal_hit_rate": ideal / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": {k: v * 1e3 for k, v in percentiles([t.result.ttft for t in ok]).items()},
        "ttft_ms_first_turns": {k: v * 1e3 for k, v in percentiles([t.result.ttft for t in ok if t.turn == 0]).items()},
        "ttft_ms_later_turns": {k: v * 1e3 for k, v in percentiles([t.result.ttft for t in ok if t.turn > 0]).items()},
        "headers_ms": {k: v * 1e3 for k, v in percentiles([t.result.headers for t in ok]).items()},
        "e2e_latency_ms": {k: v * 1e3 for k, v in percentiles([t.result.latency for t in ok]).items()},
        "turns": [{"conversation": t.conversation, "turn": t.turn, "prompt_len": t.result.prompt_len,
                   "output_tokens": t.result.output_tokens, "cached_tokens": t.result.cached_tokens,
                   "shared_tokens": t.shared, "ttft_ms": t.result.ttft * 1e3, "headers_ms": t.result.headers * 1e3,
                   # time.perf_counter() (CLOCK_MONOTONIC on Linux): comparable with a server's on the same machine
                   "sent_s": t.result.sent} for t in ok],
    }
    line = "=" * 60
    print(f"{line}\n{'Multi-turn serving benchmark':^60}\n{line}")
    rows = [("Model", model), ("Conversations / requests", f"{args.num_prompts} / {len(turns)}"),
            ("Successful / failed requests", f"{len(ok)} / {len(turns) - len(ok)}"),
            ("Benchmark duration (s)", f"{duration:.2f}"),
            ("Busiest client process's CPU share", f"{client_cpu:.0%} of {args.processes}"),
            ("Prompt tokens", prompt_tokens),
            ("Cached prompt tokens", cached), ("Prefix hit rate (tokens)", f"{summary['hit_rate']:.2%}"),
            ("Ideal hit rate (tokens)", f"{summary['ideal_hit_rate']:.2%}" + ("" if echoed else " (prompts only)"))]
    for name, value in rows:
        print(f"{name + ':':<40}{value:>20}")
    for key, title in (("ttft_ms", "Time to first token"), ("ttft_ms_first_turns", "TTFT, first turns"),
                       ("ttft_ms_later_turns", "TTFT, later turns"), ("headers_ms", "Sent to response headers")):
        print(f"{title:-^60}")
        for stat in ("mean", "p50", "p99"):
            print(f"{stat.upper() if stat == 'mean' else stat} (ms):".ljust(40) + f"{summary[key][stat]:>20.2f}")
    print(line)
    for t in [t for t in turns if not t.result.ok][:5]:
        print(f"failed: {t.result.error}", file=sys.stderr)
    return summary
