"""The server's host side alone: `nanovllm serve` (HTTP front end, engine process, engine loop,
scheduler, output processing) with the model replaced by a device of fixed speed, driven by
`bench_serving.py`. Throughput, TTFT and ITL then measure what the host can keep up with, on any
machine, without a GPU.

The stand-in device runs steps back to back, each `--step-ms` (+ `--prefill-us` per prefill token),
and samples token 7 for every row that samples (its logprob 0, for requests that ask); the engine
overlaps its host work with the device as on a GPU (it launches step N, then reads step N-1's
tokens, waiting for them if the device is not done).

  python scripts/bench_frontend.py --concurrency 256 --num-prompts 512 --step-ms 5

`--multi-turn`: the multi-turn chat workload instead (`bench_serving.py --multi-turn`, `--turns`,
`--system-len`; `STAGES=multiturn bash scripts/gpu_check.sh` runs it on the GPU): a prompt step costs
the stand-in device only its uncached tokens, so the client's TTFT against the server's (TTFT, queue,
prefill and the hop between them, printed after the run) shows the host's part of a TTFT.

  python scripts/bench_frontend.py --multi-turn --num-prompts 64 --input-len 64:256 --output-len 64:256 \
      --step-ms 2.5 --processes 2

`--data-parallel-size N`: N engine cores (each with a stand-in device of its own) behind the one API
process, as `nanovllm serve --data-parallel-size N` runs them. After the run the script prints the
CPU time each process took over the timed run, as a share of one CPU core: an API process near
100% (its event loop is one thread) would be the bottleneck; so would a client whose processes are
near 100% each (its CPU is printed too).

Defaults: the GPU serving benchmark's workload (`STAGES=serving bash scripts/gpu_check.sh`: inputs and outputs of
100-1024 tokens, token ids below 10,000, no tokenizer) at the H200's speed for Qwen3-0.6B (~5 ms per
decode step at 256 sequences, ~1.9 us per prefill token).
"""
import argparse
import functools
import gc
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import load_config  # noqa: E402
from nanovllm.engine.llm_engine import LLMEngine  # noqa: E402
from nanovllm.layers.sampler import LogprobsLists  # noqa: E402

# A Qwen3 small enough that its CPU start-up and KV cache cost nothing: the stand-in device never
# runs it. The vocabulary covers the prompts' token ids.
TINY_QWEN3 = load_config("tiny-qwen3.json")


class _Sampled:
    """A step's output as LLMEngine reads it: its sampling rows, and their tokens once the stand-in
    device has finished the step."""

    awaits_masks = False  # the benchmark sends no grammars
    drafts = None  # no speculative decoding

    def __init__(self, seqs, ready_at: float):
        self.seqs, self.ready_at = seqs, ready_at

    def token_ids(self) -> list[int]:
        wait = self.ready_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return [7] * len(self.seqs)

    def logprobs(self) -> LogprobsLists | None:
        """Token 7's logprob, 0, for every row when a sequence asked for logprobs: a client that reads
        the answers' ids from them (bench_serving.py --multi-turn) sends them back in its history."""
        if all(seq.logprobs is None for seq in self.seqs):
            return None
        n = len(self.seqs)
        return LogprobsLists([[7]] * n, [[0.0]] * n, [1] * n)


class StandInDeviceEngine(LLMEngine):
    """The real engine with `ModelRunner.execute` replaced by a device of fixed speed."""

    def __init__(self, config, step_s: float, prefill_s_per_token: float):
        super().__init__(config)
        self.step_s, self.prefill_s_per_token = step_s, prefill_s_per_token
        self.overlap = True  # as on a GPU: launch step N, then read step N-1
        self._device_free_at = 0.0
        self.model_runner.execute = self._execute

    def _execute(self, batch, defer_sampling: bool = False):
        seqs = [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)]
        prefill_tokens = batch.num_tokens - batch.num_decodes
        start = max(time.perf_counter(), self._device_free_at)
        self._device_free_at = start + self.step_s + prefill_tokens * self.prefill_s_per_token
        return _Sampled(seqs, self._device_free_at)


def stand_in_engine(step_s: float, prefill_s_per_token: float):
    """An engine factory for the engine process (spawned: a picklable partial of the class)."""
    return functools.partial(StandInDeviceEngine, step_s=step_s, prefill_s_per_token=prefill_s_per_token)


def serve(args):
    import uvicorn

    from nanovllm.config import Config
    from nanovllm.engine.data_parallel import DataParallelEngine
    from nanovllm.entrypoints.openai.api_server import build_app
    from nanovllm.entrypoints.openai.http_server import guarded_h11
    from nanovllm.entrypoints.openai.metrics import ServerMetrics

    config = Config(args.model_dir, load_format="dummy", device="cpu", max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len, num_kvcache_blocks=args.max_num_seqs * 8 + 64)
    metrics = ServerMetrics("stand-in", config.max_model_len)
    dp = args.data_parallel_size
    engine = DataParallelEngine(config, dp, listeners=[metrics.engine_listener(i) for i in range(dp)],
                                engine_factory=stand_in_engine(args.step_ms / 1e3, args.prefill_us / 1e6),
                                uses_cpu_cores=False)
    engine.start()
    app = build_app(engine, ["stand-in"], metrics)
    gc.collect()  # as `nanovllm serve` does: the startup heap out of the collector's reach
    gc.freeze()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning",
                http=guarded_h11(10.0))  # the HTTP protocol of `nanovllm serve`


