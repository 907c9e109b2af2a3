#!/usr/bin/env bash
# One call on a GPU machine: build everything for the local GPU, run the GPU tests and the benchmarks, keep the logs
# under $OUT (or ./gpu_logs), and print a short table last.
#   scripts/gpu_check.sh [tests|bench|all|model|decode] [extra make args]
#   [RUNS=2] scripts/gpu_check.sh decode-ab INFER...   decode of infer_sdm builds, interleaved RUNS times, one checkpoint
#   [RUNS=1] scripts/gpu_check.sh step-ab TRAIN[:KEYS]...   the flagship step profile of train_sdm builds and the mean
#                                                      of 8 unprofiled graph steps, interleaved;
#                                                      KEYS: extra config keys, comma-separated (a:sdm.grad_bank_dtype=fp32)
#   [RUNS=2] [OP_ARGS='3 grad'] scripts/gpu_check.sh op-ab BENCH...   `bench_sdm_op $OP_ARGS` of builds, interleaved:
#                                                      the op's kernels
#   (no builds named: the default build and every `make variant` build of that program, build/variants/; `tests` also
#   runs every `make variant` build of a GPU test, reported apart from the sum)
# With build/gpu_pack.tar.xz (scripts/gpu_pack.sh) the binaries come from the pack and the build is a no-op.
# tests: gpu_test_model alone (it measures device memory), then the other GPU tests side by side (about 45 s on an
# H200 from a pack, against minutes one after the other), summed as `make test-gpu` sums them.
# model: instead of tests and benches, the whole-model figures of BENCHMARKS.md: the flagship's step profile (8 steps,
# about 1.5 minutes and a 24 GB checkpoint under $MODEL_RUN, default /tmp/sdm_flagship_check), generation from that
# checkpoint (infer_sdm --bench: prefill, decode at batch 1, 8, 32) and debug_hybrid's training speed.
# decode: the generation figures alone: decode's products and the dependent-kernel floor (bench_layers), the flagship
# SDM layer's decode step (bench_sdm_layer 3), and infer_sdm --bench on a one-step flagship checkpoint (about 3
# minutes with the build).
# decode-ab, step-ab: A/Bs of builds made elsewhere (e.g. nvcc ... -DMATMUL_GEMV_STAGES=2 infer_sdm.cu -o build/x),
# carried with the tree, or of one build with other keys: a kernel timed alone and the whole step have disagreed, so
# a change to decode or training is decided on the step. On a GPU of less than 100 GB the flagship runs with int4
# snapshots and the FFN product recomputed (63.4 GiB measured; the config as shipped takes 87.8).
set -u -o pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
source_digest() {
    find . -path ./build -prune -o -path ./.git -prune -o \( -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \
        -o -name Makefile \) -type f -print | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -d' ' -f1
}
[ "$what" = --source-digest ] && { source_digest; exit; }
out=${OUT:-gpu_logs}; mkdir -p "$out"
# every log of the call in one archive too, whose name sorts first: a tool that brings back only a few files of
# $OUT (the device tool here: eight) then brings back all of them
trap 'tar -czf "$out/all_logs.tar.gz" --exclude=all_logs.tar.gz -C "$out" . 2>/dev/null' EXIT
jobs=$(nproc 2>/dev/null || echo 4)

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  git log -1 --format='commit %h %s'; } \
    2>&1 | tee "$out/machine.txt"

# The binaries from build/gpu_pack.tar.xz (scripts/gpu_pack.sh) where it was built from these sources for this
# GPU_ARCH: unpacked and touched, newer than the sources copied here, so make builds nothing.
if [ -f build/gpu_pack.tar.xz ]; then
    if [ "$(tar -xJOf build/gpu_pack.tar.xz build/gpu_pack.id)" = "$(source_digest) ${GPU_ARCH:-sm_90a}" ]; then
        tar -xJvf build/gpu_pack.tar.xz | xargs touch
        echo "binaries from build/gpu_pack.tar.xz"
    else
        echo "build/gpu_pack.tar.xz was built from other sources: ignored, building here"
    fi
