"""Decode speed on the CPU with the embedded default model (SmolLM2-135M-Instruct, bf16): the example's two
chat prompts at 1, 2 and 16 sequences, ms per step. `--no-pack` multiplies with plain `F.linear` instead of the
oneDNN-packed weights (layers/cpu_linear.py), for an A/B in separate processes.

    python scripts/bench_cpu_decode.py [--no-pack] [--model PATH]
"""
import argparse
import time

from nanovllm import LLM, SamplingParams
from nanovllm.layers import cpu_linear


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-pack", action="store_true", help="plain F.linear (no packed weights)")
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    args = parser.parse_args()
    if args.no_pack:
        cpu_linear.packing_available = lambda dtype: False
    llm = LLM(args.model, enforce_eager=True, device="cpu")
    tok = llm.get_tokenizer()
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in ("introduce yourself", "list all prime numbers within 100")]
    llm.generate(chats, SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    label = "plain" if args.no_pack else "packed"
    for n, steps in ((1, 256), (2, 256), (16, 128)):
        params = SamplingParams(temperature=0.6, max_tokens=steps, ignore_eos=True)
        start = time.perf_counter()
        llm.generate((chats * 8)[:n], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print(f"{label}: {n:2d} sequences x {steps} tokens: {seconds / steps * 1000:.1f} ms/step, "
              f"{n * steps / seconds:.0f} tok/s")
    llm.shutdown()


if __name__ == "__main__":
    main()
