"""bench.py's configurations (configs/) and diagnostics."""
