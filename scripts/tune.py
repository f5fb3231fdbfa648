"""The sweeps behind the kernels' tile tables (on a CUDA machine); each subcommand's --help lists its options.

    python scripts/tune.py decode [--buckets | --splits B,...]   paged-decode tiles and split counts
                                                                 (kernels/paged_decode.py)
    python scripts/tune.py gemm [--m 1,16,...] [--only o,down]   decode projection tiles and pipeline depths,
                                                                 weights in HBM (kernels/gemm.py, kernels/qkv_rope.py)
    python scripts/tune.py prefill                               paged-prefill tiles (kernels/paged_prefill.py)

The bodies live in benchmarks/tuning/.
"""
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMANDS = {"decode": "benchmarks.tuning.decode", "gemm": "benchmarks.tuning.gemm",
            "prefill": "benchmarks.tuning.prefill"}


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"tune.py: the first argument is the sweep, one of {', '.join(COMMANDS)} (got "
                 f"{argv[0] if argv else 'none'}); --help lists them")
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:], prog=f"tune.py {argv[0]}")


if __name__ == "__main__":
    main(sys.argv[1:])
