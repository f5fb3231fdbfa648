"""bench.py's configurations (configs/) and diagnostics."""
import json
import os

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def load_config(name: str) -> dict:
    """A model config of configs/ (an HF config.json's fields) as a dict."""
    with open(os.path.join(CONFIGS, name)) as f:
        return json.load(f)