fi
case $what in decode-ab | step-ab | op-ab) builds=("$@"); set -- ;; esac
# an A/B without builds named: the default build, then every `make variant` build of that program here
if [ "$what" = decode-ab ] || [ "$what" = step-ab ] || [ "$what" = op-ab ] && [ ${#builds[@]} -eq 0 ]; then
    case $what in
    decode-ab) prog=infer_sdm builds=(./infer_sdm) ;;
    step-ab) prog=train_sdm builds=(./train_sdm) ;;
    op-ab) prog=tests/bench_sdm_op builds=(build/bench_sdm_op) ;;
    esac
    for id in build/variants/*.id; do
        [ -f "$id" ] && [ "$(cut -d' ' -f3 "$id")" = "$prog" ] && builds+=("${id%.id}")
    done
fi
make -j"$jobs" GPU_ARCH=${GPU_ARCH:-sm_90a} "$@" compile-cuda prepare_data >"$out/build.log" 2>&1
build_rc=$?
tail -n 20 "$out/build.log"

# The flagship's keys for this GPU: the config as shipped where it fits, else int4 snapshots and recomputed FFNs.
base_keys="logging.freq=1 checkpoint.eval_every=0 probe_freq=0" keys=$base_keys
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
if [ "${mib:-0}" -lt 100000 ]; then
    keys="$keys sdm.snapshot_quant=int4 distributed.recompute_ffn=true"
    echo "the flagship with int4 snapshots and recomputed FFNs: ${mib:-?} MiB of GPU memory"
fi
# A one-step flagship checkpoint in $1 for the decode figures (its weights' values do not matter to the speed).
flagship_checkpoint() {
    rm -rf "$1" # a run folder with a checkpoint would be resumed
    ./train_sdm -c configs/sdm_flagship.cfg steps=1 checkpoint.dump_every=1 $keys run_dir="$1" >"$out/flagship.log" 2>&1
}

if [ "$what" = decode-ab ]; then
    run=${MODEL_RUN:-/tmp/sdm_flagship_check}
    flagship_checkpoint "$run" || { echo "the flagship checkpoint failed: $out/flagship.log"; exit 1; }
    for i in $(seq "${RUNS:-2}"); do
        j=0
        for v in "${builds[@]}"; do
            j=$((j + 1))
            echo "== $v, run $i"
            "$v" "$run" --bench --max-new 200 2>&1 | tee "$out/decode_${j}_$(basename "$v")_$i.log" |
                grep -E 'decode|sdm:'
        done
    done
    # each build's best run, ms a step: a step ahead (as generation runs), then one step at a time
    echo "| build | batch 1 | batch 8 | batch 32 | one at a time: 1 | 8 | 32 |"
    j=0
    for v in "${builds[@]}"; do
        j=$((j + 1))
        cat "$out"/decode_${j}_"$(basename "$v")"_*.log | awk -v name="$v" '
            function best(arr, k, x) { if (!(k in arr) || x < arr[k]) arr[k] = x }
            /^decode batch +[0-9]+: / { k = $3; sub(":", "", k); best(ahead, k, $6) }
            /^decode batch +[0-9]+ one step at a time: / { best(alone, $3, $9) }
            END { printf "| %s | %s | %s | %s | %s | %s | %s |\n", name, ahead[1], ahead[8], ahead[32], alone[1],
                         alone[8], alone[32] }'
    done
    exit
fi

if [ "$what" = op-ab ]; then
    for i in $(seq "${RUNS:-2}"); do
        for v in "${builds[@]}"; do
            echo "== $v, run $i"
            "$v" ${OP_ARGS:-3 grad} 2>&1 | tee "$out/op_$(basename "$v")_$i.log" | grep -E '^shape|^  backward|^  forward \(|parts'
        done
    done
    exit
fi

if [ "$what" = step-ab ]; then
    for i in $(seq "${RUNS:-1}"); do
        j=0
        for v in "${builds[@]}"; do
            j=$((j + 1))
            bin=${v%%:*} extra=
            [ "$bin" != "$v" ] && extra=${v#*:}
            log="$out/step_${j}_$(basename "$bin")_$i.log"
            rm -rf /tmp/sdm_step_ab
            echo "== $v, run $i"
            "$bin" -c configs/sdm_flagship.cfg steps=16 logging.profile=5 checkpoint.dump_every=0 $keys ${extra//,/ } \
                run_dir=/tmp/sdm_step_ab >"$log" 2>&1 || echo "exit $?"
            sed -n '/^  part/,/total/p' "$log"
            # steps 1-7 run eager (3-7 timed part by part), step 8 captures the graph: 9-16 are the step as trained
            grep -E '^step +(9|1[0-6])/' "$log" | sed 's/.*| \([0-9.]*\) ms\/step.*/\1/' |
                awk '{s += $1; n++} END {if (n) printf "graph steps 9-16: mean %.1f ms/step (%d steps)\n", s / n, n}'
            grep -E '^step +16/' "$log"
        done
    done
    exit