def _cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """{pid: (what it is, user + system CPU seconds)} of the server process and its engine processes
    (Linux /proc; multiprocessing's resource tracker left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    out = {}
    for p in [pid, *children]:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        if b"resource_tracker" in cmdline:
            continue
        out[p] = ("API process" if p == pid else "engine process", (int(fields[11]) + int(fields[12])) / tick)
    return out


def _reaped_children_cpu() -> float:
    """CPU seconds of this process's children that have exited (the client, once it is done)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, default=5.0, help="the stand-in device's time per step")
    p.add_argument("--prefill-us", type=float, default=1.9, help="its extra time per prefill token")
    p.add_argument("--max-num-seqs", type=int, default=256, help="per engine core")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engine cores behind the API process")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", default="100:1024")
    p.add_argument("--output-len", default="100:1024")
    p.add_argument("--processes", type=int, default=1, help="client processes")
    p.add_argument("--multi-turn", action="store_true", help="chat conversations (bench_serving.py --multi-turn)")
    p.add_argument("--turns", default="4:8", help="with --multi-turn: turns per conversation")
    p.add_argument("--system-len", type=int, default=1000, help="with --multi-turn: the shared system prompt's tokens")
    p.add_argument("--max-model-len", type=int, default=None, help="default 4096, 8192 with --multi-turn")
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--json-out", default=None)
    p.add_argument("--serve", dest="model_dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.max_model_len is None:
        args.max_model_len = 8192 if args.multi_turn else 4096
    if args.model_dir is not None:
        return serve(args)

    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**TINY_QWEN3, "max_position_embeddings": args.max_model_len}, f)
        server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", model_dir,
                                   "--port", str(args.port), "--max-num-seqs", str(args.max_num_seqs),
                                   "--step-ms", str(args.step_ms), "--prefill-us", str(args.prefill_us),
                                   "--data-parallel-size", str(args.data_parallel_size),
                                   "--max-model-len", str(args.max_model_len)])
        base = f"http://127.0.0.1:{args.port}"
        try:
            for _ in range(120):
                try:
                    _get(base + "/health")
                    break
                except OSError:
                    if server.poll() is not None:
                        raise SystemExit("the server exited during start-up")
                    time.sleep(0.5)
            root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
            client = [sys.executable, os.path.join(root, "bench_serving.py"), "--base-url", base,
                      "--vocab-size", "10000", "--num-prompts", str(args.num_prompts),
                      "--concurrency", str(args.concurrency), "--input-len", args.input_len,
                      "--output-len", args.output_len, "--processes", str(args.processes)]
            if args.multi_turn:
                client += ["--multi-turn", "--turns", args.turns, "--system-len", str(args.system_len)]
            if args.json_out:
                client += ["--json-out", args.json_out]
            before, start, clients = _cpu_seconds(server.pid), time.perf_counter(), _reaped_children_cpu()
            status = subprocess.call(client)
            after, wall = _cpu_seconds(server.pid), time.perf_counter() - start
            for pid, (name, seconds) in after.items():  # the client's warm-up request included
                used = seconds - before.get(pid, (name, 0.0))[1]
                print(f"CPU of the {name} {pid}: {used:.1f} s in {wall:.1f} s = {used / wall:.0%} of a core")
            used = _reaped_children_cpu() - clients
            print(f"CPU of the client ({args.processes} processes): {used:.1f} s = {used / wall:.0%} of a core; "
                  f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
            totals = {}  # sample name -> its sum over the engine cores
            for line in _get(base + "/metrics").splitlines():
                if line.startswith("nanovllm:engine_") or "_seconds_sum" in line:
                    engine = re.search(r'engine="([^"]*)"', line)
                    print(line.split("{")[0] + (f"[engine {engine.group(1)}]" if engine else ""),
                          line.rsplit(" ", 1)[1])
                if line.startswith("vllm:") and "_seconds_" in line and "_bucket" not in line:
                    name = line.split("{")[0].split(" ")[0]
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            means = {name: 1e3 * totals.get(f"vllm:{name}_seconds_sum", 0.0)
                     / max(totals.get(f"vllm:{name}_seconds_count", 0), 1)
                     for name in ("time_to_first_token", "request_queue_time", "request_prefill_time")}
            ttft, queue, prefill = means.values()  # the warm-up request included
            print(f"server-side means: TTFT {ttft:.2f} ms = queue {queue:.2f} + prefill {prefill:.2f} "
                  f"+ the hop from the engine's process {ttft - queue - prefill:.2f}")
        finally:
            server.terminate()
            server.wait(30)
    return status


if __name__ == "__main__":
    sys.exit(main())
