#!/usr/bin/env bash
# Everything that needs the GPU, in one call: GPU tests, kernel checks, the benchmarks.
#   bash scripts/gpu_check.sh [OUTDIR]      (on the device machine: OUTDIR defaults to $OUT)
# STAGES picks what runs (default "tests kernels bench single bench8b"):
#   tests     the GPU test suite (tests/kernels tests/layers tests/gpu): over 10 minutes, more than one device
#             call may run; testskernels (tests/kernels tests/layers) and testsgpu (tests/gpu) are its halves
#   kernels   full-size paged-attention kernel checks and timings (scripts/gpu_kernels.py attention, KERNEL_ARGS)
#   bench     python bench.py (nano-vllm's benchmark, Qwen3-0.6B, random weights) with its roofline
#   single    python bench.py --single (one request, 512 new tokens)
#   bench8b   the same workload on the Qwen3-8B architecture
#   eager     bench.py with enforce_eager=True (no CUDA graphs)
#   profile   bench.py --profile (device busy vs idle over a run, the top kernels)
#   serving   the OpenAI server under bench_serving.py (concurrency 256, request rate 16, concurrency 1);
#             the device image lacks the server's packages: run scripts/fetch_device_wheels.sh first and
#             carry .whl (CLIENT_PROCESSES=N client processes at concurrency 256, default 4)
#   multiturn the multi-turn chat benchmark (bench_serving.py --multi-turn): the same conversations against a
#             server with prefix reuse off, against the engine in $BASELINE if given (an older nanovllm, e.g.
#             full-block reuse only), and with this tree's token-granular reuse; Qwen3-0.6B, random bf16
#             weights, 256-token blocks, CLIENT_PROCESSES client processes (default 4: one paces the streams);
#             then a table of hit rates and TTFTs. MULTI_TURN_ARGS replaces the
#             workload. Here, once:  bash scripts/fetch_device_wheels.sh
#                                    mkdir -p .baseline && git archive 891e5c4 nanovllm | tar -x -C .baseline \
#                                      && echo /.baseline/ >> .git/info/exclude   (891e5c4: before token-granular reuse)
#             Device:  STAGES=multiturn BASELINE=.baseline bash scripts/gpu_check.sh   (carry: [".whl", ".baseline"])
#   tp        the tensor-parallel GPU tests (two GPUs)
#   bench8btp Qwen3-8B over two GPUs (python bench.py -tp 2)
#   fp8       the FP8 kernel tests and GPU tests, then full-size FP8 kernel checks and timings (scripts/gpu_kernels.py fp8)
#   bench8bfp8  Qwen3-8B with block-FP8 weights (bench.py --quantization fp8), workload and single request
#   benchkvfp8  Qwen3-0.6B with the FP8 KV cache (bench.py --kv-cache-dtype fp8)
#   moe       the MoE kernel tests and GPU tests, then scripts/gpu_kernels.py moe (fused MoE vs a torch per-expert
#             loop over Qwen3-30B-A3B layers, bandwidth at decode sizes); moesweep: its tile sweep (MOE_TOKENS)
#   benchmoe / singlemoe / profilemoe  bench.py on Qwen3-30B-A3B (throughput, one request, --profile)
#   moefp8    scripts/gpu_kernels.py moe --fp8 (the grouped W8A8 GEMMs over block-FP8 experts); benchmoefp8: bench.py
#             on Qwen3-30B-A3B with --quantization fp8 (workload and one request); moefp8sweep: the FP8 tiles'
#             sweep (MOE_TOKENS, ~1.5 min per count)
#   spec      speculative decoding: its GPU tests and the multi-query decode kernel's, then Qwen3-8B with a Qwen3-0.6B
#             draft (random weights) forced to agree for k = 1..5 and forced wrong (benchmarks/speculative.py forced)
#   benchspec python bench.py without and with n-gram speculation configured (its random prompts give the n-gram
#             nothing to find, and at its batch sizes speculation turns itself off): what the configuration costs
#   specngram n-gram speculation on the embedded GGUF, one request copying its prompt, and the batch-size sweep of
#             disable_by_batch_size: GGUF=path/to/the.gguf (carried in two parts, ../shared/README.md), its gguf
#             wheel installed into /tmp/site
#   kvquality the FP8 KV cache's greedy text against the bf16 cache's on the embedded GGUF (GGUF=path as for
#             specngram), with the fp32 model as the rounding noise floor (benchmarks/kv_cache_agreement.py)
set -o pipefail
OUTDIR=${1:-${OUT:-/tmp/nanovllm-gpu}}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"tests kernels bench single bench8b"}
status=0
run() {  # run NAME CMD...: log to $OUTDIR/NAME.log, remember failures, keep going
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUTDIR/$name.log" || { echo "=== $name FAILED"; status=1; }
}

