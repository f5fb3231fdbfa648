"""The `nanovllm` command: generate, chat and serve, on the embedded default model unless told."""
import argparse
import sys

from nanovllm.models.default_model import DEFAULT_MODEL_NAME


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None, help=f"model directory or .gguf file (default: {DEFAULT_MODEL_NAME})")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads on the CPU (default: physical cores)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs (or CPU processes) to split the model over")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model dtype) or fp8: twice the tokens per byte")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="A fast, readable LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,chat,serve}")
    gen = sub.add_parser("generate", help="complete one prompt and print the completion")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_model_args(gen)
    chat = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_model_args(chat)
    from nanovllm.entrypoints.openai.api_server import add_serve_arguments
    add_serve_arguments(sub.add_parser("serve", help="OpenAI-compatible HTTP server"))
    return parser


def _params(args):
    from nanovllm import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)


def _llm(args):
    from nanovllm import LLM
    return LLM(args.model, device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager,
               tensor_parallel_size=args.tensor_parallel_size, kv_cache_dtype=args.kv_cache_dtype,
               cpu_threads=args.cpu_threads)


def cmd_generate(args) -> int:
    params = _params(args)  # validated before the model loads
    llm = _llm(args)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate([args.prompt], params, use_tqdm=False)
    print(out[0]["text"])
    return 0


def cmd_chat(args) -> int:
    params = _params(args)
    llm = _llm(args)
    tokenizer = llm.get_tokenizer()
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"Chatting with {args.model or DEFAULT_MODEL_NAME}. Empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            user = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not user.strip():
            return 0
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply = []
        try:
            for piece in llm.stream(ids, params):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            pass  # stop this answer, keep the conversation
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "chat":
            return cmd_chat(args)
        from nanovllm.entrypoints.openai.api_server import run_server
        return run_server(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.print_usage(sys.stderr)
        print(f"nanovllm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
