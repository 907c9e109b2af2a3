#!/usr/bin/env bash
# One call on a GPU machine: build everything for the local GPU, run the GPU tests and the benchmarks, keep the logs
# under $OUT (or ./gpu_logs), and print a short table last.
#   scripts/gpu_check.sh [tests|bench|all|model|decode] [extra make args]
# With build/gpu_pack.tar.xz (scripts/gpu_pack.sh) the binaries come from the pack and the build is a no-op.
# model: instead of tests and benches, the whole-model figures of BENCHMARKS.md: the flagship's step profile (8 steps,
# about 1.5 minutes and a 24 GB checkpoint under $MODEL_RUN, default /tmp/sdm_flagship_check), generation from that
# checkpoint (infer_sdm --bench: prefill, decode at batch 1, 8, 32) and debug_hybrid's training speed.
# decode: the generation figures alone: decode's products and the dependent-kernel floor (bench_layers), the flagship
# SDM layer's decode step (bench_sdm_layer 3), and infer_sdm --bench on a one-step flagship checkpoint (about 3
# minutes with the build).
set -u -o pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
source_digest() {
    find . -path ./build -prune -o -path ./.git -prune -o \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
        -o -name Makefile \) -type f -print | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -d' ' -f1
}
[ "$what" = --source-digest ] && { source_digest; exit; }
out=${OUT:-gpu_logs}; mkdir -p "$out"
jobs=$(nproc 2>/dev/null || echo 4)

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  git log -1 --format='commit %h %s'; } \
    2>&1 | tee "$out/machine.txt"

# The binaries from build/gpu_pack.tar.xz (scripts/gpu_pack.sh) where it was built from these sources for this
# GPU_ARCH: unpacked and touched, newer than the sources copied here, so make builds nothing.
if [ -f build/gpu_pack.tar.xz ]; then
    if [ "$(tar -xJOf build/gpu_pack.tar.xz build/gpu_pack.id)" = "$(source_digest) ${GPU_ARCH:-sm_90}" ]; then
        tar -xJvf build/gpu_pack.tar.xz | xargs touch
        echo "binaries from build/gpu_pack.tar.xz"
    else
        echo "build/gpu_pack.tar.xz was built from other sources: ignored, building here"
    fi
fi
make -j"$jobs" GPU_ARCH=${GPU_ARCH:-sm_90} "$@" compile-cuda prepare_data >"$out/build.log" 2>&1
build_rc=$?
tail -n 20 "$out/build.log"

if [ "$what" = model ]; then
    run=${MODEL_RUN:-/tmp/sdm_flagship_check}
    keys="logging.freq=1 checkpoint.eval_every=0 probe_freq=0"
    rm -rf "$run" "$run.debug" # a run folder with a checkpoint would be resumed
    ./train_sdm -c configs/sdm_flagship.cfg steps=8 logging.profile=5 checkpoint.dump_every=8 $keys run_dir="$run" \
        >"$out/flagship.log" 2>&1
    model_rc=$?
    ./infer_sdm "$run" --bench --max-new 200 >"$out/infer_bench.log" 2>&1 || model_rc=1
    ./train_sdm -c configs/debug_hybrid.cfg steps=12 checkpoint.dump_every=0 $keys run_dir="$run.debug" \
        >"$out/debug_hybrid.log" 2>&1 || model_rc=1
    echo
    echo "==================== summary ===================="
    echo "build: exit $build_rc; model runs: exit $model_rc"
    grep -E '^step +8/' "$out/flagship.log"
    sed -n '/^  part/,/total/p' "$out/flagship.log"
    grep -E 'prefill|decode' "$out/infer_bench.log"
    grep -E '^step +12/' "$out/debug_hybrid.log"
    [ $build_rc -eq 0 ] && [ $model_rc -eq 0 ]
    exit
fi

if [ "$what" = decode ]; then
    run=${MODEL_RUN:-/tmp/sdm_flagship_check}
    rm -rf "$run"
    dec_rc=0
    build/bench_layers >"$out/bench_layers.log" 2>&1 || dec_rc=1
    build/bench_sdm_layer 3 >"$out/bench_sdm_layer.log" 2>&1 || dec_rc=1
    ./train_sdm -c configs/sdm_flagship.cfg steps=1 checkpoint.dump_every=1 logging.freq=1 checkpoint.eval_every=0 \
        probe_freq=0 run_dir="$run" >"$out/flagship.log" 2>&1 || dec_rc=1
    ./infer_sdm "$run" --bench --max-new 200 >"$out/infer_bench.log" 2>&1 || dec_rc=1
    echo
    echo "==================== summary ===================="
    echo "build: exit $build_rc; decode runs: exit $dec_rc"
    echo "-- bench_layers"; grep -E '^\|' "$out/bench_layers.log" | tail -n 40
    echo "-- bench_sdm_layer 3"; grep -E 'decode step|parts alone|top-k alone' "$out/bench_sdm_layer.log"
    grep -E 'prefill|decode' "$out/infer_bench.log"
    [ $build_rc -eq 0 ] && [ $dec_rc -eq 0 ]
    exit
fi

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
