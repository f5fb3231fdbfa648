#!/usr/bin/env bash
# A/B of a code change on the GPU in one device call: the benchmark on the working tree (B) and on a
# copy with the change taken out (A), alternating A B A B ..., so both arms share the machine's state.
#   git diff > ab.diff                          (the change; untracked, it travels with the tree)
#   bash scripts/ab_bench.sh ab.diff [ROUNDS]   (on the device machine; ROUNDS defaults to 1)
# Each round runs `bench.py --log-compiles` (a Triton compile inside the timed run would skew an arm)
# and `bench.py --single` per arm (AB_SINGLE=0 skips it); BENCH_ARGS adds arguments to both (e.g. a --config).
set -euo pipefail
patch_file=$(realpath "$1")
rounds=${2:-1}
base=/tmp/ab_base
rm -rf "$base"
cp -r . "$base"
(cd "$base" && patch -p1 -R --quiet < "$patch_file")
export PYTHONUNBUFFERED=1
for ((i = 1; i <= rounds; i++)); do
  for arm in A B; do
    dir=$([ "$arm" = A ] && echo "$base" || echo .)
    echo "=== round $i, arm $arm ($([ "$arm" = A ] && echo "without" || echo "with") $1)"
    (cd "$dir" && python bench.py --log-compiles ${BENCH_ARGS:-} 2>&1 | grep -E "Throughput|Roofline|steps, wall|step walls|triton compile|timed run|allocator|garbage" || true)
    if [ "${AB_SINGLE:-1}" != 0 ]; then
      (cd "$dir" && python bench.py --single ${BENCH_ARGS:-} 2>&1 | grep "Throughput" || true)
    fi
  done
done
