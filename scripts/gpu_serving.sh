#!/usr/bin/env bash
# The serving benchmark on the GPU machine, in one call. The image lacks the server's packages:
# run scripts/fetch_device_wheels.sh here first and carry .whl (device run ... carry: [".whl"]).
#   bash scripts/gpu_serving.sh [OUTDIR]
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/nanovllm-gpu}}
mkdir -p "$OUTDIR"
# EXTRA_WHEELS=DIR adds that folder's wheels (e.g. uvloop and httptools, which uvicorn then uses);
# CLIENT_PROCESSES=N runs the concurrency-256 client in N processes (default 4); ONLY_C256=1 runs only that.
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl ${EXTRA_WHEELS:+$EXTRA_WHEELS/*.whl} || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
model=$(mktemp -d)
cp benchmarks/configs/qwen3-0.6b.json "$model/config.json"  # random bf16 weights, no tokenizer
python3 -m nanovllm serve "$model" --load-format dummy --port 8000 > "$OUTDIR/server.log" 2>&1 &
server=$!
for _ in $(seq 180); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
status=0
# Cumulative: the TTFT sums split into time queued and time in the running batch before the first token.
metrics() { curl -s http://127.0.0.1:8000/metrics \
  | grep -E "^(vllm:(num_requests|kv_cache_usage|(time_to_first_token|request_queue_time|request_prefill_time)_seconds_(sum|count))|nanovllm:engine_)" || true; }
run() {  # the engine_* counters are cumulative: compare them before and after a run
  echo "=== $*"; metrics
  python3 bench_serving.py --base-url http://127.0.0.1:8000 --vocab-size 10000 "$@" || status=1
  metrics
}
# Four client processes at concurrency 256: one Python client parsing 256 streams can be the limit.
c256() { run --num-prompts 512 --concurrency 256 --input-len 100:1024 --output-len 100:1024 --processes ${CLIENT_PROCESSES:-4} \
           --json-out "$OUTDIR/serving_c256.json"; }
[ -n "${ONLY_C256:-}" ] && { c256; kill -TERM $server; wait $server; exit $status; }
c256
run --num-prompts 256 --request-rate 16 --input-len 100:1024 --output-len 100:512 --json-out "$OUTDIR/serving_r16.json"
run --num-prompts 64 --concurrency 1 --input-len 128 --output-len 256 --json-out "$OUTDIR/serving_c1.json"
kill -TERM $server; wait $server
exit $status
