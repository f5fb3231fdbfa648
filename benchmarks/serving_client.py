"""The client side of bench_serving.py: one streamed /v1/completions request timed (TTFT, the
response's headers, inter-token gaps, end to end, cached tokens), the HTTP client, the served model,
percentiles; shared by the request benchmark (bench_serving.py) and the multi-turn one
(benchmarks/multi_turn.py)."""
import argparse
import gc
import json
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    sent: float = 0.0  # time.perf_counter() when the request went out
    ttft: float = 0.0
    headers: float = 0.0  # request sent -> the response's headers (the server accepted it), seconds
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the server served from its prefix cache (usage)
    token_ids: list[int] | None = None  # the answer, with --multi-turn (None: the server spells text)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


async def one_request(client: httpx.AsyncClient, args, model: str, prompt: list[int], output_len: int,
                      want_tokens: bool = False) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": args.temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if want_tokens:
        body["logprobs"] = 0
    result = Result(prompt_len=len(prompt))
    tokens = []
    start = last = result.sent = time.perf_counter()
    first_choice = None  # when the first chunk with a choice came
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            result.headers = time.perf_counter() - start
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = data["error"].get("message", "error")
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                    result.cached_tokens = (data["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for c in data.get("choices", []) if want_tokens else ():
                    tokens += (c.get("logprobs") or {}).get("tokens") or []
                if first_choice is None and data.get("choices"):
                    first_choice = time.perf_counter()
                # A chunk per generated token counts, even with empty text (a model without a
                # tokenizer, or text held back at a possible stop string); a bare final chunk does not.
                if any(c.get("text") or (c.get("text") is not None and c.get("finish_reason") is None)
                       for c in data.get("choices", [])):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        if result.ttft == 0.0 and first_choice is not None:
            # Every token came in the final chunk (a stream merged while the server was busy, its
            # text empty or held back): the first token arrived with it.
            result.ttft = first_choice - start
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no usage in the stream"
        if want_tokens and len(tokens) == result.output_tokens and all(t.isdigit() for t in tokens):
            result.token_ids = [int(t) for t in tokens]
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def http_client(args) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits)


async def served_model(args) -> tuple[str, int]:
    """The served model's name and the token ids to draw prompts from (the lowest ids, usually
    special tokens, are skipped)."""
    async with http_client(args) as client:
        card = (await client.get("/v1/models")).raise_for_status().json()["data"][0]
    vocab = args.vocab_size or card.get("vocab_size") or 1000
    return args.model or card["id"], (min(100, vocab // 4), vocab)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p):  # nearest-rank on the sorted values, interpolated
        k = (len(ordered) - 1) * p / 100
        f = int(k)
        c = min(f + 1, len(ordered) - 1)
        return ordered[f] + (ordered[c] - ordered[f]) * (k - f)
    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def frozen_heap(run):
    """run() with the heap so far (httpx, the prompts) out of the cyclic collector's reach: a full
    collection walking it would pause this process's streams and add its milliseconds to the TTFTs
    measured meanwhile (`nanovllm serve` freezes its heap likewise)."""
    gc.collect()
    gc.freeze()
    try:
        return run()
    finally:
        gc.unfreeze()  # main() may run in a caller's process
