"""Full-size GPU checks and timings of the kernels (on a CUDA machine); each subcommand's --help lists its options.

    python scripts/gpu_kernels.py [attention] [--quick]   paged attention and the KV store: correctness, timings
                                                          (the default: options alone run it)
    python scripts/gpu_kernels.py kvcopy [--tokens N]     the prefix cache's partial-block copies against a prefill step
    python scripts/gpu_kernels.py fp8 [--quick]           FP8 GEMMs, FP8 KV-cache decode, the fused RMSNorm + quant
    python scripts/gpu_kernels.py moe [--sweep]           fused MoE of a Qwen3-30B-A3B layer against a torch loop

The bodies live in benchmarks/kernels/.
"""
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMANDS = {"attention": "benchmarks.kernels.attention", "kvcopy": "benchmarks.kernels.kv_copy",
            "fp8": "benchmarks.kernels.fp8", "moe": "benchmarks.kernels.moe"}


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        sys.exit(f"gpu_kernels.py: unknown check {argv[0]!r}, one of {', '.join(COMMANDS)}; --help lists them")
    name = argv[0] if argv[:1] and argv[0] in COMMANDS else "attention"
    rest = argv[1:] if argv[:1] == [name] else argv
    importlib.import_module(COMMANDS[name]).main(rest, prog=f"gpu_kernels.py {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
