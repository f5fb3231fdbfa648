#!/usr/bin/env bash
# Everything that needs the GPU, in one call: GPU tests, kernel timings, the benchmarks.
#   bash scripts/gpu_check.sh [OUTDIR]      (on the device machine: OUTDIR defaults to $OUT)
# Stages can be picked with STAGES="tests kernels bench single bench8b" (that default), or with
# any of: eager (enforce_eager=True), nosplitk (A/B of the split-K projections), topp (top-p 0.9 + top-k 50),
# topponly (top-p 0.9 alone), filters (llama.cpp-style top-k 40 + top-p 0.95 + min-p 0.05, then Qwen2.5's
# generation config: top-k 20 + top-p 0.8 + repetition penalty 1.05),
# nopdl (programmatic dependent launch off), profile (device busy vs idle over a run, top kernels),
# host (host time per engine-step stage at a few batch sizes), hostprefill (the same for the benchmark's
# prefill steps), hoststages (bench.py with the host time per stage of its prefill steps), clocks (bench.py with
# the SM clock and power sampled over the run), balanced (the balanced
# decode schedule: kernel per batch size, then bench.py with it at every size), gemm (decode projections: cuBLAS vs our
# GEMM over a tile sweep), gemmstages (the same with the weights in HBM: the tables' pipeline depths and tiles),
# prefillprofile (device time and top kernels of each of the benchmark's prefill steps), sample (the sampling pass at decode batch sizes),
# sampletopk (the top-k/top-p and top-p draws: the torch path against kernels/sample_top_k.py and sample_top_p.py),
# splits (decode attention at every split count, 4-80 sequences), nanobatch (two half-batches on two streams, also with
# the balanced attention at 100/132/264 programs), nanobatchtail (the same at 16-96 sequences with the long contexts
# of the run's tail), ablate (a decode step with one kind of kernel deleted: ceilings for fusions), replay (engine step against its CUDA graphs replayed back to back),
# barrier (dependent projections as kernels vs one persistent kernel with grid barriers, and the synchronisation
# alone), decoderamp (decode attention: the same bytes in programs of different lengths), decodeloads (decode attention against
# its loads alone, and K/V side by side), prefilltiles (prefill
# attention tiles, K/V by pointers and through TMA), lmhead (the LM head and the sampling draw in one kernel vs cuBLAS +
# the sampling pass), green (decode attention and the other half-batch's GEMMs on disjoint SMs through CUDA green
# contexts), libgemm (the decode projections through cuBLAS, cuBLASLt and CUTLASS's grouped GEMM against ours, weights
# from HBM), ncu (Nsight Compute's counters for decode attention and the decode projections), moe (the fused-MoE kernel and
# GPU tests, then scripts/bench_moe.py: fused vs a torch per-expert loop, bandwidth at decode sizes), moesweep (its tile
# sweep), benchmoe / singlemoe (bench.py on Qwen3-30B-A3B, throughput and one request), profilemoe (bench.py --profile on it:
# device time by kind of kernel), and on a two-GPU machine tp (the tensor-parallel GPU tests), bench8btp (Qwen3-8B over two GPUs) and
# bench8btp1shot (the same with the one-shot all-reduce, NANOVLLM_ONE_SHOT_ALL_REDUCE=1).
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
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
for stage in $STAGES; do
  case $stage in
    tests)   run tests python3 -m pytest tests/kernels tests/layers tests/gpu -q -p no:cacheprovider --durations=8 ;;
    kernels) run kernels python3 scripts/gpu_kernels.py ${KERNEL_ARGS:-} ;;
    bench)   run bench python3 bench.py --json "$OUTDIR/bench_qwen3_0.6b.json" ;;
    eager)   run eager python3 bench.py --enforce-eager --json "$OUTDIR/bench_qwen3_0.6b_eager.json" ;;
    nosplitk) run nosplitk python3 bench.py --no-split-k --json "$OUTDIR/bench_qwen3_0.6b_nosplitk.json" ;;
    topp)    run topp python3 bench.py --top-p 0.9 --top-k 50 --json "$OUTDIR/bench_qwen3_0.6b_topp.json" ;;
    topponly) run topponly python3 bench.py --top-p 0.9 --json "$OUTDIR/bench_qwen3_0.6b_topponly.json" ;;
    filters) run filters_minp python3 bench.py --top-k 40 --top-p 0.95 --min-p 0.05
             run filters_penalty python3 bench.py --top-k 20 --top-p 0.8 --repetition-penalty 1.05 ;;
    nopdl)   NANOVLLM_PDL=0 run nopdl python3 bench.py --json "$OUTDIR/bench_qwen3_0.6b_nopdl.json" ;;
    profile) run profile python3 bench.py --profile ;;
    host)    run host python3 scripts/host_timing.py ;;
    hostprefill) run hostprefill python3 scripts/host_timing.py --prefill ;;
    hoststages) run hoststages python3 bench.py --host-stages ;;
    clocks)  run clocks python3 bench.py --clock-trace ;;
    balanced) run balanced-kernel python3 scripts/tune_decode.py --buckets --balanced --configs "64,4,3,1"
              NANOVLLM_BALANCED_DECODE=1 run balanced-bench python3 bench.py ;;
    gemm)    run gemm python3 scripts/bench_decode_gemm.py ;;
    gemmstages) run gemmstages python3 scripts/sweep_gemm_stages.py ;;
    prefillprofile) NANOVLLM_PDL=0 run prefillprofile python3 scripts/profile_step.py --prefill ;;
    sample)  run sample python3 scripts/bench_sample.py ;;
    sampletopk) run sampletopk python3 scripts/bench_sample_top_k.py ;;
    splits)  run splits python3 scripts/tune_decode.py --splits 4,8,12,16,20,24,28,32,40,48,56,64,80 ;;
    nanobatch) run nanobatch python3 scripts/bench_nanobatch.py --batch 256 128 --balanced 100,132,264 ;;
    nanobatchtail) run nanobatchtail python3 scripts/bench_nanobatch.py --batch 96 64 48 32 16 --warm-steps 900 --balanced 132,264 ;;
    ablate)  run ablate python3 scripts/ablate_step.py ;;
    replay)  run replay python3 scripts/profile_step.py --batch 256 128 64 32 8 1 --replay ;;
    decoderamp) run decoderamp python3 scripts/probe_decode_ramp.py ;;
    decodeloads) run decodeloads python3 scripts/probe_decode_loads.py ;;
    barrier) run barrier python3 scripts/bench_grid_barrier.py --rows 16
             run barrier64 python3 scripts/bench_grid_barrier.py --rows 64
             run barriersync python3 scripts/bench_grid_barrier.py --sync-only ;;
    prefilltiles) run prefilltiles python3 scripts/tune_prefill.py ;;
    lmhead)  run lmhead python3 scripts/bench_lm_head_sample.py ;;
    libgemm) run libgemm python3 scripts/probe_library_gemm.py ;;
    ncu)     ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
             for target in "decode 256 _decode_split_kernel" "decode 32 _decode_split_kernel" "o 16 _gemm_kernel" \
                           "o 256 _gemm_kernel" "gate_up 16 _gemm_kernel" "qkv 16 _qkv_rope_kernel"; do
               set -- $target
               run "ncu-$1-$2" "$ncu_bin" --clock-control none --kernel-name "regex:$3" --launch-skip 2 --launch-count 1 \
                 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
                 --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
                 python3 scripts/ncu_targets.py "$1" "$2"
             done ;;
    green)   run green python3 scripts/bench_green_overlap.py --batch 256 128 --gemm-sms 24 32 40 48 ;;
    single)  run single python3 bench.py --single --json "$OUTDIR/bench_single.json" ;;
    moe)     run moetests python3 -m pytest tests/kernels/test_moe.py tests/gpu/test_moe_gpu.py -q -p no:cacheprovider --durations=8
             run moekernels python3 scripts/bench_moe.py ;;
    moesweep) run moesweep python3 scripts/bench_moe.py --sweep --tokens ${MOE_TOKENS:-16,256} ;;
    benchmoe) run benchmoe python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --json "$OUTDIR/bench_qwen3_30b_a3b.json" ;;
    singlemoe) run singlemoe python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --single --json "$OUTDIR/bench_qwen3_30b_a3b_single.json" ;;
    profilemoe) run profilemoe python3 bench.py --config benchmarks/configs/qwen3-30b-a3b.json --profile ;;
    tp)      run tp python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py -q -p no:cacheprovider --durations=8 ;;
    bench8btp) run bench8btp python3 bench.py --config benchmarks/configs/qwen3-8b.json -tp 2 --json "$OUTDIR/bench_qwen3_8b_tp2.json" ;;
    bench8btp1shot) NANOVLLM_ONE_SHOT_ALL_REDUCE=1 run bench8btp1shot python3 bench.py --config benchmarks/configs/qwen3-8b.json -tp 2 --json "$OUTDIR/bench_qwen3_8b_tp2_one_shot.json" ;;
    bench8b) run bench8b python3 bench.py --config benchmarks/configs/qwen3-8b.json --json "$OUTDIR/bench_qwen3_8b.json" ;;
    *) echo "unknown stage $stage"; status=1 ;;
  esac
done
exit $status
