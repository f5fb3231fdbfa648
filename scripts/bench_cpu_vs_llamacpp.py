"""Our CPU engine against llama.cpp on the embedded default model (SmolLM2-135M-Instruct, its Q4_1
GGUF), one process, alternating: greedy, 128 new tokens after the seed's first chat prompt, one
stream each, then our batch of 8 (the seed's two prompts four times) as aggregate tok/s. Each round
runs ours, llama.cpp, our batch; medians of the rounds. Two rates: the whole request (prompt and 128
tokens), and decode alone (127 tokens after the first; ours: a 128-token request less a 1-token one). llama.cpp runs in a child process that never imports torch: in one
process with torch, its prompt evaluation took seconds instead of milliseconds (two OpenMP runtimes).

llama.cpp comes from `llama-cpp-python`, a benchmark-only dependency (never a runtime or CI one):
    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python     # builds from source, 5-10 min

    python scripts/bench_cpu_vs_llamacpp.py [--cpu-threads N] [--rounds 3] [--enforce-eager]
"""
import argparse
import multiprocessing
import statistics
import time

SEED_PROMPTS = ["introduce yourself", "list all prime numbers within 100"]
NEW_TOKENS = 128
BATCH = 8


def llama_cpp_worker(conn, model_path: str, threads: int, prompt_ids: list[int]):
    """The child process: one Llama; each message asks for one timed request, answered in tok/s."""
    from llama_cpp import Llama
    llama = Llama(model_path, n_threads=threads, n_ctx=2048, verbose=False)
    while conn.recv():
        llama.reset()
        start = time.perf_counter()
        for n, _ in enumerate(llama.generate(prompt_ids, temp=0.0, top_k=1, reset=True), start=1):
            if n == 1:
                first = time.perf_counter()
            if n == NEW_TOKENS:
                break
        end = time.perf_counter()
        conn.send((NEW_TOKENS / (end - start), (NEW_TOKENS - 1) / (end - first)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-threads", type=int, default=None, help="ours and llama.cpp's (default: physical cores)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args()
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        raise SystemExit('llama-cpp-python is not installed: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python')
    import torch

    from nanovllm import LLM, SamplingParams
    from nanovllm.models.default_model import default_model_path

    llm = LLM(None, device="cpu", enforce_eager=args.enforce_eager, cpu_threads=args.cpu_threads)
    threads = torch.get_num_threads()  # what ours runs with: llama.cpp gets the same
    tokenizer = llm.get_tokenizer()
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in SEED_PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt_ids = tokenizer.encode(chats[0])  # the same tokens on both sides
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    child = context.Process(target=llama_cpp_worker, args=(child_conn, default_model_path(), threads, prompt_ids))
    child.start()

    def timed(prompts, params) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o["token_ids"]) == params.max_tokens for o in outs)
        return time.perf_counter() - start

    def ours(prompts) -> tuple[float, float]:
        """(whole-request tok/s, decode tok/s) of each sequence of prompts, summed."""
        first = timed(prompts, SamplingParams(temperature=0, max_tokens=1))
        whole = timed(prompts, greedy)
        return len(prompts) * NEW_TOKENS / whole, len(prompts) * (NEW_TOKENS - 1) / (whole - first)

    def theirs() -> tuple[float, float]:
        conn.send(True)
        return conn.recv()

    ours(chats[:1]), theirs(), ours((chats * BATCH)[:BATCH])  # warm-up
    rows = {"ours": [], "llama.cpp": [], f"ours batch {BATCH}": []}
    for i in range(args.rounds):
        rows["ours"].append(ours(chats[:1]))
        rows["llama.cpp"].append(theirs())
        rows[f"ours batch {BATCH}"].append(ours((chats * BATCH)[:BATCH]))
        print(f"round {i + 1}: " + ", ".join(f"{name} {v[-1][0]:.1f} / {v[-1][1]:.1f}" for name, v in rows.items())
              + " tok/s (whole request / decode)", flush=True)
    med = {name: [statistics.median(r[k] for r in v) for k in (0, 1)] for name, v in rows.items()}
    print(f"threads={threads} eager={args.enforce_eager}, medians of {args.rounds} rounds:")
    for k, what in enumerate(("whole request", "decode")):
        ours_, llama_, batch_ = (med[name][k] for name in rows)
        print(f"  {what}: ours {ours_:.1f} tok/s, llama.cpp {llama_:.1f} tok/s ({ours_ / llama_:.2f}x); "
              f"ours batch {BATCH} {batch_:.1f} tok/s ({batch_ / llama_:.2f}x llama.cpp's single stream)")
    conn.send(False)
    child.join()
    llm.shutdown()


if __name__ == "__main__":
    main()
