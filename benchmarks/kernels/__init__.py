"""Full-size GPU checks and timings of the kernels, one module per `scripts/gpu_kernels.py` subcommand."""
