#!/usr/bin/env bash
# Build every program, GPU test and benchmark here (a machine without a GPU will do) and pack them into
# build/gpu_pack.tar.xz (about 27 MB, and `make variant` builds), so that a GPU machine with a short lease runs
# instead of compiling. scripts/gpu_check.sh unpacks the pack when it finds one whose sources' digest
# (build/gpu_pack.id, every C, CUDA source and header and the Makefile, and GPU_ARCH) is the tree's and its own, so a
# stale pack is never run.
# Send the pack with the tree (it is git-ignored: name it where your tool copies ignored paths).
#   [GPU_ARCH=sm_90a] scripts/gpu_pack.sh [extra make args]
set -eu -o pipefail
cd "$(dirname "$0")/.."
make -j"$(nproc 2>/dev/null || echo 2)" GPU_ARCH="${GPU_ARCH:-sm_90a}" "$@" compile-cuda prepare_data
echo "$(scripts/gpu_check.sh --source-digest) ${GPU_ARCH:-sm_90a}" > build/gpu_pack.id
# `make variant` builds (decode-ab, step-ab) made from these sources for this GPU_ARCH; others are left out
variants=()
for id in build/variants/*.id; do
    [ -f "$id" ] || continue
    if [ "$(cut -d' ' -f1-2 "$id")" = "$(cat build/gpu_pack.id)" ]; then variants+=("${id%.id}" "$id")
    else echo "left out (built from other sources): ${id%.id}"; fi
done
# the binaries alone: a dependency file (.d) names this machine's headers (nccl.h), and one missing there would
# make the GPU machine rebuild the programs that include it (-MP)
tar -cJf build/gpu_pack.tar.xz build/gpu_pack.id $(ls build/gpu_test_* build/bench_* | grep -v '\.d$') train_sdm \
    infer_sdm prepare_data svgplot ${variants[@]+"${variants[@]}"}
ls -l build/gpu_pack.tar.xz
