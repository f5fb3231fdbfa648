#!/usr/bin/env bash
# The multi-turn chat benchmark (bench_serving.py --multi-turn) on the GPU machine, in one call: the
# same conversations against a server with prefix reuse off, against the engine in $BASELINE if given
# (an older nanovllm, e.g. full-block reuse only), and with this tree's token-granular reuse; Qwen3-0.6B,
# random bf16 weights, 256-token blocks. Then a table of hit rates and TTFTs.
#   Here, once:   bash scripts/fetch_device_wheels.sh
#                 mkdir -p .baseline && git archive 891e5c4 nanovllm | tar -x -C .baseline \
#                   && echo /.baseline/ >> .git/info/exclude        (891e5c4: before token-granular reuse)
#   Device:       BASELINE=.baseline bash scripts/gpu_multi_turn.sh      (carry: [".whl", ".baseline"])
# BENCH_ARGS replaces the workload below.
set -uo pipefail
OUTDIR=${1:-${OUT:-/tmp/nanovllm-gpu}}
mkdir -p "$OUTDIR"
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
ROOT=$PWD
model=$(mktemp -d)
cp benchmarks/configs/qwen3-0.6b.json "$model/config.json"  # random bf16 weights, no tokenizer: answers come back as ids
BENCH_ARGS=${BENCH_ARGS:-"--num-prompts 64 --turns 4:8 --system-len 1000 --input-len 64:256 --output-len 64:256 --vocab-size 10000"}
status=0
arm() {  # arm NAME ENGINE_DIR SERVER_ARGS...: a server from ENGINE_DIR's nanovllm, the benchmark, the server stopped
  local name=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH=/tmp/site exec python3 -m nanovllm serve "$model" --load-format dummy --port 8000 \
     --max-model-len 8192 "$@") > "$OUTDIR/multi_turn_server_$name.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
  echo "=== $name ($dir $*)"
  PYTHONPATH=/tmp/site python3 bench_serving.py --base-url http://127.0.0.1:8000 --multi-turn $BENCH_ARGS \
    --json-out "$OUTDIR/multi_turn_$name.json" || status=1
  kill -TERM $server; wait $server
}
arm off "$ROOT" --no-enable-prefix-caching
[ -n "${BASELINE:-}" ] && arm baseline "$(cd "$BASELINE" && pwd)"
arm token "$ROOT"
python3 - "$OUTDIR" <<'EOF'
import json, os, sys
rows = []
for name in ("off", "baseline", "token"):
    path = os.path.join(sys.argv[1], f"multi_turn_{name}.json")
    if os.path.exists(path):
        rows.append((name, json.load(open(path))))
off = dict(rows).get("off")
print(f"{'arm':<10}{'hit rate':>10}{'ideal':>8}{'TTFT p50 ms':>13}{'p99 ms':>10}{'p50 vs off':>12}")
for name, s in rows:
    ratio = off["ttft_ms"]["p50"] / s["ttft_ms"]["p50"] if off else float("nan")
    print(f"{name:<10}{s['hit_rate']:>10.2%}{s['ideal_hit_rate']:>8.2%}{s['ttft_ms']['p50']:>13.1f}"
          f"{s['ttft_ms']['p99']:>10.1f}{ratio:>11.2f}x")
EOF
exit $status
