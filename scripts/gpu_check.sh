#!/usr/bin/env bash
# One call on a GPU machine: build everything for the local GPU, run the GPU tests and the benchmarks, keep the logs
# under $OUT (or ./gpu_logs), and print a short table last.
#   scripts/gpu_check.sh [tests|bench|all] [extra make args]
set -u -o pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
out=${OUT:-gpu_logs}; mkdir -p "$out"
jobs=$(nproc 2>/dev/null || echo 4)

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  git log -1 --format='commit %h %s'; } \
    2>&1 | tee "$out/machine.txt"

make -j"$jobs" GPU_ARCH=${GPU_ARCH:-sm_90} "$@" compile-cuda >"$out/build.log" 2>&1
build_rc=$?
tail -n 20 "$out/build.log"

test_rc=0
if [ "$what" != bench ]; then
    make --no-print-directory "$@" test-gpu 2>&1 | tee "$out/test_gpu.log"
    test_rc=${PIPESTATUS[0]}
fi
bench_rc=0
if [ "$what" != tests ]; then
    for b in build/bench_*; do
        [ -x "$b" ] || continue
        echo "== $b"
        "$b" 2>&1 | tee "$out/$(basename "$b").log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
    done
fi

echo
echo "==================== summary ===================="
echo "build: exit $build_rc"
if [ "$what" != bench ]; then
    grep -E '^== |passed, [0-9]+ failed$' "$out/test_gpu.log" | paste - - 2>/dev/null | sed 's/^== //'
fi
if [ "$what" != tests ]; then
    for l in "$out"/bench_*.log; do
        [ -f "$l" ] && { echo "-- $(basename "$l" .log)"; grep -E '^\|' "$l" | tail -n 20; }
    done
fi
[ $build_rc -eq 0 ] && [ $test_rc -eq 0 ] && [ $bench_rc -eq 0 ]
