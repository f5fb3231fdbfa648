"""The package's logger: one stderr handler on the "nanovllm" logger, level from NANOVLLM_LOG_LEVEL."""
import logging
import os

_root = logging.getLogger("nanovllm")
if not _root.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    _root.addHandler(_handler)
    _root.setLevel(os.environ.get("NANOVLLM_LOG_LEVEL", "INFO").upper())
    _root.propagate = False


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
