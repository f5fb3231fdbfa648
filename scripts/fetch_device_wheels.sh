#!/usr/bin/env bash
# Download the server's dependencies that the GPU machine's image lacks (it has no network) as
# Python 3.12 x86-64 wheels into .whl/, to be carried with `device run` (carry: [".whl"]).
# On the device:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#                 export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection \
  typing-extensions opentelemetry-api importlib-metadata zipp anyio idna sniffio uvicorn click h11 uvloop gguf \
  prometheus-client \
  xgrammar==0.2.9 apache-tvm-ffi
ls .whl
