"""The sweeps behind the kernels' tile tables, one module per `scripts/tune.py` subcommand."""