fi

if [ "$what" = model ]; then
    run=${MODEL_RUN:-/tmp/sdm_flagship_check}
    rm -rf "$run" "$run.debug" # a run folder with a checkpoint would be resumed
    ./train_sdm -c configs/sdm_flagship.cfg steps=8 logging.profile=5 checkpoint.dump_every=8 $keys run_dir="$run" \
        >"$out/flagship.log" 2>&1
    model_rc=$?
    ./infer_sdm "$run" --bench --max-new 200 >"$out/infer_bench.log" 2>&1 || model_rc=1
    ./train_sdm -c configs/debug_hybrid.cfg steps=12 checkpoint.dump_every=0 $base_keys run_dir="$run.debug" \
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
    dec_rc=0
    build/bench_layers >"$out/bench_layers.log" 2>&1 || dec_rc=1
    build/bench_sdm_layer 3 >"$out/bench_sdm_layer.log" 2>&1 || dec_rc=1
    flagship_checkpoint "$run" || dec_rc=1
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
    make --no-print-directory "$@" train_sdm infer_sdm prepare_data >/dev/null # gpu_test_infer, _train run them
    rm -f "$out"/t_*.log "$out"/variant_*.log "$out/test_gpu_variants.log"
    tests/run_all.sh build/gpu_test_model >"$out/t_model.log" 2>&1
    for t in $(ls build/gpu_test_* | grep -v -e '\.d$' -e gpu_test_model); do
        tests/run_all.sh "$t" >"$out/t_${t#build/gpu_test_}.log" 2>&1 &
    done
    wait
    for l in "$out"/t_*.log; do printf '%-20s %s\n' "$(basename "$l" .log | cut -c3-)" "$(tail -n 1 "$l")"; done |
        tee "$out/test_gpu.log"
    awk '$3 != "passed," {f++; next} {p += $2; f += $4} END {printf "%d passed, %d failed\n", p, f; exit f > 0 || NR == 0}' \
        "$out/test_gpu.log" |
        tee -a "$out/test_gpu.log"
    test_rc=${PIPESTATUS[0]}
    # `make variant` builds of the GPU tests (a knob's other value), after the sum and apart from it
    for id in build/variants/*.id; do
        [ -f "$id" ] || continue
        case $(cut -d' ' -f3 "$id") in tests/gpu_test_*) ;; *) continue ;; esac
        v=${id%.id} log="$out/variant_$(basename "${id%.id}").log"
        tests/run_all.sh "$v" >"$log" 2>&1 || test_rc=1
        echo "variant $(basename "$v") ($(cut -d' ' -f4- "$id")): $(tail -n 1 "$log")" | tee -a "$out/test_gpu_variants.log"
    done
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
[ "$what" != bench ] && cat "$out/test_gpu.log" && { [ -f "$out/test_gpu_variants.log" ] && cat "$out/test_gpu_variants.log"; true; }
if [ "$what" != tests ]; then
    for l in "$out"/bench_*.log; do
        [ -f "$l" ] && { echo "-- $(basename "$l" .log)"; grep -E '^\|' "$l" | tail -n 20; }
    done
fi
[ $build_rc -eq 0 ] && [ $test_rc -eq 0 ] && [ $bench_rc -eq 0 ]
