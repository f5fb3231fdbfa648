"""`nanovllm serve --data-parallel-size N` against N=1 (or any sizes), measured by `bench_serving.py`
with the arms alternating in one run: one server per size is started first (an idle server sleeps),
then each round runs the same client workload against each server in turn, so every arm sees the
machine in the same state. Prints each run and the median per size, with its ratio to the first size.

  python scripts/bench_data_parallel.py --sizes 1 2 --rounds 3 --concurrency 32 --num-prompts 128

A size may be written N:T to start that server with OMP_NUM_THREADS=T (e.g. 1:1, one core on one
CPU thread: a control telling apart what the second core buys from what the thread split does).

The model: a random Qwen3 of `--hidden-size` / `--layers` with dummy weights (no tokenizer: token-id
prompts), on the CPU in float32 unless `--serve-args` says otherwise; or a checkpoint (`--model`).
On the CPU the cores of a data-parallel server split the host's CPU threads.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def tiny_qwen3(hidden: int, layers: int, vocab: int) -> dict:
    heads = max(hidden // 64, 2)
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": 3 * hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(heads // 2, 1), "head_dim": 64, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
            "eos_token_id": 0}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_server(model: str, arm: str, port: int, extra: list[str], log):
    size, _, threads = arm.partition(":")
    env = {**os.environ, "OMP_NUM_THREADS": threads} if threads else None
    cmd = [sys.executable, "-m", "nanovllm", "serve", model, "--port", str(port), "--data-parallel-size", size,
           "--log-level", "warning", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["1", "2"],
                   help="data-parallel sizes (N or N:OMP_THREADS), the first the baseline")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None, help="a checkpoint (default: a random tiny Qwen3, dummy weights)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=10000)
    p.add_argument("--serve-args", default="--device cpu --dtype float32 --max-num-seqs 64 "
                                            "--kv-cache-memory-bytes 268435456",
                   help="more `nanovllm serve` arguments, for every size")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", default="32:128")
    p.add_argument("--output-len", default="64")
    p.add_argument("--base-port", type=int, default=8031)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model, extra = args.model, args.serve_args.split()
        if model is None:
            model = os.path.join(tmp, "model")
            os.makedirs(model)
            with open(os.path.join(model, "config.json"), "w") as f:
                json.dump(tiny_qwen3(args.hidden_size, args.layers, args.vocab_size), f)
            extra += ["--load-format", "dummy"]
        servers = {}
        try:
            for k, size in enumerate(args.sizes):
                log = open(os.path.join(tmp, f"serve-dp{size.replace(':', 't')}.log"), "w")
                servers[size] = (start_server(model, size, args.base_port + k, extra, log),
                                 f"http://127.0.0.1:{args.base_port + k}", log)
            deadline = time.monotonic() + 600
            for size, (proc, url, log) in servers.items():
                while not _healthy(url):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.flush()
                        with open(log.name) as f:
                            print(f.read()[-3000:], file=sys.stderr)
                        raise SystemExit(f"the server with --data-parallel-size {size} did not come up")
                    time.sleep(0.5)
            results: dict[str, list[dict]] = {size: [] for size in args.sizes}
            for r in range(args.rounds):
                for k, size in enumerate(args.sizes):
                    out = os.path.join(tmp, f"r{r}-{k}.json")
                    cmd = [sys.executable, os.path.join(ROOT, "bench_serving.py"), "--base-url", servers[size][1],
                           "--vocab-size", str(args.vocab_size), "--num-prompts", str(args.num_prompts),
                           "--concurrency", str(args.concurrency), "--input-len", args.input_len,
                           "--output-len", args.output_len, "--seed", str(r), "--json-out", out]
                    if subprocess.call(cmd, stdout=None if os.environ.get("VERBOSE") else subprocess.DEVNULL) != 0:
                        raise SystemExit(f"bench_serving.py failed against --data-parallel-size {size}")
                    with open(out) as f:
                        results[size].append(json.load(f))
                    s = results[size][-1]
                    print(f"round {r} dp={size}: {s['output_throughput']:8.1f} output tok/s, "
                          f"TTFT mean {s['ttft_ms']['mean']:7.1f} ms p99 {s['ttft_ms']['p99']:7.1f} ms, "
                          f"TPOT mean {s['tpot_ms']['mean']:6.1f} ms, failed {s['failed']}", flush=True)
        finally:
            for proc, _, log in servers.values():
                proc.terminate()
            for proc, _, log in servers.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                log.close()
    base = statistics.median(s["output_throughput"] for s in results[args.sizes[0]])
    print(f"median over {args.rounds} rounds (concurrency {args.concurrency}, {args.num_prompts} prompts, "
          f"input {args.input_len}, output {args.output_len}):")
    for size in args.sizes:
        runs = results[size]
        tput = statistics.median(s["output_throughput"] for s in runs)
        print(f"  dp={size}: {tput:8.1f} output tok/s ({tput / base:.2f}x), TTFT mean "
              f"{statistics.median(s['ttft_ms']['mean'] for s in runs):7.1f} ms, p50 "
              f"{statistics.median(s['ttft_ms']['p50'] for s in runs):7.1f} ms, p99 "
              f"{statistics.median(s['ttft_ms']['p99'] for s in runs):7.1f} ms, TPOT mean "
              f"{statistics.median(s['tpot_ms']['mean'] for s in runs):6.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