server_packages() {  # the server's wheels (scripts/fetch_device_wheels.sh, carried as .whl) into /tmp/site
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
}

serving() {
  server_packages || return 1
  local model port=8000
  model=$(mktemp -d)
  cp benchmarks/configs/qwen3-0.6b.json "$model/config.json"  # random bf16 weights, no tokenizer
  PYTHONPATH=/tmp/site:$PWD python3 -m nanovllm serve "$model" --load-format dummy --port $port \
    > "$OUTDIR/server.log" 2>&1 &
  local server=$!
  for _ in $(seq 180); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 1; done
  local client=(env PYTHONPATH=/tmp/site:$PWD python3 bench_serving.py --base-url http://127.0.0.1:$port --vocab-size 10000)
  run serving_c256 "${client[@]}" --num-prompts 512 --concurrency 256 --input-len 100:1024 --output-len 100:1024 \
    --processes "${CLIENT_PROCESSES:-4}" --json-out "$OUTDIR/serving_c256.json"
  run serving_r16 "${client[@]}" --num-prompts 256 --request-rate 16 --input-len 100:1024 --output-len 100:512 \
    --json-out "$OUTDIR/serving_r16.json"
  run serving_c1 "${client[@]}" --num-prompts 64 --concurrency 1 --input-len 128 --output-len 256 \
    --json-out "$OUTDIR/serving_c1.json"
  curl -s http://127.0.0.1:$port/metrics | grep -E "^(vllm|nanovllm):" > "$OUTDIR/serving_metrics.txt"
  kill -TERM $server; wait $server
}

multiturn() {
  server_packages || return 1
  local root=$PWD model
  model=$(mktemp -d)
  cp benchmarks/configs/qwen3-0.6b.json "$model/config.json"  # random bf16 weights, no tokenizer: answers come back as ids
  local args=${MULTI_TURN_ARGS:-"--num-prompts 64 --turns 4:8 --system-len 1000 --input-len 64:256 --output-len 64:256 --vocab-size 10000"}
  multiturn_arm off "$root" --no-enable-prefix-caching
  [ -n "${BASELINE:-}" ] && multiturn_arm baseline "$(cd "$BASELINE" && pwd)"
  multiturn_arm token "$root"
  python3 - "$OUTDIR" <<'EOF'
import json, os, sys
from prometheus_client.parser import text_string_to_metric_families
def server_side(name):  # from /metrics, means in ms: TTFT as the server saw it (arrival to the first token's
    path = os.path.join(sys.argv[1], f"multi_turn_metrics_{name}.txt")  # receipt), its queue and prefill parts, a step
    values = {}  # sample name (counters without _total) -> the sum over its label sets
    for family in text_string_to_metric_families(open(path).read() if os.path.exists(path) else ""):
        for sample in family.samples:
            key = sample.name.removesuffix("_total")
            values[key] = values.get(key, 0.0) + sample.value
    def mean(metric, count=None):
        return 1e3 * values.get(metric + "_sum", values.get(metric, 0)) / max(values.get(count or metric + "_count", 0), 1)
    steps, prefill_steps = values.get("nanovllm:engine_steps", 0), values.get("nanovllm:engine_prefill_steps", 0)
    decode_seconds = values.get("nanovllm:engine_step_seconds", 0) - values.get("nanovllm:engine_prefill_step_seconds", 0)
    return (mean("vllm:time_to_first_token_seconds"), mean("vllm:request_queue_time_seconds"),
            mean("vllm:request_prefill_time_seconds"), mean("nanovllm:engine_step_seconds", "nanovllm:engine_steps"),
            mean("nanovllm:engine_prefill_step_seconds", "nanovllm:engine_prefill_steps"),
            1e3 * decode_seconds / max(steps - prefill_steps, 1))
rows = []
for name in ("off", "baseline", "token"):
    path = os.path.join(sys.argv[1], f"multi_turn_{name}.json")
    if os.path.exists(path):
        rows.append((name, json.load(open(path))))
off = dict(rows).get("off")
print(f"{'arm':<15}{'hit rate':>9}{'ideal':>8}{'TTFT p50':>9}{'p99':>8}{'vs off':>8}{'mean':>7}"
      f"{'headers':>8}{'server':>8}{'queue':>7}{'prefill':>8}{'hop':>6}{'step':>6}{'w/ prompt':>10}{'decode':>7}"
      f"{'client CPU':>11}   (ms; headers: the client's p50 to the response's headers, sent once the engine took"
      " the request in; server-side means from /metrics, hop: the first token's from the engine to the server"
      " process; steps: all, those with prompt tokens, decode-only)")
for name, s in rows:
    ratio = off["ttft_ms"]["p50"] / s["ttft_ms"]["p50"] if off else float("nan")
    ttft, queue, prefill, step, prompt_step, decode_step = server_side(name)
    print(f"{name:<15}{s['hit_rate']:>9.2%}{s['ideal_hit_rate']:>8.2%}{s['ttft_ms']['p50']:>9.1f}"
          f"{s['ttft_ms']['p99']:>8.1f}{ratio:>7.2f}x{s['ttft_ms']['mean']:>7.1f}"
          f"{s.get('headers_ms', {}).get('p50', float('nan')):>8.1f}{ttft:>8.1f}{queue:>7.1f}{prefill:>8.1f}"
          f"{ttft - queue - prefill:>6.1f}"
          f"{step:>6.2f}{prompt_step:>10.2f}{decode_step:>7.2f}{s.get('client_cpu_share', float('nan')):>10.0%}")
EOF
}

multiturn_arm() {  # multiturn_arm NAME ENGINE_DIR SERVER_ARGS...: a server from ENGINE_DIR's nanovllm, the benchmark, the server stopped
  local name=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH=/tmp/site exec python3 -m nanovllm serve "$model" --load-format dummy --port 8000 \
     --max-model-len 8192 "$@") > "$OUTDIR/multi_turn_server_$name.log" 2>&1 &
  local server=$!
  for _ in $(seq 300); do curl -sf http://127.0.0.1:8000/health > /dev/null && break; sleep 1; done
  echo "=== $name ($dir $*)"
  PYTHONPATH=/tmp/site python3 bench_serving.py --base-url http://127.0.0.1:8000 --multi-turn $args \
    --processes "${CLIENT_PROCESSES:-4}" \
    --json-out "$OUTDIR/multi_turn_$name.json" || status=1
  curl -sf http://127.0.0.1:8000/metrics > "$OUTDIR/multi_turn_metrics_$name.txt"  # the server's side of TTFT
  kill -TERM $server; wait $server
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for stage in $STAGES; do
  case $stage in
    tests|testskernels|testsgpu)  # xgrammar (structured outputs) and the server's packages come from the carried .whl
      server_packages || status=1
      case $stage in tests) dirs="tests/kernels tests/layers tests/gpu" ;; testskernels) dirs="tests/kernels tests/layers" ;;
                     testsgpu) dirs="tests/gpu" ;; esac
      run "$stage" env PYTHONPATH=/tmp/site:$PWD python3 -m pytest $dirs -q -p no:cacheprovider --durations=8 ;;
    kernels)   run kernels python3 scripts/gpu_kernels.py attention ${KERNEL_ARGS:-} ;;
    bench)     run bench python3 bench.py --json "$OUTDIR/bench_qwen3_0.6b.json" ;;
    single)    run single python3 bench.py --single --json "$OUTDIR/bench_single.json" ;;
    bench8b)   run bench8b python3 bench.py --config benchmarks/configs/qwen3-8b.json --json "$OUTDIR/bench_qwen3_8b.json" ;;
    eager)     run eager python3 bench.py --enforce-eager --json "$OUTDIR/bench_qwen3_0.6b_eager.json" ;;
    profile)   run profile python3 bench.py --profile ;;
    serving)   serving || status=1 ;;
    multiturn) multiturn || status=1 ;;
    tp)        run tp python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py -q -p no:cacheprovider --durations=8 ;;
    bench8btp) run bench8btp python3 bench.py --config benchmarks/configs/qwen3-8b.json -tp 2 --json "$OUTDIR/bench_qwen3_8b_tp2.json" ;;
    fp8)
      run fp8_tests python3 -m pytest tests/kernels/test_fp8_gemm.py tests/kernels/test_fp8_quant.py \
        tests/kernels/test_fp8_kv_cache.py tests/gpu/test_fp8_gpu.py -q -p no:cacheprovider --durations=5
      run fp8_kernels python3 scripts/gpu_kernels.py fp8 ;;
    bench8bfp8)
      run bench8b_fp8 python3 bench.py --config benchmarks/configs/qwen3-8b.json --quantization fp8 --json "$OUTDIR/bench_qwen3_8b_fp8.json"
      run single8b_fp8 python3 bench.py --config benchmarks/configs/qwen3-8b.json --quantization fp8 --single --json "$OUTDIR/single_qwen3_8b_fp8.json"
      run single8b python3 bench.py --config benchmarks/configs/qwen3-8b.json --single --json "$OUTDIR/single_qwen3_8b.json" ;;
    benchkvfp8) run bench_kvfp8 python3 bench.py --kv-cache-dtype fp8 --json "$OUTDIR/bench_qwen3_0.6b_kvfp8.json" ;;
    moe)
      run moe_tests python3 -m pytest tests/kernels/test_moe.py tests/gpu/test_moe_gpu.py -q -p no:cacheprovider --durations=8
      run moe_kernels python3 scripts/gpu_kernels.py moe ;;
    moesweep)  run moesweep python3 scripts/gpu_kernels.py moe --sweep --tokens ${MOE_TOKENS:-16,256} ;;
    benchmoe)  run benchmoe python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --json "$OUTDIR/bench_qwen3_30b_a3b.json" ;;
    moefp8)    run moe_fp8_kernels python3 scripts/gpu_kernels.py moe --fp8 ;;
    moefp8sweep) run moefp8sweep python3 scripts/gpu_kernels.py moe --fp8 --sweep --tokens ${MOE_TOKENS:-1,16,64} ;;
    benchmoefp8)
      run benchmoe_fp8 python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --quantization fp8 \
        --json "$OUTDIR/bench_qwen3_30b_a3b_fp8.json"
      run singlemoe_fp8 python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --quantization fp8 --single \
        --json "$OUTDIR/bench_qwen3_30b_a3b_fp8_single.json" ;;
    singlemoe) run singlemoe python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --single --json "$OUTDIR/bench_qwen3_30b_a3b_single.json" ;;
    profilemoe) run profilemoe python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --profile ;;
    spec)
      run spec_tests python3 -m pytest tests/gpu/test_spec_decode_gpu.py tests/kernels/test_paged_decode.py \
        -q -p no:cacheprovider --durations=5
      run spec_forced python3 -m benchmarks.speculative forced --max-tokens 256 --repeat 2 \
        --json "$OUTDIR/spec_forced_qwen3_8b.json" ;;
    benchspec)
      run bench_plain python3 bench.py --json "$OUTDIR/bench_qwen3_0.6b.json"
      run bench_spec python3 bench.py --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}' \
        --json "$OUTDIR/bench_qwen3_0.6b_spec_ngram.json" ;;
    specngram)
      run spec_ngram env PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.speculative ngram --model "${GGUF:?GGUF=path}" \
        --batch-sizes ${SPEC_BATCH_SIZES:-1,8,16,32,64} --repeat 2 --json "$OUTDIR/spec_ngram.json" ;;
    kvquality)
      run kv_quality env PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.kv_cache_agreement --model "${GGUF:?GGUF=path}" \
        --noise-floor float32 --json "$OUTDIR/kv_quality.json" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
