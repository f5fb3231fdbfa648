#!/usr/bin/env bash
# Set up (if needed) and run the test suite on the CPU; Triton kernels run in the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest tests -q -p no:cacheprovider --durations=30 "$@"
